// A few rows through a linear layer for x86 CPUs with AVX2 + FMA, built and loaded by
// cpu_kernels.py:
//
//   out (M, N) = x (M, K) fp32 @ w (N, K).T fp32 + bias (N,),   M small (decode batches)
//
// A decode step of a few running requests reads every weight once and does 2 * M flops per
// weight read: at these M neither the bytes nor the flops alone bound it, and MKL's sgemm
// (which packs its operands for large M) reached ~60 GFLOP/s at 16 rows on weights that come
// from memory, under half of what these cores do. Here each thread takes whole blocks of
// kW = 3 weight rows (7 kB for K = 576: they stay in L1) and runs every group of kX = 4 rows
// of x against them: 12 accumulators, 3 weight loads and 1 x load per 12 FMAs, so each weight
// byte comes from memory once and x (M * K floats) stays in L2. The next block's rows are
// prefetched while the current one is computed, one 64-byte line per row every 16 floats of
// the first group's loop (spread out, as fp32_gemv.cpp does: measured 10-25% faster at 2-9
// rows and 5-10% at 16 than a burst of prefetches at the block's start, on the 2-core AVX2
// EPYC with weights coming from memory). Dot products are summed in 8 lanes, then
// across them: another order than MKL's, fp32 rounding apart.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int kW = 3;  // weight rows per block
constexpr int kX = 4;  // x rows per group

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// out[m0 + i, n0 + j] for i < MX, j < NW: the dot products of x rows m0.. and w rows n0...
// `ahead`: rows to prefetch while this tile runs (NW rows of K floats), or nullptr.
template <int MX, int NW>
void tile(const float* x, const float* w, const float* bias, float* out, int64_t m0,
          int64_t n0, int64_t N, int64_t K, const float* ahead) {
    __m256 acc[MX][NW];
    for (int i = 0; i < MX; i++)
        for (int j = 0; j < NW; j++) acc[i][j] = _mm256_setzero_ps();
    const float* xr = x + m0 * K;
    const float* wr = w + n0 * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (ahead && (k & 15) == 0)
            for (int j = 0; j < NW; j++) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T0);
        __m256 wv[NW];
        for (int j = 0; j < NW; j++) wv[j] = _mm256_loadu_ps(wr + j * K + k);
        for (int i = 0; i < MX; i++) {
            __m256 xv = _mm256_loadu_ps(xr + i * K + k);
            for (int j = 0; j < NW; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MX; i++) {
        for (int j = 0; j < NW; j++) {
            float sum = hsum(acc[i][j]);
            for (int64_t t = k; t < K; t++) sum += xr[i * K + t] * wr[j * K + t];
            out[(m0 + i) * N + n0 + j] = bias ? sum + bias[n0 + j] : sum;
        }
    }
}

// Every x row against weight rows n0 .. n0 + NW.
template <int NW>
void block(const float* x, const float* w, const float* bias, float* out, int64_t M,
           int64_t n0, int64_t N, int64_t K) {
    // the next block's rows, prefetched during the first group of x rows
    const float* ahead = n0 + 2 * NW <= N ? w + (n0 + NW) * K : nullptr;
    int64_t m = 0;
    for (; m + kX <= M; m += kX, ahead = nullptr) tile<kX, NW>(x, w, bias, out, m, n0, N, K, ahead);
    switch (M - m) {
        case 3: tile<3, NW>(x, w, bias, out, m, n0, N, K, ahead); break;
        case 2: tile<2, NW>(x, w, bias, out, m, n0, N, K, ahead); break;
        case 1: tile<1, NW>(x, w, bias, out, m, n0, N, K, ahead); break;
        default: break;
    }
}

}  // namespace

extern "C" void fp32_gemm_small(const float* x, const float* w, const float* bias, float* out,
                                int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = N / kW;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) block<kW>(x, w, bias, out, M, b * kW, N, K);
    for (int64_t n = blocks * kW; n < N; n++) block<1>(x, w, bias, out, M, n, N, K);
}
