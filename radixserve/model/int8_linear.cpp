// Weight-only int8 linear for x86 CPUs with AVX2 + FMA, built and loaded by quantization.py.
//
//   out (M, N) = (x (M, K) fp32 @ w (N, K) int8 ^T) * scale (N,) + bias (N,)
//
// Decode multiplies a few rows by every weight, so it is bound by the bytes of weights read:
// int8 reads a quarter of fp32's. Each weight row is widened to fp32 in registers (8 at a
// time) and used by up to 2 rows of x at once; blocks of 4 weight rows are shared between
// threads (OpenMP: the process's one libgomp, the one torch loaded). PyTorch's own `_weight_int8pack_mm` is vectorized for AVX-512 only and runs
// scalar code on AVX2 (5-50x slower than fp32 there).
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int64_t kWeightRows = 4;  // weight rows per block: 4 (8 with 2 x rows) accumulators
constexpr int64_t kChunkRows = 64;  // x rows per pass: 64 x 1536 fp32 stays in L2
// Software prefetch of the weight rows 8 ahead: without it one thread streamed int8 weights
// at 3.5 GB/s, with it 5.4 GB/s (30 SmolLM2 layers, batch 1; distance 4-32 all alike).
constexpr int64_t kPrefetchRows = 8;

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 fp32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// out[m:m+MB, n:n+NB]
template <int MB, int NB>
void tile(const float* x, const int8_t* w, const float* scale, const float* bias, float* out,
          int64_t m, int64_t n, int64_t N, int64_t K) {
    __m256 acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    // the block kPrefetchRows ahead, one cache line per row every 64 bytes of k
    const int8_t* ahead = n + kPrefetchRows + NB <= N ? w + (n + kPrefetchRows) * K : nullptr;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (ahead && (k & 63) == 0)
            for (int j = 0; j < NB; j++) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T0);
        __m256 wv[NB];
        for (int j = 0; j < NB; j++) wv[j] = load8(w + (n + j) * K + k);
        for (int i = 0; i < MB; i++) {
            __m256 xv = _mm256_loadu_ps(x + (m + i) * K + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MB; i++) {
        for (int j = 0; j < NB; j++) {
            float sum = hsum(acc[i][j]);
            for (int64_t t = k; t < K; t++) sum += x[(m + i) * K + t] * (float)w[(n + j) * K + t];
            sum *= scale[n + j];
            out[(m + i) * N + n + j] = bias ? sum + bias[n + j] : sum;
        }
    }
}

template <int NB>
void rows(const float* x, const int8_t* w, const float* scale, const float* bias, float* out,
          int64_t m0, int64_t m1, int64_t n, int64_t N, int64_t K) {
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) tile<2, NB>(x, w, scale, bias, out, m, n, N, K);
    if (m < m1) tile<1, NB>(x, w, scale, bias, out, m, n, N, K);
}

}  // namespace

extern "C" void int8_linear(const float* x, const int8_t* w, const float* scale,
                            const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                            int threads) {
    const int64_t blocks = N / kWeightRows;
    for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t m1 = m0 + kChunkRows < M ? m0 + kChunkRows : M;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            rows<kWeightRows>(x, w, scale, bias, out, m0, m1, b * kWeightRows, N, K);
        for (int64_t n = blocks * kWeightRows; n < N; n++)
            rows<1>(x, w, scale, bias, out, m0, m1, n, N, K);
    }
}
