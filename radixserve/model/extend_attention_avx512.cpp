// Prefill / extend attention over the KV pool for x86 CPUs with AVX-512 (F, BW, VL, DQ) and
// AVX512-BF16, for a bf16 model over a bf16 pool or an fp32 model over an fp32 pool: each
// request's new tokens attend causally to its cached prefix and to themselves, reading K/V
// where they lie in the pool (the new tokens' K/V are written there first): no gathered
// copy, no padding, no mask tensor.
//
//   out[t, h] = softmax_{s <= pos(t)}(q[t, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// Layout of the work (flash attention, queries in lanes):
// - a task is (request, KV head, block of 32 new tokens, or 64 where the batch has enough
//   tasks, kMaxBlockQ); tasks run costliest first (those with the most keys) on dynamically
//   scheduled threads.
// - a lane group is 16 consecutive tokens of one query head: the lanes of every vector below
//   are those 16 queries. Scores of 16 keys come from 16 accumulators, vdpbf16ps of the
//   queries' dim pairs (packed once per task) with a key's dim pair broadcast: no horizontal
//   sums. The softmax runs online (running max and sum per lane) over blocks of 32 keys, all
//   of it vertical.
// - P . V: vdpbf16ps of the probabilities of two keys (rounded to bf16, as torch's flash
//   attention rounds P for bf16) with the two keys' values of one dim broadcast: the output
//   is held transposed (dim, 16 lanes) in fp32 and transposed once at the end.
// - fp32 (the fidelity reference's dtype): the same loops with one FMA per dim in place of
//   a vdpbf16ps per dim pair, P kept in fp32; every sum in fp32, in another order than
//   torch's (SmolLM2's logits stay within the fidelity suite's 1e-4 of transformers').
// - a key block's rows are copied (K) and paired (V: two keys' values of a dim side by side)
//   once per task and serve every lane group of the KV head's query heads.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "extend_tasks.h"
#include "simd_avx512.h"

namespace {

using simd512::exp16;

using extend::kBlockQ;  // new tokens per task (two lane groups per query head)
// Or up to kMaxBlockQ (four lane groups a head) where the batch has enough such tasks
// (extend_tasks.h); the per-thread scratch (lane groups, key and value blocks: ~1 MB) is
// kept across calls rather than allocated and zeroed in each. The kernel alone, two builds
// alternated in one process (medians of 16, AMD EPYC Zen 4, SmolLM2's heads), bit for bit
// the same, fp32: 32 tokens after a prefix of 512 1.14x, one prompt of 37 1.22x, of 256
// 1.07x, 256 after 256 1.05x, two of 544 1.03x, one of 4,096 1.05x, 1,024 after 7,168
// 1.10x; bf16 1.02-1.07x on the same; Gemma 3 270M's heads (4 of 256, one KV head) 1.02x,
// and 32 after 512 1.75x. The scratch alone gave the short ones (1.09x, 1.28x, 1.03x); the
// longer tasks the long ones. (The AVX2 build, extend_attention.cpp, measured 1.00x with
// both: it keeps its own.)
constexpr int64_t kMaxBlockQ = 64;
constexpr int64_t kBlockK = 32;   // keys per softmax block
constexpr int64_t kMaxDim = 256;  // head size held in the per-lane-group scratch
constexpr int64_t kMaxGroup = 8;  // query heads per KV head

using extend::Task;

// State of one lane group (16 tokens of one query head) across the key blocks.
struct LaneGroup {
    int64_t head;          // query head
    int64_t first;         // first token of the group (offset in the request's new tokens)
    int64_t valid;         // its real tokens (<= 16); the other lanes are padding
    int64_t key_end;       // keys [0, key_end) are visible to some lane
    __m512i pos;           // absolute position of each lane's token
    __m512 max, sum;       // running max and sum of exp per lane
    // the queries, (words, 16): bf16 dim pairs (D / 2 words) or fp32 dims (D words)
    alignas(64) uint32_t q[kMaxDim * 16];
    alignas(64) float out[kMaxDim * 16];  // (D, 16): unnormalized output, transposed
};

// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit words held in 16 registers: pairs of rows
// interleaved, then 4 x 4 blocks gathered within 128-bit lanes, then lanes moved across (64
// shuffles). Queries go into the lanes of a LaneGroup and outputs come out of them this way:
// a word at a time (a load and a store each), each way took ~9% of the kernel's time on two
// prompts of 544 tokens. With the transposes, bit for bit the same, the kernel alone (two
// builds alternated in one process, medians of 14, AMD EPYC Zen 4, SmolLM2's heads), fp32 /
// bf16: two prompts of 544 tokens 1.09x / 1.06x, one of 4,096 1.02x / 1.03x, one of 37
// 1.18x / 1.21x, 256 after a prefix of 256 1.03x (fp32). (The AVX2 build, 8 lanes, gained
// nothing from the same change: extend_attention.cpp keeps its loops.)
inline void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {  // t[2i], t[2i + 1]: rows 2i, 2i + 1 interleaved
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // r[4i + j], lane block k: column 4k + j of rows 4i..4i+3
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {  // lane blocks (0, 2) and (1, 3) of each column's pieces
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; j++) {  // column 4k + j: lane block k of rows 0-3, 4-7, 8-11, 12-15
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
    }
}

// Lane m = a[m]'s 16 lanes reduced by op (add or max) in the order GCC's
// _mm512_reduce_{add,max}_ps reduces them (the 256-bit halves, then the 128-bit halves, then
// lanes 0 op 2 and 1 op 3, then those two): the same bits as 16 of those calls, in ~46
// shuffles and ops instead of ~150 (the AMX build's row maxima and sums per key block).
// Intel Xeon (AMX), 2 threads, SmolLM2's heads, ms per layer (medians of 15, alternated):
// 2 x 512 tokens 1.22 -> 1.16, 1 x 544 0.74 -> 0.64, 1 x 1,024 2.31 -> 2.08, 16 x 32 after
// 512 cached 1.36 -> 1.22; bf16 prefill forwards 2 x 512 181 -> 179, 1 x 544 101.5 -> 98.4.
template <typename Op>
inline __m512 reduce_rows(const __m512* a, Op op) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)  // row 2i's lanes i + 8 op i in the low half, 2i + 1's high
        s[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE),
                  _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44));
    for (int j = 0; j < 4; j++)  // block c: row 4j + c's four partials
        t[j] = op(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD),
                  _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88));
    for (int k = 0; k < 2; k++)  // block c: rows 8k + c (lanes 0, 1), 8k + 4 + c (2, 3)
        u[k] = op(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // lane 4c + l: row 4l + c
    const __m512 r = op(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}
inline __m512 add16(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 max16(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

// The arithmetic of each element type. Bf16: vdpbf16ps of dim pairs, P rounded to bf16
// and paired with two keys' values of a dim; Fp32: FMAs over single dims, P in fp32.
struct Bf16 {
    using T = uint16_t;
    static constexpr int64_t kValueWords = kBlockK / 2;  // value block rows: key pairs

    static constexpr int64_t kDimsPerWord = 2;  // in LaneGroup::q: bf16 dim pairs

    // st[j] = the lane group's scores of keys[j] (j < 16), times scale
    static void scores16(const LaneGroup& lg, const T* keys, int64_t dim, __m512 scale, __m512* st) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        const uint32_t* pairs = (const uint32_t*)keys;
        for (int64_t p = 0; p < dim / 2; p++) {
            const __m512bh qp = (__m512bh)_mm512_load_si512(lg.q + p * 16);
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qp,
                                          (__m512bh)_mm512_set1_epi32((int)pairs[j * dim / 2 + p]));
        }
        for (int j = 0; j < 16; j++) st[j] = _mm512_mul_ps(acc[j], scale);
    }

    // values: (kBlockK / 2, D) uint32, keys 2i and 2i + 1's values of a dim side by side
    // (zero for keys past n)
    static void pack_values(const T* const* rows, int64_t n, int64_t dim, uint32_t* values) {
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                            40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                            1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int64_t i = 0; i < (n + 1) / 2; i++) {
            const T* v1 = 2 * i + 1 < n ? rows[2 * i + 1] : nullptr;
            for (int64_t d = 0; d < dim; d += 32) {
                __m512i a = _mm512_loadu_si512(rows[2 * i] + d);
                __m512i b = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
                _mm512_store_si512(values + i * dim + d, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_store_si512(values + i * dim + d + 16, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
        for (int64_t i = (n + 1) / 2; i < kBlockK / 2; i++) memset(values + i * dim, 0, dim * 4);
    }

    // the block's probabilities exp(st - max) (keys < n16, a multiple of 16) in the form
    // accumulate takes, (n16 / 2, 16) bf16 pairs; returns their sum per lane
    static __m512 probabilities(const __m512* st, int64_t n16, __m512 max, uint32_t* p) {
        const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                    25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,
                                                    3, 18, 2, 17, 1, 16, 0);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n16 / 2; i++) {
            __m512 p0 = exp16(_mm512_sub_ps(st[2 * i], max));
            __m512 p1 = exp16(_mm512_sub_ps(st[2 * i + 1], max));
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // words: p0 lanes, p1 lanes
            _mm512_store_si512(p + i * 16, _mm512_permutexvar_epi16(interleave, both));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));  // unrounded, as torch sums
        }
        return sum;
    }

    // acc[i] += sum over the block's keys of P * V[., d0 + i], i < 16
    static void accumulate(__m512* acc, const uint32_t* p, const uint32_t* values, int64_t n16,
                           int64_t dim, int64_t d0) {
        for (int64_t i = 0; i < n16 / 2; i++) {
            const __m512bh pp = (__m512bh)_mm512_load_si512(p + i * 16);
            const uint32_t* v = values + i * dim + d0;
            for (int k = 0; k < 16; k++)
                acc[k] = _mm512_dpbf16_ps(acc[k], pp, (__m512bh)_mm512_set1_epi32((int)v[k]));
        }
    }

    static void store16(T* out, __m512 v) { simd512::store_bf16(out, v); }
};

struct Fp32 {
    using T = float;
    static constexpr int64_t kValueWords = kBlockK;  // value block rows: keys

    static constexpr int64_t kDimsPerWord = 1;  // in LaneGroup::q: one fp32 dim a word

    static void scores16(const LaneGroup& lg, const T* keys, int64_t dim, __m512 scale, __m512* st) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        const float* q = (const float*)lg.q;
        for (int64_t d = 0; d < dim; d++) {
            const __m512 qd = _mm512_load_ps(q + d * 16);
            for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(keys[j * dim + d]), acc[j]);
        }
        for (int j = 0; j < 16; j++) st[j] = _mm512_mul_ps(acc[j], scale);
    }

    // values: (kBlockK, D) fp32, the keys' rows (zero past n)
    static void pack_values(const T* const* rows, int64_t n, int64_t dim, uint32_t* values) {
        for (int64_t j = 0; j < kBlockK; j++) {
            if (j < n)
                memcpy(values + j * dim, rows[j], dim * 4);
            else
                memset(values + j * dim, 0, dim * 4);
        }
    }

    static __m512 probabilities(const __m512* st, int64_t n16, __m512 max, uint32_t* p) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n16; j++) {
            __m512 e = exp16(_mm512_sub_ps(st[j], max));
            _mm512_store_ps((float*)p + j * 16, e);
            sum = _mm512_add_ps(sum, e);
        }
        return sum;
    }

    static void accumulate(__m512* acc, const uint32_t* p, const uint32_t* values, int64_t n16,
                           int64_t dim, int64_t d0) {
        for (int64_t j = 0; j < n16; j++) {
            const __m512 pj = _mm512_load_ps((const float*)p + j * 16);
            const float* v = (const float*)values + j * dim + d0;
            for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(pj, _mm512_set1_ps(v[k]), acc[k]);
        }
    }

    static void store16(T* out, __m512 v) { _mm512_storeu_ps(out, v); }
};

// One key block [s0, s0 + n) for a lane group: online softmax and P . V.
// keys: (kBlockK, D) the keys' rows (zero past the block's keys); values: Kind's block.
template <typename Kind>
void attend_block(LaneGroup& lg, const typename Kind::T* keys, const uint32_t* values,
                  int64_t s0, int64_t n, int64_t dim, __m512 scale) {
    __m512 st[kBlockK];
    const int64_t n16 = (n + 15) / 16 * 16;
    for (int64_t j = 0; j < n16; j += 16) Kind::scores16(lg, keys + j * dim, dim, scale, st + j);
    // causal: key s is visible to lane l when s <= pos[l] (keys past n are past every
    // real lane's position; padding lanes may see them: their zero rows keep them finite)
    if (s0 + n16 - 1 > _mm512_reduce_min_epi32(lg.pos)) {
        for (int64_t j = 0; j < n16; j++) {
            __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(s0 + j)), lg.pos);
            st[j] = _mm512_mask_mov_ps(st[j], hidden, _mm512_set1_ps(-INFINITY));
        }
    }
    __m512 block_max = st[0];
    for (int64_t j = 1; j < n16; j++) block_max = _mm512_max_ps(block_max, st[j]);
    // every lane sees key 0 in the first block, so the max is finite from there on
    const __m512 new_max = _mm512_max_ps(lg.max, block_max);
    const __m512 alpha = exp16(_mm512_sub_ps(lg.max, new_max));  // max -inf at first: 0
    alignas(64) uint32_t p[kBlockK * 16];
    lg.sum = _mm512_add_ps(_mm512_mul_ps(lg.sum, alpha), Kind::probabilities(st, n16, new_max, p));
    lg.max = new_max;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(lg.out + (d0 + i) * 16), alpha);
        Kind::accumulate(acc, p, values, n16, dim, d0);
        for (int i = 0; i < 16; i++) _mm512_store_ps(lg.out + (d0 + i) * 16, acc[i]);
    }
}

// A lane group's fields at the start of a task: query head g of the task's KV head, its
// half-th 16 new tokens; no key seen yet.
inline void start_group(LaneGroup& lg, const Task& task, int64_t group, int64_t g, int64_t half,
                        int64_t prefix, int64_t dim) {
    lg.head = task.kh * group + g;
    lg.first = task.t0 + half * 16;
    lg.valid = std::min<int64_t>(16, task.n - half * 16);
    lg.key_end = prefix + lg.first + lg.valid;
    lg.pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(prefix + lg.first)),
                              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    lg.max = _mm512_set1_ps(-INFINITY);
    lg.sum = _mm512_setzero_ps();
    memset(lg.out, 0, dim * 16 * 4);
}

// A key block's K rows [s0, s0 + n) of KV head kh copied into keys (kBlockK rows, zero past
// n) and its V rows packed into values (Kind's layout): what every lane group of the task
// reads for that block.
template <typename Kind>
void load_block(const typename Kind::T* k_pool, const typename Kind::T* v_pool, const int64_t* slots,
                int64_t s0, int64_t n, int64_t kv_heads, int64_t kh, int64_t dim,
                typename Kind::T* keys, uint32_t* values) {
    using T = typename Kind::T;
    const T* rows[kBlockK];
    for (int64_t j = 0; j < kBlockK; j++) {
        if (j < n)
            memcpy(keys + j * dim, k_pool + (slots[s0 + j] * kv_heads + kh) * dim, dim * sizeof(T));
        else
            memset(keys + j * dim, 0, dim * sizeof(T));
    }
    for (int64_t j = 0; j < n; j++) rows[j] = v_pool + (slots[s0 + j] * kv_heads + kh) * dim;
    Kind::pack_values(rows, n, dim, values);
}

template <typename Kind>
void run_task(const Task& task, const typename Kind::T* q, const typename Kind::T* k_pool,
              const typename Kind::T* v_pool, const int64_t* slots, int64_t prefix, int64_t q_start,
              typename Kind::T* out, int64_t heads, int64_t kv_heads, int64_t dim,
              float scale, std::vector<LaneGroup>& groups, typename Kind::T* keys, uint32_t* values) {
    using T = typename Kind::T;
    const int64_t group = heads / kv_heads;
    const int64_t n_tokens = task.n;
    const int64_t halves = (n_tokens + 15) / 16;
    const int64_t n_groups = group * halves;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row = heads * dim;  // q and out: (T, H * D)
    for (int64_t g = 0; g < group; g++) {
        for (int64_t half = 0; half < halves; half++) {
            LaneGroup& lg = groups[g * halves + half];
            start_group(lg, task, group, g, half, prefix, dim);
            // the queries into lanes (padding lanes zero), 16 words of each at a time
            const T* q0 = q + (q_start + lg.first) * row + lg.head * dim;
            for (int64_t w0 = 0; w0 < dim / Kind::kDimsPerWord; w0 += 16) {
                __m512 r[16];
                for (int64_t l = 0; l < 16; l++)
                    r[l] = l < lg.valid ? _mm512_loadu_ps((const float*)(q0 + l * row) + w0) : _mm512_setzero_ps();
                transpose16(r);
                for (int64_t j = 0; j < 16; j++) _mm512_store_ps((float*)lg.q + (w0 + j) * 16, r[j]);
            }
        }
    }
    const int64_t key_end = prefix + task.t0 + n_tokens;
    for (int64_t s0 = 0; s0 < key_end; s0 += kBlockK) {
        const int64_t n = std::min(kBlockK, key_end - s0);
        load_block<Kind>(k_pool, v_pool, slots, s0, n, kv_heads, task.kh, dim, keys, values);
        for (int64_t i = 0; i < n_groups; i++) {
            LaneGroup& lg = groups[i];
            if (s0 < lg.key_end)
                attend_block<Kind>(lg, keys, values, s0, std::min(n, lg.key_end - s0), dim, vscale);
        }
    }
    for (int64_t i = 0; i < n_groups; i++) {
        LaneGroup& lg = groups[i];
        alignas(64) float inv[16];
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), lg.sum));
        T* o = out + (q_start + lg.first) * row + lg.head * dim;
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {  // 16 dims of each lane's output at a time
            __m512 r[16];
            for (int64_t j = 0; j < 16; j++) r[j] = _mm512_load_ps(lg.out + (d0 + j) * 16);
            transpose16(r);
            for (int64_t l = 0; l < lg.valid; l++)
                Kind::store16(o + l * row + d0, _mm512_mul_ps(r[l], _mm512_set1_ps(inv[l])));
        }
    }
}

#ifdef __AMX_BF16__
// Built with AMX (the kernel plan's "amx" build), a bf16 model's tasks run on the tile unit,
// queries in rows instead of lanes: per lane group (16 tokens of one query head) and key
// block of 32, S (16 x 32, fp32) = Q (16 x D) . K^T in tile products of 32 dims, the online
// softmax row by row on AVX-512, then P (16 x 32, rounded to bf16 as the lane build and
// torch's flash attention round it) . V (the block's values, key pairs side by side: the
// B-tile layout as the lane build packs them) in tile products of 16 dims, added to the
// row's output scaled by its softmax correction. K^T is laid out once per key block (per
// 32 dims and 16 keys a 16 x 16 word transpose: word p of key n is dims 2p, 2p + 1) and
// serves every lane group of the KV head. Tiles: 0-1 S, 2 Q, 3 K^T, 4 P, 5 V, 6 P . V.
void amx_configure() {
    TileConfig cfg;
    for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// kt (D / 32, 2, 16, 16) words: kt[c][h][p][n] = word 16c + p of key 16h + n of the block
// (keys: kBlockK rows of D bf16, zero past the block's keys).
void transpose_keys(const uint16_t* keys, int64_t dim, uint32_t* kt) {
    const int64_t words = dim / 2;
    for (int64_t c = 0; c < dim / 32; c++)
        for (int64_t h = 0; h < 2; h++) {
            __m512 r[16];
            for (int64_t n = 0; n < 16; n++)
                r[n] = _mm512_load_ps((const float*)((const uint32_t*)keys + (16 * h + n) * words + 16 * c));
            transpose16(r);
            for (int64_t p = 0; p < 16; p++) _mm512_store_ps((float*)(kt + ((c * 2 + h) * 16 + p) * 16), r[p]);
        }
}

// One key block [s0, s0 + n) for a lane group held in rows: lg.q (16, D) bf16 queries,
// lg.out (16, D) fp32 unnormalized outputs, lg.max / lg.sum lane m = row m's.
void attend_block_amx(LaneGroup& lg, const uint32_t* kt, const uint32_t* values, int64_t s0,
                      int64_t n, int64_t dim, float scale) {
    alignas(64) float st[16 * kBlockK];
    alignas(64) uint16_t p[16 * kBlockK];
    alignas(64) float pv[16 * 16];
    const bool two = n > 16;  // the block's second 16 keys
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < dim / 32; c++) {
        _tile_loadd(2, (const uint16_t*)lg.q + 32 * c, dim * 2);
        _tile_loadd(3, kt + (c * 2) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
            _tile_loadd(3, kt + (c * 2 + 1) * 256, 64);
            _tile_dpbf16ps(1, 2, 3);
        }
    }
    _tile_stored(0, st, kBlockK * 4);
    _tile_stored(1, st + 16, kBlockK * 4);
    // causal: row m sees keys s0 + j <= its position, and j < n
    alignas(64) int32_t pos[16];
    __m512 rows[16];
    _mm512_store_si512(pos, lg.pos);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t m = 0; m < 16; m++) {
        const int64_t seen = std::max<int64_t>(0, std::min<int64_t>(n, pos[m] - s0 + 1));
        const __mmask16 k0 = (__mmask16)(seen >= 16 ? 0xFFFF : (1u << seen) - 1);
        const __mmask16 k1 = (__mmask16)(seen >= 32 ? 0xFFFF : seen <= 16 ? 0 : (1u << (seen - 16)) - 1);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        const __m512 v0 = _mm512_mask_mul_ps(ninf, k0, _mm512_load_ps(st + m * kBlockK), vscale);
        const __m512 v1 = _mm512_mask_mul_ps(ninf, k1, _mm512_load_ps(st + m * kBlockK + 16), vscale);
        _mm512_store_ps(st + m * kBlockK, v0);
        _mm512_store_ps(st + m * kBlockK + 16, v1);
        rows[m] = _mm512_max_ps(v0, v1);
    }
    // a row that has seen no key yet keeps max -inf: its probabilities are 0, its alpha 1
    const __m512 new_max = _mm512_max_ps(lg.max, reduce_rows(rows, max16));
    const __mmask16 live = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 shift = _mm512_maskz_mov_ps(live, new_max);
    const __m512 alpha = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(lg.max, shift)));
    alignas(64) float shifts[16], alphas[16];
    _mm512_store_ps(shifts, shift);
    _mm512_store_ps(alphas, alpha);
    for (int64_t m = 0; m < 16; m++) {
        const __m512 mm = _mm512_set1_ps(shifts[m]);
        const __m512 p0 = exp16(_mm512_sub_ps(_mm512_load_ps(st + m * kBlockK), mm));
        const __m512 p1 = exp16(_mm512_sub_ps(_mm512_load_ps(st + m * kBlockK + 16), mm));
        _mm512_store_si512(p + m * kBlockK, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        rows[m] = _mm512_add_ps(p0, p1);  // unrounded, as torch sums
    }
    lg.sum = _mm512_add_ps(_mm512_mul_ps(lg.sum, alpha), reduce_rows(rows, add16));
    lg.max = new_max;
    _tile_loadd(4, p, kBlockK * 2);
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        _tile_zero(6);
        _tile_loadd(5, values + d0, dim * 4);
        _tile_dpbf16ps(6, 4, 5);
        _tile_stored(6, pv, 64);
        for (int64_t m = 0; m < 16; m++) {
            float* o = lg.out + m * dim + d0;
            _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), _mm512_set1_ps(alphas[m]),
                                               _mm512_load_ps(pv + m * 16)));
        }
    }
}

// run_task's work for a bf16 task on the tile unit (see attend_block_amx).
void run_task_amx(const Task& task, const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
                  const int64_t* slots, int64_t prefix, int64_t q_start, uint16_t* out, int64_t heads,
                  int64_t kv_heads, int64_t dim, float scale, std::vector<LaneGroup>& groups,
                  uint16_t* keys, uint32_t* values, uint32_t* kt) {
    const int64_t group = heads / kv_heads;
    const int64_t n_tokens = task.n;
    const int64_t halves = (n_tokens + 15) / 16;
    const int64_t n_groups = group * halves;
    const int64_t row = heads * dim;  // q and out: (T, H * D)
    for (int64_t g = 0; g < group; g++) {
        for (int64_t half = 0; half < halves; half++) {
            LaneGroup& lg = groups[g * halves + half];
            start_group(lg, task, group, g, half, prefix, dim);
            uint16_t* rows_q = (uint16_t*)lg.q;  // (16, D): the tokens' queries, padding rows 0
            const uint16_t* q0 = q + (q_start + lg.first) * row + lg.head * dim;
            for (int64_t m = 0; m < 16; m++) {
                if (m < lg.valid)
                    memcpy(rows_q + m * dim, q0 + m * row, dim * 2);
                else
                    memset(rows_q + m * dim, 0, dim * 2);
            }
        }
    }
    const int64_t key_end = prefix + task.t0 + n_tokens;
    for (int64_t s0 = 0; s0 < key_end; s0 += kBlockK) {
        const int64_t n = std::min(kBlockK, key_end - s0);
        load_block<Bf16>(k_pool, v_pool, slots, s0, n, kv_heads, task.kh, dim, keys, values);
        transpose_keys(keys, dim, kt);
        for (int64_t i = 0; i < n_groups; i++) {
            LaneGroup& lg = groups[i];
            if (s0 < lg.key_end)
                attend_block_amx(lg, kt, values, s0, std::min(n, lg.key_end - s0), dim, scale);
        }
    }
    for (int64_t i = 0; i < n_groups; i++) {
        LaneGroup& lg = groups[i];
        alignas(64) float inv[16];
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), lg.sum));
        uint16_t* o = out + (q_start + lg.first) * row + lg.head * dim;
        for (int64_t m = 0; m < lg.valid; m++)
            for (int64_t d0 = 0; d0 < dim; d0 += 16)
                simd512::store_bf16(o + m * row + d0,
                                    _mm512_mul_ps(_mm512_load_ps(lg.out + m * dim + d0), _mm512_set1_ps(inv[m])));
    }
}
#endif

template <typename Kind>
void attend(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
            const int64_t* rows, const int64_t* prefix_lens, const int64_t* extend_lens,
            void* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t table_stride, float scale, int num_threads) {
    using T = typename Kind::T;
    std::vector<int64_t> q_starts;
    const std::vector<Task> tasks = extend::tasks_of(batch, kv_heads, prefix_lens, extend_lens, num_threads, q_starts, kMaxBlockQ);
    const int64_t n_tasks = (int64_t)tasks.size();
#pragma omp parallel num_threads(num_threads)
    {
        static thread_local std::vector<LaneGroup> groups(kMaxGroup * kMaxBlockQ / 16);
        static thread_local std::vector<uint32_t> key_buf(kBlockK * kMaxDim + 16), value_buf(kBlockK * kMaxDim + 16);
        T* keys = (T*)(((uintptr_t)key_buf.data() + 63) & ~(uintptr_t)63);
        uint32_t* values = (uint32_t*)(((uintptr_t)value_buf.data() + 63) & ~(uintptr_t)63);
#ifdef __AMX_BF16__
        constexpr bool amx = std::is_same<Kind, Bf16>::value;
        static thread_local std::vector<uint32_t> kt_buf(kMaxDim * 16 + 16);
        uint32_t* kt = (uint32_t*)(((uintptr_t)kt_buf.data() + 63) & ~(uintptr_t)63);
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; i++) {
            const Task& t = tasks[i];
#ifdef __AMX_BF16__
            if (amx) {
                run_task_amx(t, (const uint16_t*)q, (const uint16_t*)k_pool, (const uint16_t*)v_pool,
                             table + rows[t.b] * table_stride, prefix_lens[t.b], q_starts[t.b],
                             (uint16_t*)out, heads, kv_heads, dim, scale, groups, (uint16_t*)keys,
                             values, kt);
                continue;
            }
#endif
            run_task<Kind>(t, (const T*)q, (const T*)k_pool, (const T*)v_pool,
                           table + rows[t.b] * table_stride, prefix_lens[t.b], q_starts[t.b],
                           (T*)out, heads, kv_heads, dim, scale, groups, keys, values);
        }
#ifdef __AMX_BF16__
        if (amx) _tile_release();
#endif
    }
}

}  // namespace

extern "C" {

// q (T, H, D): the new tokens of `batch` requests one request after the other (extend_lens[b]
// each); k_pool, v_pool (N, KH, D) holding every key of each request (its first
// prefix_lens[b] + extend_lens[b] positions at table[rows[b]]); out (T, H * D). All bf16
// (dtype 1) or all fp32 (dtype 0). Request b's token i is at position prefix_lens[b] + i
// and attends the positions <= it.
void extend_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                      const int64_t* rows, const int64_t* prefix_lens, const int64_t* extend_lens,
                      void* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads, int dtype) {
    auto run = dtype == 1 ? attend<Bf16> : attend<Fp32>;
    run(q, k_pool, v_pool, table, rows, prefix_lens, extend_lens, out, batch, heads, kv_heads, dim,
        table_stride, scale, num_threads);
}

int extend_attention_supports(int64_t heads, int64_t kv_heads, int64_t dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && dim % 32 == 0 &&
           dim <= kMaxDim;
}

// This build takes bf16 as well as fp32.
int extend_attention_takes_bf16() { return 1; }

#ifdef __AMX_BF16__
// The AMX build: Linux's permission for the tile state (once per process), before any call.
int extend_attention_amx_enable() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
#endif

}  // extern "C"
