// One row through a linear layer for x86 CPUs with AVX2 + FMA, built and loaded by
// cpu_kernels.py:
//
//   out (N,) = w (N, K) fp32 @ x (K,) fp32 + bias (N,)
//
// Batch-1 decode reads every weight once per token and does two flops per weight read: it is
// bound by memory bandwidth. MKL's sgemv streamed SmolLM2's weights at ~10 GB/s here, with
// two threads no faster than one. This kernel gives each thread whole blocks of 4 weight
// rows (4 accumulators, x loaded once per 8 columns for all 4), and prefetches the rows 8
// ahead in software.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int64_t kRows = 4;           // weight rows per block
constexpr int64_t kPrefetchRows = 8;   // how far ahead the rows are prefetched

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <int NB>
void block(const float* x, const float* w, const float* bias, float* out, int64_t n, int64_t N,
           int64_t K) {
    __m256 acc[NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm256_setzero_ps();
    const float* ahead = n + kPrefetchRows + NB <= N ? w + (n + kPrefetchRows) * K : nullptr;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (ahead && (k & 15) == 0)  // one 64-byte line of each row every 16 floats
            for (int j = 0; j < NB; j++) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T0);
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int j = 0; j < NB; j++) acc[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (n + j) * K + k), acc[j]);
    }
    for (int j = 0; j < NB; j++) {
        float sum = hsum(acc[j]);
        for (int64_t t = k; t < K; t++) sum += x[t] * w[(n + j) * K + t];
        out[n + j] = bias ? sum + bias[n + j] : sum;
    }
}

}  // namespace

extern "C" void fp32_gemv(const float* x, const float* w, const float* bias, float* out,
                          int64_t N, int64_t K, int threads) {
    const int64_t blocks = N / kRows;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) block<kRows>(x, w, bias, out, b * kRows, N, K);
    for (int64_t n = blocks * kRows; n < N; n++) block<1>(x, w, bias, out, n, N, K);
}
