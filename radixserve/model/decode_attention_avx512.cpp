// Decode attention over the KV pool for x86 CPUs with AVX-512 (F, BW, VL, DQ) and
// AVX512-BF16: the same computation and C interface as decode_attention.cpp (read that file
// first), 16 lanes wide, chosen at run time where the CPU has them (radixserve/hardware.py).
//
//   out[b, h] = softmax_s(q[b, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// What differs from the AVX2 kernel:
// - scores are computed 16 positions at a time and their 16 lane-sums reduced by one
//   transpose-and-add tree (45 shuffles/adds for 16 positions, 3 per position);
// - a bf16 pool read by a bf16 query (kv_dtype code 3: a bf16 model's own queries) takes
//   the q . k products with vdpbf16ps: pairs of bf16 multiplied exactly and summed in fp32,
//   32 dims per instruction, no widening of K. A bf16 pool under an fp32 query (code 1)
//   widens K to fp32 as the AVX2 kernel does, so an fp32 query is never rounded.
// - the softmax and the weighted sum of V in fp32, 16 lanes (V widened in registers).
// - kv_dtype code 4 is code 3 with the query and the output in bf16 (the model's own
//   tensors, no widened copies): the output rounded to nearest even, as torch rounds.
// - requests sharing a cached prefix are attended together (kMinShared below).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "decode_pieces.h"
#include "simd_avx512.h"

namespace {

using simd512::exp16;

constexpr int64_t kMaxGroup = 8;  // query heads per KV head held in registers at once
// A task attends the queries of up to kMaxRows rows of one request at once (a
// decode step's token and its drafted tokens, verified in one pass: speculative decoding),
// so that each K and V row is loaded once for all of them rather than once per row. Each
// query's sums run in the same order as alone: bit-identical to one row at a time. AMD EPYC
// Zen 4, SmolLM2 (9 heads, 3 KV heads), 30 layers, contexts of 512, ms, one row at a time
// -> together (medians of 14 alternated): 1 request with 8 drafted tokens fp32 8.0 -> 7.2;
// 4 requests with 4 fp32 19.7 -> 16.0, bf16 14.3 -> 11.9; 16 requests with 2 fp32 57.3 ->
// 39.4, bf16 33.6 -> 27.8; plain decode steps unchanged (16 requests fp32 ~23, bf16 ~14).
constexpr int64_t kMaxRows = 16;
// Rows of different requests whose first kMinShared slots are the same (a cached prefix:
// the requests of one system prompt) are attended together too (decode_pieces.h): the
// prefix's K and V rows loaded once for all their queries, each row's own positions after
// it on their own, each query's sums in the same order as alone: bit-identical. AMD EPYC
// Zen 4, SmolLM2 fp32, 30 layers, a decode step of 16 requests, K/V from memory, ms apart
// -> together (medians of 10, alternated, two runs): 2 prefixes of 512 and 48 positions
// each past them 11.1-9.9 -> 9.1-8.1; 4 such prefixes 13.3-11.6 -> 10.8-9.4; 8 (two
// requests each) 18.8-16.2 -> 12.9-13.5; 4 prefixes of 256 and 300 past them 16.8-14.9 ->
// 15.2-15.1 (a third run: 16.8 -> 17.7); nothing shared 22.0-22.5 -> 22.3-22.2. (The AVX2
// build, decode_attention.cpp, did the same here at 0.90-1.17x and kept one request a
// piece until it read rows whole and in order; it groups them now.)
constexpr int64_t kMinShared = 64;
// Rows are prefetched kFar positions ahead into L2 (the AMX build's q . k also kAhead
// ahead into L1). AMD EPYC Zen 4, SmolLM2 bf16 (3 KV heads: a head's 128-byte row every 384
// bytes), 30 layers, 16 requests of 544 positions, K/V from memory, ms (medians of 12,
// alternated): into L1 32 ahead alone 19.5-23.8 (no prefetch at all: 17.6-18.7); into L2
// 64 ahead and L1 8 ahead 12.2-14.6 (~15 GB/s, up from ~9); L2 96, 128, 160 ahead
// 12.6-14.2; the whole slot row (every KV head) into L2 on the first head's pass 16.0. Then
// L2 alone against L2 + L1 8 ahead, the same shapes (medians of 12-16 alternated, three
// runs): fp32 25.8-27.6 -> 20.7-22.3, bf16 12.0-14.9 -> 11.4-13.8; fp32 at 64 requests
// 115.6 -> 85.9, 4 requests of 2048 24.4 -> 18.3, shuffled slots 26.4 -> 20.9 (bf16 alike
// or slightly faster): an L1 prefetch takes a load slot per line, and the rows come from L2
// in time without it. Then fp32 rows, 64 positions ahead -> 32 (8 KB of a 64-dim head's
// rows, as 64 bf16 positions are), with each pass fetching its first rows before it starts
// (the loops' prefetches cover only the rows past them): the decode kernel alone over 30
// layers' pools, SmolLM2's shape, medians of 26 alternated, bit-identical, five runs: 8
// prefixes of 2 requests 1.04-1.08x, nothing shared 1.06-1.11x; Gemma 3 270M's shape (1 KV
// head of 256) 0.99-1.02x.
template <typename T>
constexpr int64_t kFar = sizeof(T) == 4 ? 32 : 64;

// r[i] = sum of a[i]'s 16 lanes, for i < 16 (unused a[i] may be anything: their lanes are
// ignored by the caller).
inline __m512 hsum16(const __m512* a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  // per 128-bit block: [a0 02, a1 02, a0 13, a1 13] partials
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per block: the block's sums of a[4i..4i+3]
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // blocks of v0: [u0 b0+b1, u0 b2+b3, u1 b0+b1, u1 b2+b3]; v1 likewise of u2, u3
    __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                              _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                              _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    // blocks: [u0 total, u1 total, u2 total, u3 total]: lane 4k + i = sum of a[4k + i]
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// 16 pool values at p as fp32 lanes, per element type.
struct Fp32 {
    using T = float;
    static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
};
struct Bf16 {
    using T = uint16_t;
    static __m512 load(const T* p) { return simd512::load_bf16(p); }
};
struct Fp16 {
    using T = uint16_t;
    static __m512 load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
};

template <typename T>
inline void prefetch_row_l2(const T* p, int64_t dim) {
    const char* bytes = (const char*)p;
    for (int64_t b = 0; b < dim * (int64_t)sizeof(T); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T1);
}

// The query of head g (at offset g * dim) in the form the dot products take: fp32 (Kv's
// widened rows), or bf16 pairs for vdpbf16ps (codes 3, 4; then q is not read: it may be
// null). q_bf16 has room for group * dim values. `load_q` takes the kLanes query values
// from d, `step` adds their products with the K values at k to acc's lanes.
struct Fp32Dot {
    static constexpr int64_t kLanes = 16;  // query values per register
    static __m512 load_q(const float* q, const uint16_t*, int64_t d) { return _mm512_loadu_ps(q + d); }
    template <typename Kv>
    static __m512 step(__m512 acc, __m512 q, const typename Kv::T* k) {
        return _mm512_fmadd_ps(q, Kv::load(k), acc);
    }
};
struct Bf16Dot {
    static constexpr int64_t kLanes = 32;
    static __m512 load_q(const float*, const uint16_t* q, int64_t d) {
        return _mm512_castsi512_ps(_mm512_loadu_si512(q + d));
    }
    template <typename Kv>
    static __m512 step(__m512 acc, __m512 q, const typename Kv::T* k) {
        return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)_mm512_loadu_si512(k));
    }
};

// One task's queries: query i is head i % group of the task's KV head in its piece row
// r = i / group, batch row batch_rows[r]; its fp32 values at q + batch_rows[r] * row_stride +
// head * dim (null with bf16 io), its bf16 pairs (Bf16Dot) at q_bf16 + i * dim, its output
// at out + the same offset, and it attends positions [0, lens[r]) of slots[r] (the rows'
// lengths differ: drafted tokens, other requests). Below `shared` every row's slots are
// slots[count / group - 1]'s (the longest row's): one request's rows, or requests sharing a
// cached prefix, whose K and V rows there are read once for all. Each query's scores are
// `stride` apart.
struct Queries {
    const float* q;
    const uint16_t* q_bf16;
    const int64_t* lens;
    const int64_t* batch_rows;
    const int64_t* const* slots;
    int64_t count, group, row_stride, dim, stride, shared;
    int64_t offset(int64_t i) const { return batch_rows[i / group] * row_stride + i % group * dim; }
    int64_t len(int64_t i) const { return lens[i / group]; }
    int64_t rows() const { return count / group; }
    int64_t longest() const { return lens[rows() - 1]; }  // rows in increasing length
    const int64_t* common() const { return slots[rows() - 1]; }
};

// The K or V row at position s of the stream of the piece's own positions from row r on
// (each row's positions from `start` to its length, one row after the other), or null past
// the last row's: what to prefetch kFar positions ahead past the shared prefix.
template <typename T>
inline const T* stream_row(const Queries& qs, const T* pool, int64_t kv_heads, int64_t kh,
                           int64_t r, int64_t s, int64_t start) {
    while (r < qs.rows() && s >= qs.lens[r]) s = s - qs.lens[r] + start, r++;
    return r < qs.rows() ? pool + (qs.slots[r][s] * kv_heads + kh) * qs.dim : nullptr;
}

// The products of queries [first, end) with the 16 positions from s0 whose K rows are at k.
template <typename Kv, typename Dot>
inline void scores16(const Queries& qs, const typename Kv::T* const* k, int64_t s0, int64_t first,
                     int64_t end, __m512 vscale, float* scores) {
    const int64_t dim = qs.dim;
    for (int64_t i = first; i < end; i++) {
        const int64_t m = qs.len(i) - s0 < 16 ? qs.len(i) - s0 : 16;  // this query's
        if (m <= 0) continue;
        const float* q = qs.q ? qs.q + qs.offset(i) : nullptr;
        const uint16_t* q16 = qs.q_bf16 + i * dim;
        // one register of the query against the 16 positions' values at a time, so each
        // product takes one load, not two (the loads bound this pass: a Zen 4 takes one
        // 512-bit load a cycle); each position's sum in the same order as before
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += Dot::kLanes) {
            const __m512 qv = Dot::load_q(q, q16, d);
            for (int t = 0; t < 16; t++) acc[t] = Dot::template step<Kv>(acc[t], qv, k[t] + d);
        }
        __m512 sums = _mm512_mul_ps(hsum16(acc), vscale);
        _mm512_mask_storeu_ps(scores + i * qs.stride + s0, (__mmask16)((1u << m) - 1), sums);
    }
}

// scores[i * stride + s] = q_i . k(s) * scale for s < len(i), 16 positions per pass, the
// rows ahead prefetched: the blocks below `shared` for every query at once, then each
// row's blocks past them for its queries (the same products, block by block, as alone).
template <typename Kv, typename Dot>
void scores_of(const Queries& qs, const typename Kv::T* k_pool, int64_t kv_heads, int64_t kh,
               float scale, float* scores) {
    using T = typename Kv::T;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t longest = qs.longest(), dim = qs.dim, rows = qs.rows();
    const int64_t split = longest <= qs.shared ? longest : qs.shared / 16 * 16;
    const int64_t* common = qs.common();
    const T* k[16];
    for (int64_t s = 0; s < kFar<T>; s++) {  // the first rows, past the loop's prefetches
        const T* row = s < split ? k_pool + (common[s] * kv_heads + kh) * dim
                                 : stream_row(qs, k_pool, kv_heads, kh, 0, s, split);
        if (row) prefetch_row_l2(row, dim);
    }
    for (int64_t s0 = 0; s0 < split; s0 += 16) {
        for (int64_t s = s0 + kFar<T>; s < s0 + kFar<T> + 16; s++) {
            const T* row = s < split ? k_pool + (common[s] * kv_heads + kh) * dim
                                     : stream_row(qs, k_pool, kv_heads, kh, 0, s, split);
            if (row) prefetch_row_l2(row, dim);
        }
        const int64_t n = split - s0 < 16 ? split - s0 : 16;
        for (int64_t t = 0; t < 16; t++) k[t] = k_pool + (common[s0 + (t < n ? t : 0)] * kv_heads + kh) * dim;
        scores16<Kv, Dot>(qs, k, s0, 0, qs.count, vscale, scores);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = qs.lens[r];
        const int64_t* slots = qs.slots[r];
        for (int64_t s0 = split; s0 < len; s0 += 16) {
            for (int64_t s = s0; s < s0 + 16; s++)
                if (const T* row = stream_row(qs, k_pool, kv_heads, kh, r, s + kFar<T>, split)) prefetch_row_l2(row, dim);
            const int64_t n = len - s0 < 16 ? len - s0 : 16;
            for (int64_t t = 0; t < 16; t++) k[t] = k_pool + (slots[s0 + (t < n ? t : 0)] * kv_heads + kh) * dim;
            scores16<Kv, Dot>(qs, k, s0, r * qs.group, (r + 1) * qs.group, vscale, scores);
        }
    }
}

#ifdef __AMX_BF16__
// Built with AMX (the kernel plan's "amx" build): q . k of a bf16 query over a bf16 pool on
// the tile unit. Per 16 positions: C (16 positions x 16 columns, fp32) = A (the positions'
// K rows, 32 dims per tile) x B (the piece's queries, their dims in pairs, one column per
// query: up to 16, so pieces of up to 16 / G rows; unused columns 0), one tile product per
// 32 dims. Exact bf16 products summed in fp32, as vdpbf16ps does, in another order; a
// column's sums do not depend on the others', so a query's scores are the same bits in a
// piece of several rows as alone. Tiles: 0 C, 1 A, 2 B. Pieces of several requests (a
// shared prefix's K read once for all: kMinShared) against one row each before, Intel Xeon
// (AMX), SmolLM2 bf16, 30 layers, 16 requests of 544 positions, the kernel alone, ms
// (medians of 11, alternated): one prefix of 512 for all 6.93 -> 5.03, of 256 9.56 -> 9.77,
// nothing shared 13.62 -> 13.72; bf16 decode steps of 16 requests of 2 prefixes of 512
// (Engine, ms a forward) 22.1, 21.8 -> 20.1, 20.0, of 16 prompts unchanged (26.5-27.7).
constexpr int64_t kAmxMaxDim = 256;
constexpr int64_t kAhead = 8;  // positions ahead into L1 (measured with the tile loads)

template <typename T>
inline void prefetch_row(const T* p, int64_t dim) {
    const char* bytes = (const char*)p;
    for (int64_t b = 0; b < dim * (int64_t)sizeof(T); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

void amx_configure() {
    TileConfig cfg;
    for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// b (dim / 32 tiles of 16 x 32 bf16): b[c][p][2n + j] = q[n][32c + 2p + j] for the queries
// n < count (at most 16), 0 in the other columns.
void amx_query_tiles(const uint16_t* q, int64_t count, int64_t dim, uint16_t* b) {
    memset(b, 0, dim / 32 * 1024);
    for (int64_t c = 0; c < dim / 32; c++)
        for (int64_t p = 0; p < 16; p++)
            for (int64_t n = 0; n < count; n++) {
                b[c * 512 + p * 32 + 2 * n] = q[n * dim + 32 * c + 2 * p];
                b[c * 512 + p * 32 + 2 * n + 1] = q[n * dim + 32 * c + 2 * p + 1];
            }
}

// The scores of queries [first, end) against positions [s0, s0 + n) (n <= 16) of `slots`
// (at qs.stride per query): one tile product per 32 dims of the 16 positions' K rows by b's
// columns (every query of the piece; a column's sums are its own whatever the others hold).
// Rows ahead are fetched from `ahead` (positions past s0 + 16 of the same stream, or null).
inline void scores_block_amx(const Queries& qs, const uint16_t* b, const uint16_t* k_pool,
                             const int64_t* slots, int64_t s0, int64_t n, int64_t first,
                             int64_t end, int64_t kv_heads, int64_t kh, float scale, float* scores,
                             uint16_t* rows) {
    alignas(64) float c[16 * 16];
    const int64_t dim = qs.dim, row_stride = kv_heads * dim;
    // 16 consecutive slots: the tile reads the pool rows in place; else a copy
    bool consecutive = n == 16;
    for (int64_t t = 1; consecutive && t < 16; t++) consecutive = slots[s0 + t] == slots[s0] + t;
    const uint16_t* a;
    int64_t stride;
    if (consecutive) {
        a = k_pool + (slots[s0] * kv_heads + kh) * dim, stride = row_stride * 2;
    } else {
        for (int64_t t = 0; t < n; t++)
            memcpy(rows + t * dim, k_pool + (slots[s0 + t] * kv_heads + kh) * dim, dim * 2);
        a = rows, stride = dim * 2;
    }
    _tile_zero(0);
    for (int64_t ch = 0; ch < dim / 32; ch++) {
        _tile_loadd(1, a + ch * 32, stride);
        _tile_loadd(2, b + ch * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    for (int64_t i = first; i < end; i++) {
        const int64_t m = std::min(n, qs.len(i) - s0);  // this query's positions among them
        for (int64_t t = 0; t < m; t++) scores[i * qs.stride + s0 + t] = c[t * 16 + i] * scale;
    }
}

// As scores_of, on the tile unit (b from amx_query_tiles, every query of the piece a column:
// at most 16; rows: 16 x dim bf16 scratch): the blocks below `shared` once for every query,
// then each row's blocks past them for its queries; each query's scores the bits it gets
// alone. Rows are fetched kAhead positions ahead into L1 and kFar into L2 along the stream.
void scores_amx(const Queries& qs, const uint16_t* b, const uint16_t* k_pool, int64_t kv_heads,
                int64_t kh, float scale, float* scores, uint16_t* rows) {
    const int64_t longest = qs.longest(), dim = qs.dim;
    const int64_t split = longest <= qs.shared ? longest : qs.shared / 16 * 16;
    auto row_at = [&](const int64_t* slots, int64_t s) { return k_pool + (slots[s] * kv_heads + kh) * dim; };
    // the K rows of [from, to) of a stream, 16 at a time, with their prefetches
    auto stream = [&](const int64_t* slots, int64_t from, int64_t to, int64_t first, int64_t end) {
        for (int64_t s = from; s < to && s < from + kAhead; s++) prefetch_row(row_at(slots, s), dim);
        for (int64_t s0 = from; s0 < to; s0 += 16) {
            for (int64_t s = s0 + kAhead; s < to && s < s0 + kAhead + 16; s++) prefetch_row(row_at(slots, s), dim);
            for (int64_t s = s0 + kFar<uint16_t>; s < to && s < s0 + kFar<uint16_t> + 16; s++)
                prefetch_row_l2(row_at(slots, s), dim);
            scores_block_amx(qs, b, k_pool, slots, s0, std::min<int64_t>(16, to - s0), first, end,
                             kv_heads, kh, scale, scores, rows);
        }
    };
    stream(qs.common(), 0, split, 0, qs.count);
    for (int64_t r = 0; r < qs.rows(); r++)
        stream(qs.slots[r], split, qs.lens[r], r * qs.group, (r + 1) * qs.group);
}
#endif

// row[0..len) = softmax(row), in place.
void softmax(float* row, int64_t len) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < len; s += 16) {
        __mmask16 m = len - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - s)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + s));
    }
    const __m512 vpeak = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vtotal = _mm512_setzero_ps();
    for (int64_t s = 0; s < len; s += 16) {
        __mmask16 m = len - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - s)) - 1);
        __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + s);
        __m512 e = exp16(_mm512_sub_ps(x, vpeak));  // -inf - peak: e = 0 past the end
        _mm512_mask_storeu_ps(row + s, m, e);
        vtotal = _mm512_add_ps(vtotal, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vtotal));
    for (int64_t s = 0; s < len; s += 16) {
        __mmask16 m = len - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - s)) - 1);
        _mm512_mask_storeu_ps(row + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + s), inv));
    }
}

// out_i = sum_{s < len(i)} p[i * stride + s] * v(s) for queries first..first+count-1
// (count <= kMaxGroup), 32 dims per pass with every query's accumulators in registers, in
// the order of s: below `shared` one V row serves them all; past it each query reads its
// row's own. The first pass prefetches whole rows ahead. out_i at out + offset(i), or with
// `packed` at out + i * dim.
template <typename Kv>
void weighted_values(const float* p, const Queries& qs, int64_t first, int64_t count,
                     const typename Kv::T* v_pool, int64_t kv_heads, int64_t kh, float* out,
                     bool packed) {
    const int64_t dim = qs.dim, stride = qs.stride;
    const int64_t shortest = qs.len(first), len = qs.len(first + count - 1);
    const int64_t common = len < qs.shared ? len : qs.shared, first_row = first / qs.group;
    const int64_t* slots = qs.common();
    constexpr int64_t far = kFar<typename Kv::T>;
    for (int64_t s = 0; s < far; s++) {
        const auto* row = s < common ? v_pool + (slots[s] * kv_heads + kh) * dim
                                     : stream_row(qs, v_pool, kv_heads, kh, first_row, s, common);
        if (row) prefetch_row_l2(row, dim);
    }
    for (int64_t d = 0; d < dim; d += 32) {
        __m512 acc[kMaxGroup][2];
        for (int64_t g = 0; g < count; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
        const float* pg = p + first * stride;
        for (int64_t s = 0; s < common; s++) {
            if (d == 0 && s + far < common) {
                prefetch_row_l2(v_pool + (slots[s + far] * kv_heads + kh) * dim, dim);
            } else if (d == 0) {  // then the rows' own ones
                if (const auto* row = stream_row(qs, v_pool, kv_heads, kh, first_row, s + far, common)) prefetch_row_l2(row, dim);
            }
            const typename Kv::T* v = v_pool + (slots[s] * kv_heads + kh) * dim + d;
            __m512 v0 = Kv::load(v), v1 = Kv::load(v + 16);
            for (int64_t g = 0; g < count; g++) {
                if (s >= shortest && s >= qs.len(first + g)) continue;  // past this query's
                __m512 w = _mm512_set1_ps(pg[g * stride + s]);
                acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
            }
        }
        // past it, a row at a time: its queries among these (consecutive), its own V rows
        for (int64_t g0 = 0; g0 < count;) {
            const int64_t r = (first + g0) / qs.group;
            const int64_t g1 = std::min(count, (r + 1) * qs.group - first), row_len = qs.lens[r];
            const int64_t* own = qs.slots[r];
            for (int64_t s = common; s < row_len; s++) {
                if (d == 0)
                    if (const auto* row = stream_row(qs, v_pool, kv_heads, kh, r, s + far, common)) prefetch_row_l2(row, dim);
                const typename Kv::T* v = v_pool + (own[s] * kv_heads + kh) * dim + d;
                __m512 v0 = Kv::load(v), v1 = Kv::load(v + 16);
                for (int64_t g = g0; g < g1; g++) {
                    __m512 w = _mm512_set1_ps(pg[g * stride + s]);
                    acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
                    acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
                }
            }
            g0 = g1;
        }
        for (int64_t g = 0; g < count; g++) {
            float* o = out + (packed ? (first + g) * dim : qs.offset(first + g));
            _mm512_storeu_ps(o + d, acc[g][0]);
            _mm512_storeu_ps(o + d + 16, acc[g][1]);
        }
    }
}

// q and out in fp32, or in bf16 (code 4: the query's bf16 values taken as they are, the
// output rounded to bf16)
template <typename Kv, typename Dot, bool bf16_io = false>
void attend(const void* q_, const void* k_pool_, const void* v_pool_, const int64_t* table,
            const int64_t* rows, const int64_t* seq_lens, void* out_, int64_t batch,
            int64_t heads, int64_t kv_heads, int64_t dim, int64_t table_stride, float scale,
            int num_threads, int64_t window) {
    const float* q = (const float*)q_;  // fp32 io only
    float* out = (float*)out_;
    const typename Kv::T* k_pool = (const typename Kv::T*)k_pool_;
    const typename Kv::T* v_pool = (const typename Kv::T*)v_pool_;
    const int64_t group = heads / kv_heads;
#ifdef __AMX_BF16__
    constexpr bool amx = std::is_same<Dot, Bf16Dot>::value;
#else
    constexpr bool amx = false;
#endif
    // the AMX tile path takes a piece's queries as the 16 columns of one tile
    const int64_t max_rows = std::min(kMaxRows, (amx ? 16 : 16 * kMaxGroup) / group);
    const auto plan = decode_pieces::plan(table, table_stride, rows, seq_lens, batch, window, max_rows,
                                          kv_heads, num_threads, kMinShared);
    const int64_t count = plan.pieces.size();
    // One task per piece when there are enough of them: its KV heads one after the other
    // on one core, so the rows the first head's pass brings in (a position's heads lie side
    // by side in the pool) serve the others from that core's cache. Else one per (piece,
    // KV head), so that a small batch still keeps every thread busy.
    const int64_t heads_per_task = count >= 2 * num_threads ? kv_heads : 1;
    const int64_t tasks = count * kv_heads / heads_per_task;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;     // (Q, S) of the current KV head's queries
        std::vector<uint16_t> q_bf16;  // (Q, D): the queries as bf16 (Bf16Dot)
        std::vector<float> out32;      // (Q, D): the outputs before rounding (bf16 io)
        int64_t lens[kMaxRows];
        const int64_t* slots[kMaxRows];
#ifdef __AMX_BF16__
        alignas(64) uint16_t b_tiles[kAmxMaxDim / 32 * 512], k_rows[16 * kAmxMaxDim];
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const decode_pieces::Piece& piece = plan.pieces[task * heads_per_task / kv_heads];
            const int64_t* batch_rows = plan.order.data() + piece.first;
            const int64_t nrows = piece.rows, b0 = batch_rows[0];
            const int64_t first_kh = task * heads_per_task % kv_heads;
            // a piece of several rows has no window: each attends from position 0
            const int64_t first_pos = window > 0 && seq_lens[b0] > window ? seq_lens[b0] - window : 0;
            for (int64_t r = 0; r < nrows; r++) {
                lens[r] = seq_lens[batch_rows[r]] - first_pos;
                slots[r] = table + rows[batch_rows[r]] * table_stride + first_pos;
            }
            const int64_t nq = nrows * group, stride = lens[nrows - 1];
            for (int64_t kh = first_kh; kh < first_kh + heads_per_task; kh++) {
                const int64_t first = kh * group * dim;  // head 0 of the KV head's queries
                scores.resize(nq * stride);
                q_bf16.resize(nq * dim);  // sized either way: Queries points into it
                for (int64_t r = 0; r < nrows; r++) {
                    const int64_t at = batch_rows[r] * heads * dim + first;
                    uint16_t* dst = q_bf16.data() + r * group * dim;
                    if (bf16_io) {
                        __builtin_memcpy(dst, (const uint16_t*)q_ + at, group * dim * 2);
                    } else if (std::is_same<Dot, Bf16Dot>::value) {
                        // a bf16 query arrives widened to fp32: its top halves are its bf16 values
                        for (int64_t i = 0; i < group * dim; i++) {
                            uint32_t bits;
                            __builtin_memcpy(&bits, q + at + i, 4);
                            dst[i] = (uint16_t)(bits >> 16);
                        }
                    }
                }
                const Queries qs{bf16_io ? nullptr : q + first, q_bf16.data(), lens, batch_rows, slots,
                                 nq, group, heads * dim, dim, stride, piece.shared - first_pos};
#ifdef __AMX_BF16__
                if (amx) {
                    amx_query_tiles(q_bf16.data(), nq, dim, b_tiles);
                    scores_amx(qs, b_tiles, (const uint16_t*)k_pool, kv_heads, kh, scale, scores.data(),
                               k_rows);
                } else
#endif
                scores_of<Kv, Dot>(qs, k_pool, kv_heads, kh, scale, scores.data());
                for (int64_t i = 0; i < nq; i++) softmax(scores.data() + i * stride, qs.len(i));
                float* dst = out + first;
                if (bf16_io) {
                    out32.resize(nq * dim);
                    dst = out32.data();
                }
                for (int64_t i = 0; i < nq; i += kMaxGroup)
                    weighted_values<Kv>(scores.data(), qs, i, std::min(kMaxGroup, nq - i), v_pool,
                                        kv_heads, kh, dst, bf16_io);
                if (bf16_io) {
                    for (int64_t i = 0; i < nq; i++) {
                        uint16_t* o = (uint16_t*)out_ + first + qs.offset(i);
                        for (int64_t d = 0; d < dim; d += 16)
                            _mm256_storeu_si256((__m256i*)(o + d),
                                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(&out32[i * dim + d])));
                    }
                }
            }
        }
#ifdef __AMX_BF16__
        if (amx) _tile_release();
#endif
    }
}

}  // namespace

extern "C" {

// As decode_attention.cpp's, with kv_dtype 3: a bf16 pool and a query whose values are
// bf16 (widened to fp32 exactly), whose products go through vdpbf16ps; 4: the same with q
// and out bf16 tensors.
void decode_attention(const void* q, const void* k_pool, const void* v_pool,
                      const int64_t* table, const int64_t* rows, const int64_t* seq_lens,
                      void* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads, int kv_dtype,
                      int64_t window) {
    auto run = kv_dtype == 4   ? attend<Bf16, Bf16Dot, true>
               : kv_dtype == 3 ? attend<Bf16, Bf16Dot>
               : kv_dtype == 1 ? attend<Bf16, Fp32Dot>
               : kv_dtype == 2 ? attend<Fp16, Fp32Dot>
                               : attend<Fp32, Fp32Dot>;
    run(q, k_pool, v_pool, table, rows, seq_lens, out, batch, heads, kv_heads, dim, table_stride,
        scale, num_threads, window);
}

int decode_attention_supports(int64_t heads, int64_t kv_heads, int64_t dim) {
#ifdef __AMX_BF16__
    if (dim > kAmxMaxDim) return 0;
#endif
    return heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && dim % 32 == 0;
}

// This build takes kv_dtype 4 (bf16 query and output).
int decode_attention_bf16_io() { return 1; }

#ifdef __AMX_BF16__
// The AMX build: Linux's permission for the tile state (once per process), before any call.
int decode_attention_amx_enable() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
#endif

}  // extern "C"
