// Decode attention over the KV pool for x86 CPUs with AVX2 + FMA (+ F16C), built and loaded by
// cpu_kernels.py.
//
//   out[b, h] = softmax_s(q[b, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// for each request b of a decode batch (one query token each), its positions
// s < seq_len[b] (with a sliding window W > 0: only seq_len[b] - W <= s), slot(b, s) =
// req_to_token[row[b], s], and G = heads / kv_heads query heads per KV head (GQA). K and V are read where they lie in the pool: no gathered copy of
// the batch's keys and values, no padding to the longest request, no mask. The torch path
// (index_select into a padded batch, then SDPA) spent 30% of a batch-64 decode step on this.
//
// One task per (request, KV head): its G query heads share every K and V row read; the
// consecutive rows of one request that a verification step brings (a decode step's token
// and its drafted tokens, speculative decoding) make one task, each row read once for all
// their queries, each query's sums in the same order as alone (bit-identical). Scores
// are computed 8 positions at a time (one transposed reduction instead of 8), exp is a
// vectorized polynomial, the weighted sum of V keeps every head's accumulators in
// registers, and rows are prefetched ahead (they are scattered over a pool far bigger than
// the caches). Arithmetic in fp32; the softmax subtracts the row maximum like every
// reference does. The pool may hold fp32, bf16 or fp16 (`--kv-cache-dtype`): 16-bit rows
// are widened to fp32 in registers as they are loaded, so a 16-bit pool halves the bytes
// this kernel reads (what it is bound by at long contexts).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "decode_pieces.h"
#include "simd_avx2.h"

namespace {

constexpr int64_t kMaxGroup = 8;  // query heads per KV head held in registers at once
// Consecutive rows of one request attended together, at most. This build on the AMD EPYC
// Zen 4 (30 layers, contexts of 512, fp32, ms, one row at a time -> together): 1 request
// with 8 drafted tokens 7.9 -> 6.3, 4 with 4 18.7 -> 14.6, 16 with 2 53.4 -> 40.0; plain
// decode steps unchanged (not measured on an AVX2-only CPU).
constexpr int64_t kMaxRows = 16;
// Rows are prefetched kFar positions ahead into L2, not into L1 (the figures in
// decode_attention_avx512.cpp; this build on the same AMD EPYC Zen 4, 30 layers x 16
// requests x 544 positions, L2 + L1 8 ahead -> L2 alone, ms: fp32 26.1 -> 21.5, bf16 14.3 ->
// 14.4; not measured on an AVX2-only CPU).
// fp32 rows 32 positions ahead (8 KB of a 64-dim head's rows, as 64 bf16 positions are),
// each pass's first rows fetched before it starts, as in the AVX-512 build. This build on an
// AMD EPYC Zen 4, SmolLM2's shape, the kernel alone over 30 layers' pools (medians of 26
// alternated, two runs, bit-identical): 8 prefixes of 2 requests 1.13-1.14x, nothing shared
// 1.14x. (Not measured on an AVX2-only CPU.)
template <typename T>
constexpr int64_t kFar = sizeof(T) == 4 ? 32 : 64;

using simd::exp8;
using simd::hsum;

// The 8 sums of a[0..7]'s lanes, as one vector (sum of a[i] in lane i).
inline __m256 hsum8(const __m256* a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    // lanes: s0123 = [0 1 2 3 | 0 1 2 3] partial halves, s4567 likewise for 4..7
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
    __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

// 8 pool values at p as fp32 lanes, for each element type a pool may hold.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p, std::true_type /*bf16*/) { return simd::load_bf16(p); }
inline __m256 load8(const uint16_t* p, std::false_type /*fp16*/) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));  // F16C
}

struct Fp32 {
    using T = float;
    static __m256 load(const T* p) { return load8(p); }
};
struct Bf16 {
    using T = uint16_t;
    static __m256 load(const T* p) { return load8(p, std::true_type()); }
};
struct Fp16 {
    using T = uint16_t;
    static __m256 load(const T* p) { return load8(p, std::false_type()); }
};

// Prefetch the `dim` values at p (one head's K or V row part) into L2.
template <typename T>
inline void prefetch_row_l2(const T* p, int64_t dim) {
    const char* bytes = (const char*)p;
    for (int64_t b = 0; b < dim * (int64_t)sizeof(T); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T1);
}

// One task's queries: query i is head i % group of the task's KV head in its row i / group;
// its values at q + offset(i), its output at out + offset(i) (a row's heads `dim` apart,
// rows `row_stride` apart); it attends positions [0, lens[row]) of the slots (rows of one
// request differ by their drafted tokens: lengths not decreasing). Scores `stride` apart.
struct Queries {
    const float* q;
    const int64_t* lens;
    int64_t count, group, row_stride, dim, stride;
    int64_t offset(int64_t i) const { return i / group * row_stride + i % group * dim; }
    int64_t len(int64_t i) const { return lens[i / group]; }
    int64_t longest() const { return lens[(count - 1) / group]; }
};

// scores[i * stride + s] = q_i . k(s) * scale for s < len(i), 8 positions per pass; the
// rows kFar positions ahead are prefetched (the pool is far bigger than the caches and the
// rows are scattered: without it the kernel waited on memory, ~4 GB/s).
template <typename Kv>
void scores_of(const Queries& qs, const typename Kv::T* k_pool, const int64_t* slots,
               int64_t kv_heads, int64_t kh, float scale, float* scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    using T = typename Kv::T;
    const int64_t len = qs.longest(), dim = qs.dim;
    for (int64_t s = 0; s < len && s < kFar<T>; s++)  // the first rows, past the loop's prefetches
        prefetch_row_l2(k_pool + (slots[s] * kv_heads + kh) * dim, dim);
    for (int64_t s0 = 0; s0 < len; s0 += 8) {
        const int64_t n = len - s0 < 8 ? len - s0 : 8;
        for (int64_t s = s0 + kFar<T>; s < len && s < s0 + kFar<T> + 8; s++)
            prefetch_row_l2(k_pool + (slots[s] * kv_heads + kh) * dim, dim);
        const typename Kv::T* k[8];
        for (int64_t t = 0; t < 8; t++) k[t] = k_pool + (slots[s0 + (t < n ? t : 0)] * kv_heads + kh) * dim;
        for (int64_t i = 0; i < qs.count; i++) {
            const int64_t m = qs.len(i) - s0 < 8 ? qs.len(i) - s0 : 8;  // this query's
            if (m <= 0) continue;
            const float* qg = qs.q + qs.offset(i);
            float* row = scores + i * qs.stride;
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                __m256 qv = _mm256_loadu_ps(qg + d);
                for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, Kv::load(k[t] + d), acc[t]);
            }
            __m256 sums = _mm256_mul_ps(hsum8(acc), vscale);
            if (m == 8) {
                _mm256_storeu_ps(row + s0, sums);
            } else {
                alignas(32) float tmp[8];
                _mm256_store_ps(tmp, sums);
                for (int64_t t = 0; t < m; t++) row[s0 + t] = tmp[t];
            }
        }
    }
}

// row[0..len) = softmax(row), in place.
void softmax(float* row, int64_t len) {
    int64_t s = 0;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; s + 8 <= len; s += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + s));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float peak = -INFINITY;
    for (int i = 0; i < 8; i++) peak = lanes[i] > peak ? lanes[i] : peak;
    for (; s < len; s++) peak = row[s] > peak ? row[s] : peak;
    const __m256 vpeak = _mm256_set1_ps(peak);
    __m256 vtotal = _mm256_setzero_ps();
    for (s = 0; s + 8 <= len; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), vpeak));
        _mm256_storeu_ps(row + s, e);
        vtotal = _mm256_add_ps(vtotal, e);
    }
    if (s < len) {  // the tail through the same exp, padded with -inf (e = 0)
        alignas(32) float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = s + i < len ? row[s + i] - peak : -INFINITY;
        _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
        for (int64_t i = 0; s + i < len; i++) row[s + i] = tail[i];
        vtotal = _mm256_add_ps(vtotal, _mm256_load_ps(tail));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(vtotal));
    for (s = 0; s + 8 <= len; s += 8) _mm256_storeu_ps(row + s, _mm256_mul_ps(_mm256_loadu_ps(row + s), inv));
    for (; s < len; s++) row[s] *= 1.0f / hsum(vtotal);
}

// out_i = sum_{s < len(i)} p[i * stride + s] * v(s) for queries first..first+count-1
// (count <= kMaxGroup), 32 dims per pass with every query's accumulators in registers, in
// the order of s; the first pass prefetches whole rows ahead.
template <typename Kv>
void weighted_values(const float* p, const Queries& qs, int64_t first, int64_t count,
                     const typename Kv::T* v_pool, const int64_t* slots, int64_t kv_heads,
                     int64_t kh, float* out) {
    const int64_t dim = qs.dim, stride = qs.stride;
    const int64_t shortest = qs.len(first), len = qs.len(first + count - 1);
    const float* pg = p + first * stride;
    constexpr int64_t far = kFar<typename Kv::T>;
    for (int64_t s = 0; s < len && s < far; s++)
        prefetch_row_l2(v_pool + (slots[s] * kv_heads + kh) * dim, dim);
    for (int64_t d = 0; d < dim; d += 32) {
        __m256 acc[kMaxGroup][4];
        for (int64_t g = 0; g < count; g++)
            for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < len; s++) {
            if (d == 0 && s + far < len) prefetch_row_l2(v_pool + (slots[s + far] * kv_heads + kh) * dim, dim);
            const typename Kv::T* v = v_pool + (slots[s] * kv_heads + kh) * dim + d;
            __m256 vv[4];
            for (int i = 0; i < 4; i++) vv[i] = Kv::load(v + 8 * i);
            for (int64_t g = 0; g < count; g++) {
                if (s >= shortest && s >= qs.len(first + g)) continue;  // past this query's
                __m256 w = _mm256_broadcast_ss(pg + g * stride + s);
                for (int i = 0; i < 4; i++) acc[g][i] = _mm256_fmadd_ps(w, vv[i], acc[g][i]);
            }
        }
        for (int64_t g = 0; g < count; g++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + qs.offset(first + g) + d + 8 * i, acc[g][i]);
    }
}

template <typename Kv>
void attend(const float* q, const void* k_pool_, const void* v_pool_, const int64_t* table,
            const int64_t* rows, const int64_t* seq_lens, float* out, int64_t batch,
            int64_t heads, int64_t kv_heads, int64_t dim, int64_t table_stride, float scale,
            int num_threads, int64_t window) {
    const typename Kv::T* k_pool = (const typename Kv::T*)k_pool_;
    const typename Kv::T* v_pool = (const typename Kv::T*)v_pool_;
    const int64_t group = heads / kv_heads;
    // one request's rows a piece: consecutive batch rows (the plan's order is the batch's)
    const auto plan = decode_pieces::plan(table, table_stride, rows, seq_lens, batch, window, kMaxRows,
                                          kv_heads, num_threads, decode_pieces::kOwnRowsOnly);
    const int64_t tasks = plan.pieces.size() * kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;  // (Q, S) of the current task
        int64_t lens[kMaxRows];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b0 = plan.pieces[task / kv_heads].first, nrows = plan.pieces[task / kv_heads].rows;
            const int64_t kh = task % kv_heads;
            // a piece of several rows has no window: each attends from position 0
            const int64_t first_pos = window > 0 && seq_lens[b0] > window ? seq_lens[b0] - window : 0;
            for (int64_t r = 0; r < nrows; r++) lens[r] = seq_lens[b0 + r] - first_pos;
            const int64_t* slots = table + rows[b0] * table_stride + first_pos;
            const int64_t first = (b0 * heads + kh * group) * dim;  // row 0's head 0
            const Queries qs{q + first, lens, nrows * group, group, heads * dim, dim, lens[nrows - 1]};
            scores.resize(qs.count * qs.stride);
            scores_of<Kv>(qs, k_pool, slots, kv_heads, kh, scale, scores.data());
            for (int64_t i = 0; i < qs.count; i++) softmax(scores.data() + i * qs.stride, qs.len(i));
            for (int64_t i = 0; i < qs.count; i += kMaxGroup)
                weighted_values<Kv>(scores.data(), qs, i, std::min(kMaxGroup, qs.count - i), v_pool,
                                    slots, kv_heads, kh, out + first);
        }
    }
}

}  // namespace

extern "C" {

// q, out: (B, H, D) fp32; k_pool, v_pool: (slots, KH, D) in the pool's dtype, kv_dtype 0
// fp32, 1 bf16, 2 fp16 (3: bf16 with a bf16 query, which the AVX-512 variant treats apart;
// here as 1); table: (rows, table_stride) int64; rows, seq_lens: (B,) int64.
// Every tensor contiguous. D must be a multiple of 32 and H / KH at most kMaxGroup
// (decode_attention_supports says so to the caller). window > 0: each request attends only
// its last `window` positions (a sliding-window layer); 0: all of them.
void decode_attention(const float* q, const void* k_pool, const void* v_pool,
                      const int64_t* table, const int64_t* rows, const int64_t* seq_lens,
                      float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads, int kv_dtype,
                      int64_t window) {
    auto run = kv_dtype == 1 || kv_dtype == 3 ? attend<Bf16> : kv_dtype == 2 ? attend<Fp16> : attend<Fp32>;
    run(q, k_pool, v_pool, table, rows, seq_lens, out, batch, heads, kv_heads, dim, table_stride,
        scale, num_threads, window);
}

int decode_attention_supports(int64_t heads, int64_t kv_heads, int64_t dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && dim % 32 == 0;
}

}  // extern "C"
