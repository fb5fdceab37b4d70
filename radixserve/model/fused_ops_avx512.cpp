// fused_ops.cpp for CPUs with AVX-512 and AVX512-BF16: the same three ops, the same C
// interface and the same roundings (read that file first), 16 lanes wide; widths a multiple
// of 16 (rotary: head size a multiple of 32). SiLU as torch writes it, x / (1 + e^-x).
//
// Measured on Intel Xeon (AMX), 2 threads, SmolLM2's widths, us per call, AVX2 -> AVX-512:
// RMSNorm 7.3 -> 5.8 at 16 rows, 268 -> 170 at 2176; SiLU * up 26.3 -> 9.7 at 16, 1456 ->
// 885 at 2176; rotary of q and k 7.7 -> 5.5 at 16, 356 -> 196 at 2176.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd_avx512.h"

namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements below which one thread does the work

using simd512::exp16;
using simd512::load_bf16;
using simd512::round_bf16;
using simd512::store_bf16;

}  // namespace

extern "C" {

void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t dim,
                   float eps, int num_threads) {
    const int threads = rows * dim >= kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * dim;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 v = load_bf16(xr + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(xr + d), scale));
            store_bf16(out + r * dim + d, _mm512_mul_ps(load_bf16(w + d), normed));
        }
    }
}

void add_rms_norm_bf16(const uint16_t* x, const uint16_t* delta, const uint16_t* w, uint16_t* sum,
                       uint16_t* out, int64_t rows, int64_t dim, float eps, int num_threads) {
    const int threads = rows * dim >= kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t* sr = sum + r * dim;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 v = round_bf16(_mm512_add_ps(load_bf16(x + r * dim + d), load_bf16(delta + r * dim + d)));
            store_bf16(sr + d, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(sr + d), scale));
            store_bf16(out + r * dim + d, _mm512_mul_ps(load_bf16(w + d), normed));
        }
    }
}

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
        for (int64_t d = 0; d < half; d += 16) {
            __m512 x1 = load_bf16(x + d), x2 = load_bf16(x + half + d);
            __m512 c1 = load_bf16(c + d), c2 = load_bf16(c + half + d);
            __m512 s1 = load_bf16(s + d), s2 = load_bf16(s + half + d);
            __m512 a = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(x2, s1)));
            __m512 b = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2)));
            store_bf16(x + d, a);
            store_bf16(x + half + d, b);
        }
    }
}

void silu_mul_bf16(const uint16_t* h, uint16_t* out, int64_t rows, int64_t half, int num_threads) {
    const int threads = rows * half >= kParallelMin ? num_threads : 1;
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* gate = h + r * 2 * half;
        const uint16_t* up = gate + half;
        for (int64_t d = 0; d < half; d += 16) {
            __m512 g = load_bf16(gate + d);
            __m512 den = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            __m512 act = round_bf16(_mm512_div_ps(g, den));
            store_bf16(out + r * half + d, _mm512_mul_ps(act, load_bf16(up + d)));
        }
    }
}

}  // extern "C"
