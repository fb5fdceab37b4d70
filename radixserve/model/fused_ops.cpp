// The element-wise parts of a decoder layer, each one pass over memory instead of a chain of
// torch ops (each of which reads and writes the whole tensor): RMSNorm (alone, or with the
// residual add before it), the rotary embedding of q and k, SiLU(gate) * up. Built and
// loaded by cpu_kernels.py for x86 AVX2 + FMA (8 lanes), and the same source for AVX-512
// with AVX512-BF16 (16 lanes): the kernels below are written once against the few vector
// operations `v` defines for the build's width, and both builds compute the same values.
// Each kernel comes for bf16 tensors (`_bf16`) and fp32 ones (`_f32`), written once over
// the element type (`io<T>`). Arithmetic in fp32; a bf16 kernel rounds each result to bf16
// where the torch ops round (round to nearest even), an fp32 one rounds as the fp32 torch
// ops do: every product and sum on its own (no fused multiply-add: contraction is off in
// this file), so that only the order of RMSNorm's sum of squares differs from torch's,
// within fp32 rounding. SiLU's e^x is torch's own (SLEEF's expf_u10, written out in the simd
// headers with its multiply-adds): fp32 SiLU * up is torch's bit for bit.
//
// Measured on Intel Xeon (AMX), 2 threads, a bf16 prefill of 16 x 544 tokens of SmolLM2:
// these ops were 45% of the forward in torch (mul 19%, add 6%, copies 6%, pow 5%,
// silu 5%, cat 2%). The 16-lane build against the 8-lane one, us per call, SmolLM2's
// widths: SiLU * up 26.3 -> 9.7 at 16 rows, 1456 -> 885 at 2176; RMSNorm 7.3 -> 5.8, 268 ->
// 170; rotary 7.7 -> 5.5, 356 -> 196.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

// a * b + c stays two roundings, as in the torch ops these kernels replace
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#ifdef __AVX512F__
#include "simd_avx512.h"
#else
#include "simd_avx2.h"
#endif

namespace {

#ifdef __AVX512F__
namespace v {
using F = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kParallelMin = 1 << 14;  // elements below which one thread does the work
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(F a) { return _mm512_reduce_add_ps(a); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a); }
using simd512::load_bf16;
using simd512::round_bf16;
using simd512::store_bf16;
inline F exp(F x) { return simd512::exp16_torch(x); }
}  // namespace v
#else
namespace v {
using F = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kParallelMin = 1 << 15;
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(F a) { return simd::hsum(a); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a); }
using simd::load_bf16;
using simd::round_bf16;
using simd::store_bf16;
inline F exp(F x) { return simd::exp8_torch(x); }
}  // namespace v
#endif

// Loading, storing and rounding a vector of the kernels' element type: bf16 (as uint16_t
// bits) rounds to bf16 where torch's bf16 ops round; fp32 keeps every op's own rounding.
template <typename T>
struct io;

template <>
struct io<uint16_t> {
    static v::F load(const uint16_t* p) { return v::load_bf16(p); }
    static void store(uint16_t* p, v::F a) { v::store_bf16(p, a); }
    static v::F round(v::F a) { return v::round_bf16(a); }
    static float get(const uint16_t* p) {
        const uint32_t bits = (uint32_t)*p << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    static void put(uint16_t* p, float f) {  // round to nearest even, as torch rounds
        uint32_t bits;
        memcpy(&bits, &f, sizeof f);
        if ((bits & 0x7fffffffu) > 0x7f800000u)
            *p = 0x7fc0;  // NaN
        else
            *p = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    static float round1(float f) {
        uint16_t h;
        put(&h, f);
        return get(&h);
    }
};

template <>
struct io<float> {
    static v::F load(const float* p) { return v::load(p); }
    static void store(float* p, v::F a) { v::store(p, a); }
    static v::F round(v::F a) { return a; }
    static float get(const float* p) { return *p; }
    static void put(float* p, float f) { *p = f; }
    static float round1(float f) { return f; }
};

// out = w * T(row * rsqrt(sum_sq / dim + eps)) for a row whose squares sum to sum_sq
// (LlamaRMSNorm: the normed row in the model's dtype, then the product with the weight).
template <typename T>
inline void norm_row(const T* row, float sum_sq, const T* w, T* out, int64_t dim, float eps) {
    const v::F scale = v::set1(1.0f / sqrtf(sum_sq / (float)dim + eps));
    for (int64_t d = 0; d < dim; d += v::kLanes) {
        v::F normed = io<T>::round(v::mul(io<T>::load(row + d), scale));
        io<T>::store(out + d, v::mul(io<T>::load(w + d), normed));
    }
}

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int num_threads) {
    const int threads = rows * dim >= v::kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T* xr = x + r * dim;
        v::F acc = v::set1(0.0f);
        for (int64_t d = 0; d < dim; d += v::kLanes) {
            v::F e = io<T>::load(xr + d);
            acc = v::fmadd(e, e, acc);
        }
        norm_row(xr, v::sum(acc), w, out + r * dim, dim, eps);
    }
}

template <typename T>
void add_rms_norm(const T* x, const T* delta, const T* w, T* sum, T* out, int64_t rows,
                  int64_t dim, float eps, int num_threads) {
    const int threads = rows * dim >= v::kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        T* sr = sum + r * dim;
        v::F acc = v::set1(0.0f);
        for (int64_t d = 0; d < dim; d += v::kLanes) {
            v::F e = io<T>::round(v::add(io<T>::load(x + r * dim + d), io<T>::load(delta + r * dim + d)));
            io<T>::store(sr + d, e);
            acc = v::fmadd(e, e, acc);
        }
        norm_row(sr, v::sum(acc), w, out + r * dim, dim, eps);
    }
}

template <typename T>
void rotary(T* q, T* k, const T* cos, const T* sin, int64_t tokens, int64_t heads,
            int64_t kv_heads, int64_t dim, int num_threads) {
    const int64_t half = dim / 2, per_token = heads + kv_heads;
    const int threads = tokens * per_token * dim >= v::kParallelMin ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tokens * per_token; i++) {
        const int64_t t = i / per_token, h = i % per_token;
        T* x = h < heads ? q + (t * heads + h) * dim : k + (t * kv_heads + h - heads) * dim;
        const T* c = cos + t * dim;
        const T* s = sin + t * dim;
        for (int64_t d = 0; d < half; d += v::kLanes) {
            v::F x1 = io<T>::load(x + d), x2 = io<T>::load(x + half + d);
            v::F c1 = io<T>::load(c + d), c2 = io<T>::load(c + half + d);
            v::F s1 = io<T>::load(s + d), s2 = io<T>::load(s + half + d);
            // first half: x1 * c1 + (-x2) * s1; second: x2 * c2 + x1 * s2
            v::F a = v::sub(io<T>::round(v::mul(x1, c1)), io<T>::round(v::mul(x2, s1)));
            v::F b = v::add(io<T>::round(v::mul(x2, c2)), io<T>::round(v::mul(x1, s2)));
            io<T>::store(x + d, a);
            io<T>::store(x + half + d, b);
        }
    }
}

// Blocks of this many elements are the unit of work of silu_mul (a row of a product laid
// out transposed can be long).
constexpr int64_t kSiluBlock = 512;

template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t rows, int64_t width, int64_t stride,
              int num_threads) {
    const int64_t blocks = (width + kSiluBlock - 1) / kSiluBlock;
    const int threads = rows * width >= v::kParallelMin ? num_threads : 1;
    const v::F one = v::set1(1.0f), zero = v::set1(0.0f);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows * blocks; i++) {
        const int64_t r = i / blocks, begin = (i % blocks) * kSiluBlock;
        const int64_t end = begin + kSiluBlock < width ? begin + kSiluBlock : width;
        const T* g_row = gate + r * stride;
        const T* u_row = up + r * stride;
        for (int64_t d = begin; d < end; d += v::kLanes) {
            v::F g = io<T>::load(g_row + d);
            // torch's silu: x / (1 + e^-x)
            v::F act = io<T>::round(v::div(g, v::add(one, v::exp(v::sub(zero, g)))));
            io<T>::store(out + r * width + d, v::mul(act, io<T>::load(u_row + d)));
        }
    }
}

// One LoRA site (radixserve/lora/adapter.py SiteWeights; decode_layers.py LORA_SITE_FIELDS):
// its A (R, in), the columns' adapters in a stack (or 0: one adapter), how many modules,
// then per module (at most 3) the span [lo, hi) of x @ A.T it takes, its B (hi - lo, width)
// (0: not trained) and its output's width.
struct LoraSite {
    int64_t a, rank, owners, modules;
    struct {
        int64_t lo, hi, b, width;
    } module[3];
};
static_assert(sizeof(LoraSite) == 16 * sizeof(int64_t), "decode_layers.py LORA_SITE_FIELDS");

// Rows lora_add takes together: each row of A and of B is read once per block of rows.
constexpr int64_t kLoraRows = 4;

// x @ A.T for a block of rows (xr: `count` rows of `in` in fp32) into xa (count x rank),
// each in T as the product's result is; a row takes only its own adapter's columns (own:
// the rows' adapters in the stack, owners: the columns'; null: one adapter), 0 elsewhere.
template <typename T>
void lora_down(const float* xr, int64_t count, int64_t in, const T* a, int64_t rank,
               const int64_t* owners, const int64_t* own, float* xa) {
    for (int64_t c = 0; c < rank; c++) {
        int64_t take[kLoraRows], n = 0;
        for (int64_t j = 0; j < count; j++) {
            xa[j * rank + c] = 0.0f;
            if (own[j] >= 0 && (owners == nullptr || owners[c] == own[j])) take[n++] = j;
        }
        if (n == 0) continue;
        const T* row = a + c * in;
        v::F sums[kLoraRows];
        for (int64_t k = 0; k < n; k++) sums[k] = v::set1(0.0f);
        int64_t d = 0;
        for (; d + v::kLanes <= in; d += v::kLanes) {
            const v::F w = io<T>::load(row + d);
            for (int64_t k = 0; k < n; k++)
                sums[k] = v::fmadd(v::load(xr + take[k] * in + d), w, sums[k]);
        }
        for (int64_t k = 0; k < n; k++) {
            float sum = v::sum(sums[k]);
            for (int64_t e = d; e < in; e++) sum += xr[take[k] * in + e] * io<T>::get(row + e);
            xa[take[k] * rank + c] = io<T>::round1(sum);
        }
    }
}

// outs[j] += xa[j, lo:hi] @ b (b: hi - lo rows of `width`) for a block of rows, the sums
// in fp32 (columns in order), each output rounded once; rows whose columns are all 0 (the
// base model's, another adapter's) are left alone.
template <typename T>
void lora_up(const float* xa, int64_t count, int64_t rank, int64_t lo, int64_t hi, const T* b,
             int64_t width, T* const* outs) {
    bool used[kLoraRows];
    int64_t first = hi, last = lo;  // the columns some row of the block takes
    for (int64_t j = 0; j < count; j++) {
        used[j] = false;
        for (int64_t c = lo; c < hi; c++) {
            if (xa[j * rank + c] == 0.0f) continue;
            used[j] = true;
            first = c < first ? c : first;
            last = c + 1 > last ? c + 1 : last;
        }
    }
    if (first >= last) return;
    int64_t d = 0;
    for (; d + v::kLanes <= width; d += v::kLanes) {
        v::F acc[kLoraRows];
        for (int64_t j = 0; j < count; j++) acc[j] = v::set1(0.0f);
        for (int64_t c = first; c < last; c++) {
            const v::F w = io<T>::load(b + (c - lo) * width + d);
            for (int64_t j = 0; j < count; j++) {
                const float s = xa[j * rank + c];
                if (s != 0.0f) acc[j] = v::fmadd(v::set1(s), w, acc[j]);
            }
        }
        for (int64_t j = 0; j < count; j++)
            if (used[j]) io<T>::store(outs[j] + d, v::add(io<T>::load(outs[j] + d), acc[j]));
    }
    for (; d < width; d++) {
        for (int64_t j = 0; j < count; j++) {
            if (!used[j]) continue;
            float acc = 0.0f;
            for (int64_t c = first; c < last; c++) acc += xa[j * rank + c] * io<T>::get(b + (c - lo) * width + d);
            io<T>::put(outs[j] + d, io<T>::get(outs[j] + d) + acc);
        }
    }
}

template <typename T>
void lora_add(const T* x, int64_t rows, int64_t in, const LoraSite& site, T* const* outs,
              const int64_t* strides, const int64_t* row_owner, int num_threads) {
    const T* a = (const T*)site.a;
    const int64_t rank = site.rank;
    if (a == nullptr) return;
    // the adapters' rows, grouped by adapter (a block of one adapter's rows reads its
    // matrices once; in a block of several each row's would be read apart, ~2x slower)
    std::vector<int64_t> order;
    order.reserve(rows);
    for (int64_t t = 0; t < rows; t++)
        if (row_owner == nullptr || row_owner[t] >= 0) order.push_back(t);  // (-1: base model)
    if (row_owner != nullptr)
        std::stable_sort(order.begin(), order.end(),
                         [row_owner](int64_t p, int64_t q) { return row_owner[p] < row_owner[q]; });
    const int64_t taken = (int64_t)order.size();
    const int64_t blocks = (taken + kLoraRows - 1) / kLoraRows;
    const int threads = blocks > 1 && taken * in * rank >= v::kParallelMin ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> xr(kLoraRows * in), xa(kLoraRows * rank);
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            const int64_t* rows_of = order.data() + block * kLoraRows;
            const int64_t left = taken - block * kLoraRows;
            const int64_t count = left < kLoraRows ? left : kLoraRows;
            int64_t own[kLoraRows];
            for (int64_t j = 0; j < count; j++) {
                own[j] = row_owner != nullptr ? row_owner[rows_of[j]] : 0;
                for (int64_t i = 0; i < in; i++)
                    xr[j * in + i] = io<T>::get(x + rows_of[j] * in + i);
            }
            lora_down(xr.data(), count, in, a, rank, (const int64_t*)site.owners, own, xa.data());
            for (int64_t m = 0; m < site.modules; m++) {
                const auto& mod = site.module[m];
                if (mod.b == 0) continue;
                T* rows_out[kLoraRows];
                for (int64_t j = 0; j < count; j++) rows_out[j] = outs[m] + rows_of[j] * strides[m];
                lora_up(xa.data(), count, rank, mod.lo, mod.hi, (const T*)mod.b, mod.width,
                        rows_out);
            }
        }
    }
}

}  // namespace

extern "C" {

// out[r] = w * T(x[r] * rsqrt(mean(x[r]^2) + eps)), rows of `dim` (a multiple of the
// lanes), as transformers' LlamaRMSNorm computes it in the tensors' dtype.
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t dim,
                   float eps, int num_threads) {
    rms_norm(x, w, out, rows, dim, eps, num_threads);
}
void rms_norm_f32(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps,
                  int num_threads) {
    rms_norm(x, w, out, rows, dim, eps, num_threads);
}

// sum[r] = T(x[r] + delta[r]) (the residual stream, as torch's add rounds it), then out[r] =
// that row normed as rms_norm norms it: one pass for a decoder layer's residual add and the
// norm after it. sum may be x itself.
void add_rms_norm_bf16(const uint16_t* x, const uint16_t* delta, const uint16_t* w, uint16_t* sum,
                       uint16_t* out, int64_t rows, int64_t dim, float eps, int num_threads) {
    add_rms_norm(x, delta, w, sum, out, rows, dim, eps, num_threads);
}
void add_rms_norm_f32(const float* x, const float* delta, const float* w, float* sum, float* out,
                      int64_t rows, int64_t dim, float eps, int num_threads) {
    add_rms_norm(x, delta, w, sum, out, rows, dim, eps, num_threads);
}

// q (T, H, D) and k (T, KH, D), rotated in place by their token's cos/sin rows (T, D) (the
// halves equal): x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], each
// product and the sum rounded as the torch ops round them. D a multiple of twice the lanes.
void rotary_bf16(uint16_t* q, uint16_t* k, const uint16_t* cos, const uint16_t* sin, int64_t tokens,
                 int64_t heads, int64_t kv_heads, int64_t dim, int num_threads) {
    rotary(q, k, cos, sin, tokens, heads, kv_heads, dim, num_threads);
}
void rotary_f32(float* q, float* k, const float* cos, const float* sin, int64_t tokens,
                int64_t heads, int64_t kv_heads, int64_t dim, int num_threads) {
    rotary(q, k, cos, sin, tokens, heads, kv_heads, dim, num_threads);
}

// out (rows, width) = T(silu(gate)) * up, rounded to T, where row r of gate and of up start
// at r * stride elements (the halves of a fused gate/up product's rows, [gate | up]:
// stride 2 * width; two separate products: stride width); width a multiple of the lanes.
void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t rows,
                   int64_t width, int64_t stride, int num_threads) {
    silu_mul(gate, up, out, rows, width, stride, num_threads);
}
void silu_mul_f32(const float* gate, const float* up, float* out, int64_t rows, int64_t width,
                  int64_t stride, int num_threads) {
    silu_mul(gate, up, out, rows, width, stride, num_threads);
}

// LoRA: one site's adapters' products of x's rows (rows, in) added in place onto its
// modules' base products: module m's output row t at outs[m] + t * strides[m] (views of a
// fused product: q/k/v, gate/up) gets (x @ A.T)[t, lo:hi] @ B, that product in fp32, x @ A.T
// rounded to T first as torch's product is. row_owner (rows,): each row's adapter in a
// stack (-1: the base model's row, left alone), or null: every row uses the site's one
// adapter.
void lora_add_bf16(const uint16_t* x, int64_t rows, int64_t in, const int64_t* site,
                   uint16_t* const* outs, const int64_t* strides, const int64_t* row_owner,
                   int num_threads) {
    lora_add(x, rows, in, *(const LoraSite*)site, outs, strides, row_owner, num_threads);
}
void lora_add_f32(const float* x, int64_t rows, int64_t in, const int64_t* site,
                  float* const* outs, const int64_t* strides, const int64_t* row_owner,
                  int num_threads) {
    lora_add(x, rows, in, *(const LoraSite*)site, outs, strides, row_owner, num_threads);
}

}  // extern "C"
