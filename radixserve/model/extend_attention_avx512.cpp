// Prefill / extend attention over the KV pool for x86 CPUs with AVX-512 (F, BW, VL, DQ) and
// AVX512-BF16, for a bf16 model with a bf16 pool: each request's new tokens attend causally
// to its cached prefix and to themselves, reading K/V where they lie in the pool (the new
// tokens' K/V are written there first): no gathered copy, no padding, no mask tensor.
//
//   out[t, h] = softmax_{s <= pos(t)}(q[t, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// Layout of the work (flash attention, queries in lanes):
// - a task is (request, KV head, block of 32 new tokens); tasks run costliest first (those
//   with the most keys) on dynamically scheduled threads.
// - a lane group is 16 consecutive tokens of one query head: the lanes of every vector below
//   are those 16 queries. Scores of 16 keys come from 16 accumulators, vdpbf16ps of the
//   queries' dim pairs (packed once per task) with a key's dim pair broadcast: no horizontal
//   sums. The softmax runs online (running max and sum per lane) over blocks of 32 keys, all
//   of it vertical.
// - P . V: vdpbf16ps of the probabilities of two keys (rounded to bf16, as torch's flash
//   attention rounds P for bf16) with the two keys' values of one dim broadcast: the output
//   is held transposed (dim, 16 lanes) in fp32 and transposed once at the end.
// - a key block's rows are copied (K) and paired (V: two keys' values of a dim side by side)
//   once per task and serve every lane group of the KV head's query heads.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "simd_avx512.h"

namespace {

using simd512::exp16;

constexpr int64_t kBlockQ = 32;   // new tokens per task (two lane groups per query head)
constexpr int64_t kBlockK = 32;   // keys per softmax block
constexpr int64_t kMaxDim = 256;  // head size held in the per-lane-group scratch
constexpr int64_t kMaxGroup = 8;  // query heads per KV head

struct Task {
    int64_t b, kh, t0, cost;
};

// State of one lane group (16 tokens of one query head) across the key blocks.
struct LaneGroup {
    int64_t head;          // query head
    int64_t first;         // first token of the group (offset in the request's new tokens)
    int64_t valid;         // its real tokens (<= 16); the other lanes are padding
    int64_t key_end;       // keys [0, key_end) are visible to some lane
    __m512i pos;           // absolute position of each lane's token
    __m512 max, sum;       // running max and sum of exp per lane
    alignas(64) uint32_t q[kMaxDim / 2 * 16];  // (D/2, 16): dim pair p of lane l's query
    alignas(64) float out[kMaxDim * 16];       // (D, 16): unnormalized output, transposed
};

// St[j] = scores of keys k_rows[j] (j < 16) for the lane group's queries, times scale.
inline void scores16(const LaneGroup& lg, const uint16_t* k_rows, int64_t dim, __m512 scale,
                     __m512* st) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    const uint32_t* keys = (const uint32_t*)k_rows;  // dim pairs
    for (int64_t p = 0; p < dim / 2; p++) {
        const __m512bh qp = (__m512bh)_mm512_load_si512(lg.q + p * 16);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], qp,
                                      (__m512bh)_mm512_set1_epi32((int)keys[j * dim / 2 + p]));
    }
    for (int j = 0; j < 16; j++) st[j] = _mm512_mul_ps(acc[j], scale);
}

// One key block [s0, s0 + n) for a lane group: online softmax and P . V.
// k_rows: (kBlockK, D) the keys' rows (zero past n); v_pairs: (kBlockK / 2, D) uint32, two
// keys' values of a dim side by side.
void attend_block(LaneGroup& lg, const uint16_t* k_rows, const uint32_t* v_pairs, int64_t s0,
                  int64_t n, int64_t dim, __m512 scale) {
    __m512 st[kBlockK];
    const int64_t halves = (n + 15) / 16;
    for (int64_t h = 0; h < halves; h++) scores16(lg, k_rows + h * 16 * dim, dim, scale, st + h * 16);
    for (int64_t j = halves * 16; j < kBlockK; j++) st[j] = _mm512_set1_ps(-INFINITY);
    // causal: key s is visible to lane l when s <= pos[l] (keys past n are past every
    // real lane's position; padding lanes may see them: their zero rows keep them finite)
    const int64_t last_key = s0 + halves * 16 - 1;
    const int32_t lowest = _mm512_reduce_min_epi32(lg.pos);
    if (last_key > lowest) {
        for (int64_t j = 0; j < halves * 16; j++) {
            __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(s0 + j)), lg.pos);
            st[j] = _mm512_mask_mov_ps(st[j], hidden, _mm512_set1_ps(-INFINITY));
        }
    }
    __m512 block_max = st[0];
    for (int64_t j = 1; j < halves * 16; j++) block_max = _mm512_max_ps(block_max, st[j]);
    const __m512 new_max = _mm512_max_ps(lg.max, block_max);
    // every lane sees key 0 in the first block, so new_max is finite from there on
    const __m512 alpha = exp16(_mm512_sub_ps(lg.max, new_max));  // max -inf at first: 0
    __m512 sum = _mm512_mul_ps(lg.sum, alpha);
    alignas(64) uint32_t p_pairs[kBlockK / 2 * 16];  // (pairs, 16 lanes) bf16 pairs
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    const int64_t pairs = halves * 8;
    for (int64_t jp = 0; jp < pairs; jp++) {
        __m512 p0 = exp16(_mm512_sub_ps(st[2 * jp], new_max));
        __m512 p1 = exp16(_mm512_sub_ps(st[2 * jp + 1], new_max));
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // words: p0 lanes, p1 lanes
        __m512i paired = _mm512_permutexvar_epi16(interleave, both);
        _mm512_store_si512(p_pairs + jp * 16, paired);
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));  // unrounded, as torch's flash attention sums
    }
    lg.max = new_max;
    lg.sum = sum;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(lg.out + (d0 + i) * 16), alpha);
        for (int64_t jp = 0; jp < pairs; jp++) {
            const __m512bh pp = (__m512bh)_mm512_load_si512(p_pairs + jp * 16);
            const uint32_t* vp = v_pairs + jp * dim + d0;
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], pp, (__m512bh)_mm512_set1_epi32((int)vp[i]));
        }
        for (int i = 0; i < 16; i++) _mm512_store_ps(lg.out + (d0 + i) * 16, acc[i]);
    }
}

void run_task(const Task& task, const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
              const int64_t* slots, int64_t prefix, int64_t extend, int64_t q_start,
              uint16_t* out, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
              std::vector<LaneGroup>& groups, uint16_t* k_rows, uint32_t* v_pairs) {
    const int64_t group = heads / kv_heads;
    const int64_t n_tokens = std::min(kBlockQ, extend - task.t0);
    const int64_t halves = (n_tokens + 15) / 16;
    const int64_t n_groups = group * halves;
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row = heads * dim;  // q and out: (T, H * D)
    for (int64_t g = 0; g < group; g++) {
        for (int64_t half = 0; half < halves; half++) {
            LaneGroup& lg = groups[g * halves + half];
            lg.head = task.kh * group + g;
            lg.first = task.t0 + half * 16;
            lg.valid = std::min<int64_t>(16, n_tokens - half * 16);
            lg.key_end = prefix + lg.first + lg.valid;
            lg.pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(prefix + lg.first)),
                                      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
            lg.max = _mm512_set1_ps(-INFINITY);
            lg.sum = _mm512_setzero_ps();
            memset(lg.q, 0, dim / 2 * 16 * 4);
            memset(lg.out, 0, dim * 16 * 4);
            for (int64_t l = 0; l < lg.valid; l++) {
                const uint32_t* qrow = (const uint32_t*)(q + (q_start + lg.first + l) * row + lg.head * dim);
                for (int64_t p = 0; p < dim / 2; p++) lg.q[p * 16 + l] = qrow[p];
            }
        }
    }
    const int64_t key_end = prefix + task.t0 + n_tokens;
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                            40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                            1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t s0 = 0; s0 < key_end; s0 += kBlockK) {
        const int64_t n = std::min(kBlockK, key_end - s0);
        for (int64_t j = 0; j < kBlockK; j++) {
            if (j < n)
                memcpy(k_rows + j * dim, k_pool + (slots[s0 + j] * kv_heads + task.kh) * dim, dim * 2);
            else
                memset(k_rows + j * dim, 0, dim * 2);
        }
        for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
            const uint16_t* v0 = v_pool + (slots[s0 + 2 * jp] * kv_heads + task.kh) * dim;
            const uint16_t* v1 = 2 * jp + 1 < n ? v_pool + (slots[s0 + 2 * jp + 1] * kv_heads + task.kh) * dim : nullptr;
            for (int64_t d = 0; d < dim; d += 32) {
                __m512i a = _mm512_loadu_si512(v0 + d);
                __m512i b = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
                _mm512_store_si512(v_pairs + jp * dim + d, _mm512_permutex2var_epi16(a, lo_idx, b));
                _mm512_store_si512(v_pairs + jp * dim + d + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
            }
        }
        for (int64_t jp = (n + 1) / 2; jp < kBlockK / 2; jp++) memset(v_pairs + jp * dim, 0, dim * 4);
        for (int64_t i = 0; i < n_groups; i++) {
            LaneGroup& lg = groups[i];
            if (s0 >= lg.key_end) continue;
            attend_block(lg, k_rows, v_pairs, s0, std::min(n, lg.key_end - s0), dim, vscale);
        }
    }
    alignas(64) float result[kMaxDim];
    for (int64_t i = 0; i < n_groups; i++) {
        LaneGroup& lg = groups[i];
        alignas(64) float inv[16];
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), lg.sum));
        for (int64_t l = 0; l < lg.valid; l++) {
            for (int64_t d = 0; d < dim; d++) result[d] = lg.out[d * 16 + l] * inv[l];
            uint16_t* o = out + (q_start + lg.first + l) * row + lg.head * dim;
            for (int64_t d = 0; d < dim; d += 16) simd512::store_bf16(o + d, _mm512_load_ps(result + d));
        }
    }
}

}  // namespace

extern "C" {

// q (T, H, D) bf16: the new tokens of `batch` requests one request after the other
// (extend_lens[b] each); k_pool, v_pool (N, KH, D) bf16 holding every key of each request
// (its first seq = prefix_lens[b] + extend_lens[b] positions at table[rows[b]]); out (T, H * D)
// bf16. Request b's token i is at position prefix_lens[b] + i and attends positions <= it.
void extend_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                      const int64_t* rows, const int64_t* prefix_lens, const int64_t* extend_lens,
                      void* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads) {
    std::vector<int64_t> q_starts(batch);
    std::vector<Task> tasks;
    int64_t start = 0;
    for (int64_t b = 0; b < batch; b++) {
        q_starts[b] = start;
        start += extend_lens[b];
        for (int64_t t0 = 0; t0 < extend_lens[b]; t0 += kBlockQ)
            for (int64_t kh = 0; kh < kv_heads; kh++)
                tasks.push_back({b, kh, t0, prefix_lens[b] + std::min(t0 + kBlockQ, extend_lens[b])});
    }
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const Task& x, const Task& y) { return x.cost > y.cost; });
    const int64_t n_tasks = (int64_t)tasks.size();
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<LaneGroup> groups(kMaxGroup * 2);
        std::vector<uint16_t, std::allocator<uint16_t>> k_buf(kBlockK * kMaxDim + 32);
        std::vector<uint32_t> v_buf(kBlockK / 2 * kMaxDim + 16);
        uint16_t* k_rows = (uint16_t*)(((uintptr_t)k_buf.data() + 63) & ~(uintptr_t)63);
        uint32_t* v_pairs = (uint32_t*)(((uintptr_t)v_buf.data() + 63) & ~(uintptr_t)63);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; i++) {
            const Task& t = tasks[i];
            run_task(t, (const uint16_t*)q, (const uint16_t*)k_pool, (const uint16_t*)v_pool,
                     table + rows[t.b] * table_stride, prefix_lens[t.b], extend_lens[t.b],
                     q_starts[t.b], (uint16_t*)out, heads, kv_heads, dim, scale, groups, k_rows,
                     v_pairs);
        }
    }
}

int extend_attention_supports(int64_t heads, int64_t kv_heads, int64_t dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && dim % 32 == 0 &&
           dim <= kMaxDim;
}

}  // extern "C"
