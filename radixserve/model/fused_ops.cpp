// The element-wise parts of a bf16 decoder layer, each one pass over memory instead of a
// chain of torch ops (each of which reads and writes the whole tensor and rounds to bf16 in
// between): RMSNorm, the rotary embedding of q and k, SiLU(gate) * up. x86 AVX2 + FMA;
// built and loaded by cpu_kernels.py. Arithmetic in fp32 on bf16 inputs, each result
// rounded to bf16 once (round to nearest even), where the torch ops round after every op.
//
// Measured on Intel Xeon (AMX), 2 threads, a bf16 prefill of 16 x 544 tokens of SmolLM2:
// these ops were 45% of the forward in torch (mul 19%, add 6%, copies 6%, pow 5%,
// silu 5%, cat 2%).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd_avx2.h"

namespace {

constexpr int64_t kParallelMin = 1 << 15;  // elements below which one thread does the work

using simd::exp8;
using simd::hsum;
using simd::load_bf16;

// 8 fp32 lanes rounded to bf16 (nearest, ties to even; inputs are finite), kept as fp32.
inline __m256 round_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFFF0000)));
}

// 8 fp32 lanes rounded to bf16, stored at p.
inline void store_bf16(uint16_t* p, __m256 v) {
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

}  // namespace

extern "C" {

// out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)), bf16 rows of `dim` (a multiple of
// 8), as transformers' LlamaRMSNorm computes it in bf16 (the normed row rounded to bf16,
// then the product with the bf16 weight rounded again).
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t dim,
                   float eps, int num_threads) {
    const int threads = rows * dim >= kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 v = load_bf16(xr + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 normed = round_bf16(_mm256_mul_ps(load_bf16(xr + d), scale));
            store_bf16(out + r * dim + d, _mm256_mul_ps(load_bf16(w + d), normed));
        }
    }
}

// sum[r] = bf16(x[r] + delta[r]) (the residual stream, as torch's bf16 add rounds it), then
// out[r] = that row normed as rms_norm_bf16 norms it: one pass for a decoder layer's
// residual add and the norm after it. sum may be x itself.
void add_rms_norm_bf16(const uint16_t* x, const uint16_t* delta, const uint16_t* w, uint16_t* sum,
                       uint16_t* out, int64_t rows, int64_t dim, float eps, int num_threads) {
    const int threads = rows * dim >= kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t* sr = sum + r * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 v = round_bf16(_mm256_add_ps(load_bf16(x + r * dim + d), load_bf16(delta + r * dim + d)));
            store_bf16(sr + d, v);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 normed = round_bf16(_mm256_mul_ps(load_bf16(sr + d), scale));
            store_bf16(out + r * dim + d, _mm256_mul_ps(load_bf16(w + d), normed));
        }
    }
}

// q (T, H, D) and k (T, KH, D) bf16, rotated in place by their token's cos/sin rows (T, D)
// (bf16, the halves equal): x * cos + rotate_half(x) * sin with rotate_half(x) =
// [-x2, x1], each product and the sum rounded to bf16 as the torch ops round them. D a
// multiple of 16.
void rotary_bf16(uint16_t* q, uint16_t* k, const uint16_t* cos, const uint16_t* sin, int64_t tokens,
                 int64_t heads, int64_t kv_heads, int64_t dim, int num_threads) {
    const int64_t half = dim / 2, per_token = heads + kv_heads;
    const int threads = tokens * per_token * dim >= kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tokens * per_token; i++) {
        const int64_t t = i / per_token, h = i % per_token;
        uint16_t* x = h < heads ? q + (t * heads + h) * dim : k + (t * kv_heads + h - heads) * dim;
        const uint16_t* c = cos + t * dim;
        const uint16_t* s = sin + t * dim;
        for (int64_t d = 0; d < half; d += 8) {
            __m256 x1 = load_bf16(x + d), x2 = load_bf16(x + half + d);
            __m256 c1 = load_bf16(c + d), c2 = load_bf16(c + half + d);
            __m256 s1 = load_bf16(s + d), s2 = load_bf16(s + half + d);
            // first half: x1 * c1 + (-x2) * s1; second: x2 * c2 + x1 * s2
            __m256 a = _mm256_sub_ps(round_bf16(_mm256_mul_ps(x1, c1)), round_bf16(_mm256_mul_ps(x2, s1)));
            __m256 b = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, c2)), round_bf16(_mm256_mul_ps(x1, s2)));
            store_bf16(x + d, a);
            store_bf16(x + half + d, b);
        }
    }
}

// out (rows, half) = bf16(silu(gate)) * up, rounded to bf16, for h (rows, 2 * half) bf16 =
// [gate | up] per row (the fused gate/up product); half a multiple of 8.
void silu_mul_bf16(const uint16_t* h, uint16_t* out, int64_t rows, int64_t half, int num_threads) {
    const int threads = rows * half >= kParallelMin ? num_threads : 1;
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* gate = h + r * 2 * half;
        const uint16_t* up = gate + half;
        for (int64_t d = 0; d < half; d += 8) {
            __m256 g = load_bf16(gate + d);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            __m256 act = round_bf16(_mm256_mul_ps(g, sig));
            store_bf16(out + r * half + d, _mm256_mul_ps(act, load_bf16(up + d)));
        }
    }
}

}  // extern "C"
