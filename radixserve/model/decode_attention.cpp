// Decode attention over the KV pool for x86 CPUs with AVX2 + FMA (+ F16C), built and loaded by
// cpu_kernels.py.
//
//   out[b, h] = softmax_s(q[b, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// for each request b of a decode batch (one query token each), its positions
// s < seq_len[b] (with a sliding window W > 0: only seq_len[b] - W <= s), slot(b, s) =
// req_to_token[row[b], s], and G = heads / kv_heads query heads per KV head (GQA). K and V
// are read where they lie in the pool: no gathered copy of the batch's keys and values, no
// padding to the longest request, no mask. The torch path
// (index_select into a padded batch, then SDPA) spent 30% of a batch-64 decode step on this.
//
// One task per piece of the batch, all its KV heads (a head a task where there are too few
// pieces to keep the threads busy, or the piece's queries are many: heads_a_task): each
// slot's row of K and V is read whole, once, the rows in order, each K and V vector once
// for the G query heads that share it. A piece is a request's row, or the consecutive rows
// of one request that a verification step brings (a decode step's token and its drafted
// tokens, speculative decoding), or requests whose first slots are one cached prefix
// (kMinShared): each shared row read once for all their queries. Each query's sums run in
// the same order as alone (bit-identical). Scores of 8 positions are reduced at once (one
// transposed reduction instead of 8), exp is a vectorized polynomial, and rows are prefetched ahead (they may
// be scattered over a pool far bigger than the caches). Arithmetic in fp32; the softmax
// subtracts the row maximum like every reference does. The pool may hold fp32, bf16 or
// fp16 (`--kv-cache-dtype`): 16-bit rows are widened to fp32 in registers as they are
// loaded, so a 16-bit pool halves the bytes
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

constexpr int64_t kMaxGroup = 8;  // query heads per KV head, at most
// Rows a piece holds, at most. For one request's consecutive rows, this build on the AMD
// EPYC Zen 4 (30 layers, contexts of 512, fp32, ms, one row at a time -> together): 1
// request with 8 drafted tokens 7.9 -> 6.3, 4 with 4 18.7 -> 14.6, 16 with 2 53.4 -> 40.0;
// plain decode steps unchanged (not measured on an AVX2-only CPU).
constexpr int64_t kMaxRows = 16;
// Rows of different requests whose first kMinShared slots are the same (a cached prefix:
// the requests of one system prompt) are attended together too (decode_pieces.h): the
// prefix's K and V rows read once for all their queries, each row's own positions after it
// on their own, each query's sums in the same order as alone: bit-identical. AMD EPYC Zen 3,
// SmolLM2 fp32, the kernel alone over 30 layers' pools of 544 positions a request, 2
// threads, ms, each request apart -> together (medians of 14 alternated): 16 requests in
// pairs sharing 512 positions 17.6 -> 14.8, 32 of them 40.3 -> 35.3; 16 in fours sharing
// 256 20.5 -> 19.0; nothing shared 17.8-24.5 -> 17.8-24.2. (A prefix read again by the
// next request of a layer's call comes from L3 here: what sharing saves is less than the
// bytes.)
constexpr int64_t kMinShared = 64;
// Rows are prefetched kFar positions ahead into L2, not into L1 (the figures in
// decode_attention_avx512.cpp; this build on the same AMD EPYC Zen 4, 30 layers x 16
// requests x 544 positions, L2 + L1 8 ahead -> L2 alone, ms: fp32 26.1 -> 21.5, bf16 14.3 ->
// 14.4; not measured on an AVX2-only CPU).
// fp32 rows 32 positions ahead (8 KB of a 64-dim head's rows, as 64 bf16 positions are),
// each stretch's first rows fetched before it starts, as in the AVX-512 build. This build on an
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

// One task's queries: query i is head i % group of the task's first KV head in its piece
// row r = i / group, batch row batch_rows[r]; its values at q + offset(i), its output at out
// + offset(i) (a batch row's heads `dim` apart, batch rows `row_stride` apart; the task's
// next KV head's queries `group * dim` further), and it attends positions [0, lens[r]) of
// slots[r] (the rows' lengths differ: drafted tokens, other requests; rows in increasing
// length). Below `shared` (and its own length) every row's slots are the longest row's:
// one request's rows, or
// requests sharing a cached prefix, whose K and V rows there are read once for all. Each
// query's scores are `stride` apart.
struct Queries {
    const float* q;
    const int64_t* lens;
    const int64_t* batch_rows;
    const int64_t* const* slots;
    int64_t count, group, row_stride, dim, stride, shared;
    // offset(i) and len(i) of each query, worked out once into the caller's room for
    // `count` of each (a division each; the passes ask for them at every position)
    int64_t* offsets;
    int64_t* query_lens;
    void tabulate() {
        for (int64_t i = 0; i < count; i++) {
            offsets[i] = batch_rows[i / group] * row_stride + i % group * dim;
            query_lens[i] = lens[i / group];
        }
    }
    int64_t offset(int64_t i) const { return offsets[i]; }
    int64_t len(int64_t i) const { return query_lens[i]; }
    int64_t rows() const { return count / group; }
    int64_t longest() const { return lens[rows() - 1]; }
    const int64_t* common() const { return slots[rows() - 1]; }
    // positions [0, split()) are read once for every query (from the longest row's slots),
    // the rest row by row: whole blocks of 8 below it
    int64_t split() const { return longest() <= shared ? longest() : shared / 8 * 8; }
};

// Queries a pass holds in registers (their sums, or their weights) while it reads a row.
constexpr int64_t kPassQueries = 4;

// to[8 j] = q_j . k lane by lane (the products summed over the dims, one FMA chain a lane)
// for the M queries at q[j], a K row part of `dim` values at k: each K vector loaded once.
template <typename Kv, int M>
inline void dot_row(const float* const* q, const typename Kv::T* k, int64_t dim, __m256* to) {
    __m256 acc[M];
#pragma GCC unroll 8
    for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 kv = Kv::load(k + d);
#pragma GCC unroll 8
        for (int j = 0; j < M; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + d), kv, acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < M; j++) to[8 * j] = acc[j];
}

// out[j][d] += w[j] * v[d] for the M outputs at out[j], a V row part of `dim` values at v:
// each V vector loaded once.
template <typename Kv, int M>
inline void add_row(const __m256* w, const typename Kv::T* v, int64_t dim, float* const* out) {
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 vv = Kv::load(v + d);
#pragma GCC unroll 8
        for (int j = 0; j < M; j++)
            _mm256_storeu_ps(out[j] + d, _mm256_fmadd_ps(w[j], vv, _mm256_loadu_ps(out[j] + d)));
    }
}

// f(std::integral_constant<int, m>{}) for a count m of 1..kPassQueries known only at run
// time: the passes' loops over their queries unrolled, their sums in registers.
template <typename F>
inline void with_count(int64_t m, F f) {
    switch (m) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        default: f(std::integral_constant<int, kPassQueries>{}); break;
    }
}

// The task's part of each slot's row (a K or V pool's rows at `base`, `row` values apart).
template <typename T>
struct Rows {
    const T* base;
    int64_t row, span;
    const T* at(int64_t slot) const { return base + slot * row; }
    void fetch(int64_t slot) const { prefetch_row_l2(at(slot), span); }  // into L2
};

// Queries [first, end) of each of the task's heads on the positions [from, to) of `slots`,
// 8 at a time: scores[(h * count + i) * stride + s] = q_i . k(s) * scale for s < len(i).
// The rows are read in order, each slot's row whole (the task's part of it: every KV head's
// where the task takes them all), each K vector once for the queries of its head: a pass
// over the pool in the order it lies, which the hardware's prefetchers follow. Each query's
// sum over a row is one FMA chain per lane, in the order of the dims; 8 positions' sums are
// reduced at once (hsum8). AMD EPYC Zen 3, one thread streaming SmolLM2's pool (768-byte
// rows): 8 rows at a time, a head's part of each in turn (this kernel before) 8-9 GB/s, row
// by row 14-16 GB/s, a plain sum 17-19 GB/s. Rows kFar positions ahead are prefetched (the
// pool is far bigger than the caches and the rows may be scattered: without it the kernel
// waited on memory), those of the stretch's first kFar before it starts.
template <typename Kv>
void scores_stretch(const Queries& qs, Rows<typename Kv::T> k, const int64_t* slots, int64_t from,
                    int64_t to, int64_t first, int64_t end, int64_t heads, __m256 vscale,
                    float* scores, __m256* sums) {
    constexpr int64_t far = kFar<typename Kv::T>;
    const int64_t dim = qs.dim, count = qs.count;
    for (int64_t s = from; s < to && s < from + far; s++) k.fetch(slots[s]);
    for (int64_t s0 = from; s0 < to; s0 += 8) {
        const int64_t n = to - s0 < 8 ? to - s0 : 8;
        // sums[(h * count + i) * 8 + t]: query i of head h on position s0 + t (t >= n
        // repeats s0: their lanes are not stored)
        for (int64_t t = 0; t < 8; t++) {
            const int64_t s = s0 + (t < n ? t : 0);
            if (t < n && s + far < to) k.fetch(slots[s + far]);
            const typename Kv::T* row = k.at(slots[s]);
            for (int64_t h = 0; h < heads; h++) {
                for (int64_t i0 = first; i0 < end; i0 += kPassQueries) {
                    const int64_t m = end - i0 < kPassQueries ? end - i0 : kPassQueries;
                    if (s0 >= qs.len(i0 + m - 1)) continue;  // past all of these queries
                    const float* qg[kPassQueries];
                    for (int64_t j = 0; j < m; j++) qg[j] = qs.q + qs.offset(i0 + j) + h * qs.group * dim;
                    __m256* into = sums + (h * count + i0) * 8 + t;
                    with_count(m, [&](auto M) { dot_row<Kv, M()>(qg, row + h * dim, dim, into); });
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t i = first; i < end; i++) {
                const int64_t m = std::min(n, qs.len(i) - s0);  // this query's
                if (m <= 0) continue;
                float* out = scores + (h * count + i) * qs.stride;
                const __m256 all = _mm256_mul_ps(hsum8(sums + (h * count + i) * 8), vscale);
                if (m == 8) {
                    _mm256_storeu_ps(out + s0, all);
                } else {
                    alignas(32) float tmp[8];
                    _mm256_store_ps(tmp, all);
                    for (int64_t t = 0; t < m; t++) out[s0 + t] = tmp[t];
                }
            }
        }
    }
}

// body(slots, from, to, first, end) for each stretch of a task's positions in turn: below
// the split once for every query (from the longest row's slots), then each row's own
// positions for its queries. Each query's positions come in order, as alone.
template <typename Body>
inline void each_stretch(const Queries& qs, Body body) {
    const int64_t split = qs.split();
    body(qs.common(), 0, split, 0, qs.count);
    for (int64_t r = 0; r < qs.rows(); r++)
        body(qs.slots[r], split, qs.lens[r], r * qs.group, (r + 1) * qs.group);
}

// The scores of every query of the task, stretch by stretch.
template <typename Kv>
void scores_of(const Queries& qs, Rows<typename Kv::T> k, int64_t heads, float scale, float* scores,
               __m256* sums) {
    const __m256 vscale = _mm256_set1_ps(scale);
    each_stretch(qs, [&](const int64_t* slots, int64_t from, int64_t to, int64_t first, int64_t end) {
        scores_stretch<Kv>(qs, k, slots, from, to, first, end, heads, vscale, scores, sums);
    });
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

// out_i += sum_s p[(h * count + i) * stride + s] * v(s) over the positions [from, to) of
// `slots` (s < len(i)) for queries [first, end) of each of the task's heads: the rows in
// order, each read whole (as scores_stretch reads K), each V vector once for the queries of
// its head, their sums kept in out (in cache: a head's queries' outputs are 3 x 64 floats
// at SmolLM2's shape) and added to in the order of s, one FMA per lane and row. AMD EPYC
// Zen 3, one thread, SmolLM2's pool: a block of rows a head's 32 dims at a time (this
// kernel before) 9-10 GB/s, row by row 13-14 GB/s.
template <typename Kv>
void values_stretch(const float* p, const Queries& qs, Rows<typename Kv::T> v, const int64_t* slots,
                    int64_t from, int64_t to, int64_t first, int64_t end, int64_t heads, float* out) {
    constexpr int64_t far = kFar<typename Kv::T>;
    const int64_t dim = qs.dim, stride = qs.stride, count = qs.count;
    for (int64_t s = from; s < to && s < from + far; s++) v.fetch(slots[s]);
    for (int64_t s = from; s < to; s++) {
        if (s + far < to) v.fetch(slots[s + far]);
        const typename Kv::T* row = v.at(slots[s]);
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t i0 = first; i0 < end; i0 += kPassQueries) {
                int64_t m = 0;  // of these queries, those that attend s
                float* og[kPassQueries];
                __m256 w[kPassQueries];
                for (int64_t j = 0; j < kPassQueries && i0 + j < end; j++) {
                    if (s >= qs.len(i0 + j)) continue;
                    og[m] = out + qs.offset(i0 + j) + h * qs.group * dim;
                    w[m++] = _mm256_broadcast_ss(p + (h * count + i0 + j) * stride + s);
                }
                if (m > 0) with_count(m, [&](auto M) { add_row<Kv, M()>(w, row + h * dim, dim, og); });
            }
        }
    }
}

// out_i = sum_{s < len(i)} p_i(s) * v(s) for every query of the task: its outputs zeroed,
// then added to stretch by stretch (each query's sum in the order of its positions, as
// alone).
template <typename Kv>
void weighted_values(const float* p, const Queries& qs, Rows<typename Kv::T> v, int64_t heads,
                     float* out) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < qs.count; i++)
            for (int64_t d = 0; d < qs.dim; d += 8)
                _mm256_storeu_ps(out + qs.offset(i) + h * qs.group * qs.dim + d, _mm256_setzero_ps());
    each_stretch(qs, [&](const int64_t* slots, int64_t from, int64_t to, int64_t first, int64_t end) {
        values_stretch<Kv>(p, qs, v, slots, from, to, first, end, heads, out);
    });
}

// A task takes all of a piece's KV heads where the pieces alone keep every thread busy
// (at least two each), else one (a few requests' rows: every thread gets some). All of
// them: each slot's row of K and V read whole, in order, once. AMD EPYC Zen 3 (AVX2),
// SmolLM2 fp32, the kernel alone over 30 layers' pools of 544 positions a request (huge
// pages, each request's slots in a run), 2 threads, ms, medians of 14 alternated, bit for
// bit the same: a head a task, 8 rows and a head's part of them at a time (this kernel
// before) -> a head a task, row by row -> all a task, row by row: 4 requests 10.6 -> 10.0
// -> 6.5; 16 requests 32.9 -> 32.7 -> 20.7; 32 requests 68.4 -> 69.5 -> 42.7 (a decode step
// of 16, `radixserve bench step-breakdown`, 72 -> 60 ms; of 32, 180 -> 110). Slots
// scattered over the pool at random: 34-43 -> 36-38 (noisy). A task's queries are read (and
// its outputs added to) at every position: where every head's of the largest piece pass
// kTaskQueryFloats (32 kB: SmolLM2's 3 heads x 3 queries x 64 dims a row are 576; a piece
// of 16 drafted rows is 9,216), a head a task, as before (not measured).
constexpr int64_t kTaskQueryFloats = 8192;
inline int64_t heads_a_task(const decode_pieces::Plan& plan, int64_t kv_heads, int64_t group,
                            int64_t dim, int num_threads) {
    int64_t most = 0;  // rows of the largest piece
    for (const auto& piece : plan.pieces) most = std::max(most, piece.rows);
    const bool enough = (int64_t)plan.pieces.size() >= 2 * (int64_t)num_threads;
    return enough && kv_heads * most * group * dim <= kTaskQueryFloats ? kv_heads : 1;
}

template <typename Kv>
void attend(const float* q, const void* k_pool_, const void* v_pool_, const int64_t* table,
            const int64_t* rows, const int64_t* seq_lens, float* out, int64_t batch,
            int64_t heads, int64_t kv_heads, int64_t dim, int64_t table_stride, float scale,
            int num_threads, int64_t window) {
    using T = typename Kv::T;
    const T* k_pool = (const T*)k_pool_;
    const T* v_pool = (const T*)v_pool_;
    const int64_t group = heads / kv_heads;
    const auto plan = decode_pieces::plan(table, table_stride, rows, seq_lens, batch, window, kMaxRows,
                                          kv_heads, num_threads, kMinShared);
    const int64_t span = heads_a_task(plan, kv_heads, group, dim, num_threads);
    const int64_t per_piece = kv_heads / span, tasks = plan.pieces.size() * per_piece;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;  // (span, Q, S) of the current task
        std::vector<float> sums;    // (span, Q, 8) vectors of scores_stretch, 32-byte aligned in it
        std::vector<int64_t> offsets, query_lens;  // the task's Queries tables
        int64_t lens[kMaxRows];
        const int64_t* slots[kMaxRows];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const decode_pieces::Piece& piece = plan.pieces[task / per_piece];
            const int64_t* batch_rows = plan.order.data() + piece.first;
            const int64_t first_head = task % per_piece * span;  // the task's KV heads: span from it
            // a piece of several rows has no window: each attends from position 0
            const int64_t b0 = batch_rows[0];
            const int64_t first_pos = window > 0 && seq_lens[b0] > window ? seq_lens[b0] - window : 0;
            for (int64_t r = 0; r < piece.rows; r++) {
                lens[r] = seq_lens[batch_rows[r]] - first_pos;
                slots[r] = table + rows[batch_rows[r]] * table_stride + first_pos;
            }
            const int64_t first = first_head * group * dim;  // the task's first query head
            offsets.resize(piece.rows * group);
            query_lens.resize(piece.rows * group);
            Queries qs{q + first, lens, batch_rows, slots, piece.rows * group, group, heads * dim, dim,
                       lens[piece.rows - 1], piece.shared - first_pos, offsets.data(), query_lens.data()};
            qs.tabulate();
            const Rows<T> k{k_pool + first_head * dim, kv_heads * dim, span * dim};
            const Rows<T> v{v_pool + first_head * dim, kv_heads * dim, span * dim};
            scores.resize(span * qs.count * qs.stride);
            sums.resize(span * qs.count * 8 * 8 + 8);
            const auto aligned = ((uintptr_t)sums.data() + 31) & ~(uintptr_t)31;
            scores_of<Kv>(qs, k, span, scale, scores.data(), (__m256*)aligned);
            for (int64_t i = 0; i < span * qs.count; i++)
                softmax(scores.data() + i * qs.stride, qs.len(i % qs.count));
            weighted_values<Kv>(scores.data(), qs, v, span, out + first);
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
