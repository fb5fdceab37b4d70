// Prefill / extend attention over the KV pool for x86 CPUs with AVX2 and FMA, for an fp32
// model over an fp32 pool: the AVX2 build of extend_attention_avx512.cpp's fp32 path (read
// that file first), 8 queries in the lanes of each vector instead of 16.
//
//   out[t, h] = softmax_{s <= pos(t)}(q[t, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// A task is (request, KV head, block of 32 new tokens), costliest first; a lane group is 8
// consecutive tokens of one query head. Scores of 8 keys come from 8 accumulators (an FMA
// per dim with the key's value broadcast), the softmax runs online over blocks of 32 keys,
// and P . V adds each key's probabilities times its value of a dim (broadcast) into the
// output held transposed (dim, 8 lanes), all in fp32.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "extend_tasks.h"
#include "simd_avx2.h"

namespace {

using simd::exp8;

using extend::kBlockQ;  // new tokens per task
constexpr int64_t kBlockK = 32;   // keys per softmax block
constexpr int64_t kMaxDim = 256;  // head size held in the per-lane-group scratch
constexpr int64_t kMaxGroup = 8;  // query heads per KV head
constexpr int64_t kLanes = 8;

using extend::Task;

// State of one lane group (8 tokens of one query head) across the key blocks.
struct LaneGroup {
    int64_t head, first, valid, key_end;  // as in extend_attention_avx512.cpp
    __m256i pos;                          // absolute position of each lane's token
    __m256 max, sum;                      // running max and sum of exp per lane
    alignas(32) float q[kMaxDim * kLanes];    // (D, 8): dim d of lane l's query
    alignas(32) float out[kMaxDim * kLanes];  // (D, 8): unnormalized output, transposed
};

// st[j] = the lane group's scores of keys[j] (j < 8), times scale
inline void scores8(const LaneGroup& lg, const float* keys, int64_t dim, __m256 scale, __m256* st) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const __m256 qd = _mm256_load_ps(lg.q + d * kLanes);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(keys + j * dim + d), acc[j]);
    }
    for (int j = 0; j < 8; j++) st[j] = _mm256_mul_ps(acc[j], scale);
}

// One key block [s0, s0 + n) for a lane group: online softmax and P . V. keys, values:
// (kBlockK, D) the keys' rows (zero past the block's keys).
void attend_block(LaneGroup& lg, const float* keys, const float* values, int64_t s0, int64_t n,
                  int64_t dim, __m256 scale) {
    __m256 st[kBlockK];
    const int64_t n8 = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < n8; j += 8) scores8(lg, keys + j * dim, dim, scale, st + j);
    // causal: key s is visible to lane l when s <= pos[l] (lane 0 has the lowest position)
    if (s0 + n8 - 1 > _mm256_cvtsi256_si32(lg.pos)) {
        const __m256 hidden_score = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n8; j++) {
            __m256 hidden = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(s0 + j)), lg.pos));
            st[j] = _mm256_blendv_ps(st[j], hidden_score, hidden);
        }
    }
    __m256 block_max = st[0];
    for (int64_t j = 1; j < n8; j++) block_max = _mm256_max_ps(block_max, st[j]);
    // every lane sees key 0 in the first block, so the max is finite from there on
    const __m256 new_max = _mm256_max_ps(lg.max, block_max);
    const __m256 alpha = exp8(_mm256_sub_ps(lg.max, new_max));  // max -inf at first: 0
    alignas(32) float p[kBlockK * kLanes];
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j++) {
        __m256 e = exp8(_mm256_sub_ps(st[j], new_max));
        _mm256_store_ps(p + j * kLanes, e);
        sum = _mm256_add_ps(sum, e);
    }
    lg.sum = _mm256_add_ps(_mm256_mul_ps(lg.sum, alpha), sum);
    lg.max = new_max;
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_mul_ps(_mm256_load_ps(lg.out + (d0 + i) * kLanes), alpha);
        for (int64_t j = 0; j < n8; j++) {
            const __m256 pj = _mm256_load_ps(p + j * kLanes);
            const float* v = values + j * dim + d0;
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pj, _mm256_broadcast_ss(v + i), acc[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_store_ps(lg.out + (d0 + i) * kLanes, acc[i]);
    }
}

void run_task(const Task& task, const float* q, const float* k_pool, const float* v_pool,
              const int64_t* slots, int64_t prefix, int64_t q_start, float* out,
              int64_t heads, int64_t kv_heads, int64_t dim, float scale,
              std::vector<LaneGroup>& groups, float* keys, float* values) {
    const int64_t group = heads / kv_heads;
    const int64_t n_tokens = task.n;
    const int64_t parts = (n_tokens + kLanes - 1) / kLanes;  // lane groups per query head
    const int64_t n_groups = group * parts;
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t row = heads * dim;  // q and out: (T, H * D)
    for (int64_t g = 0; g < group; g++) {
        for (int64_t part = 0; part < parts; part++) {
            LaneGroup& lg = groups[g * parts + part];
            lg.head = task.kh * group + g;
            lg.first = task.t0 + part * kLanes;
            lg.valid = std::min<int64_t>(kLanes, n_tokens - part * kLanes);
            lg.key_end = prefix + lg.first + lg.valid;
            lg.pos = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(prefix + lg.first)),
                                      _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0));
            lg.max = _mm256_set1_ps(-INFINITY);
            lg.sum = _mm256_setzero_ps();
            memset(lg.q, 0, dim * kLanes * 4);
            memset(lg.out, 0, dim * kLanes * 4);
            for (int64_t l = 0; l < lg.valid; l++) {
                const float* qrow = q + (q_start + lg.first + l) * row + lg.head * dim;
                for (int64_t d = 0; d < dim; d++) lg.q[d * kLanes + l] = qrow[d];
            }
        }
    }
    const int64_t key_end = prefix + task.t0 + n_tokens;
    for (int64_t s0 = 0; s0 < key_end; s0 += kBlockK) {
        const int64_t n = std::min(kBlockK, key_end - s0);
        for (int64_t j = 0; j < kBlockK; j++) {
            if (j < n) {
                const int64_t at = (slots[s0 + j] * kv_heads + task.kh) * dim;
                memcpy(keys + j * dim, k_pool + at, dim * 4);
                memcpy(values + j * dim, v_pool + at, dim * 4);
            } else {
                memset(keys + j * dim, 0, dim * 4);
                memset(values + j * dim, 0, dim * 4);
            }
        }
        for (int64_t i = 0; i < n_groups; i++) {
            LaneGroup& lg = groups[i];
            if (s0 < lg.key_end)
                attend_block(lg, keys, values, s0, std::min(n, lg.key_end - s0), dim, vscale);
        }
    }
    for (int64_t i = 0; i < n_groups; i++) {
        LaneGroup& lg = groups[i];
        alignas(32) float inv[kLanes];
        _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), lg.sum));
        for (int64_t l = 0; l < lg.valid; l++) {
            float* o = out + (q_start + lg.first + l) * row + lg.head * dim;
            for (int64_t d = 0; d < dim; d++) o[d] = lg.out[d * kLanes + l] * inv[l];
        }
    }
}

}  // namespace

extern "C" {

// As extend_attention_avx512.cpp's, for fp32 only (dtype 0).
void extend_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                      const int64_t* rows, const int64_t* prefix_lens, const int64_t* extend_lens,
                      void* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads, int dtype) {
    if (dtype != 0) return;  // the Python side sends this build fp32 alone
    std::vector<int64_t> q_starts;
    const std::vector<Task> tasks = extend::tasks_of(batch, kv_heads, prefix_lens, extend_lens, num_threads, q_starts);
    const int64_t n_tasks = (int64_t)tasks.size();
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<LaneGroup> groups(kMaxGroup * kBlockQ / kLanes);
        std::vector<float> key_buf(kBlockK * kMaxDim + 8), value_buf(kBlockK * kMaxDim + 8);
        float* keys = (float*)(((uintptr_t)key_buf.data() + 31) & ~(uintptr_t)31);
        float* values = (float*)(((uintptr_t)value_buf.data() + 31) & ~(uintptr_t)31);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; i++) {
            const Task& t = tasks[i];
            run_task(t, (const float*)q, (const float*)k_pool, (const float*)v_pool,
                     table + rows[t.b] * table_stride, prefix_lens[t.b], q_starts[t.b],
                     (float*)out, heads, kv_heads, dim, scale, groups, keys, values);
        }
    }
}

int extend_attention_supports(int64_t heads, int64_t kv_heads, int64_t dim) {
    return heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && dim % 8 == 0 &&
           dim <= kMaxDim;
}

// This build takes fp32 alone.
int extend_attention_takes_bf16() { return 0; }

}  // extern "C"
