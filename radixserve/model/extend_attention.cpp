// Prefill / extend attention over the KV pool for x86 CPUs with AVX2 and FMA, for an fp32
// model over an fp32 pool: the AVX2 build of extend_attention_avx512.cpp's fp32 path (read
// that file first), 8 queries in the lanes of each vector instead of 16.
//
//   out[t, h] = softmax_{s <= pos(t)}(q[t, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// A task is (request, KV head, block of 32 new tokens), costliest first; a lane group is 8
// consecutive tokens of one query head. The lane groups of the same tokens of up to three
// query heads (a KV head's) run together, a pass: their scores of 4 keys come from 12
// accumulators (an FMA per dim with the key's value broadcast once for the three), the
// softmax runs online over blocks of 32 keys, and P . V adds each key's probabilities
// times its value of a dim (broadcast once for the three) into the outputs held
// transposed (dim, 8 lanes), 4 dims a pass (8 for a head alone), all in fp32. Each query's sums are those it
// would get alone (same terms, same order), so the bits are those of one lane group at a
// time (8 keys' scores, 8 dims of P . V a pass: 9 loads for 8 FMAs where this makes 7 for
// 12; a KV head of one query head keeps that), which `benchmarks/attention_builds.py --kind
// extend --base 55c1955` checks on several head shapes before it times the two.
// AMD EPYC (Zen 3, AVX2), 2 threads, SmolLM2's heads (3 query heads a KV head), the
// kernel over 30 layers' pools, one head a pass -> three, ms (medians of 10, alternated,
// two runs): two prompts of 512 249.5, 223.0 -> 220.4, 189.6; 544 + 469 tokens 211.5,
// 191.4 -> 179.5, 168.4; 16 x 32 tokens after 512 cached 237.3, 213.4 -> 197.0, 200.2; one
// prompt of 2,048 1,576, 1,359 -> 1,302, 1,207.
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

// Query heads of one KV head whose lane groups (the same tokens) a pass takes together: each
// key's and each value's broadcast then serves up to three lane groups (12 accumulators,
// 3 query or probability vectors and the broadcast: AVX2's 16 registers), 7 loads for 12
// FMAs where one lane group at a time made 9 for 8.
constexpr int kPassHeads = 3;

// The lane groups of a pass, each lane group's arithmetic as if it ran alone: every
// score's and every output dim's sum runs over the same terms in the same order.
template <int R>
struct Pass {
    LaneGroup* lg[R];
};

// Keys (scores) or dims (P . V) a pass takes at a time: 4 for 2 or 3 lane groups (8 or 12
// accumulators), 8 for one alone (8 accumulators, as many as keep Zen 3's two FMA pipes busy
// through their 4-cycle latency; 4 would leave them half idle).
template <int R>
constexpr int kStepOf = R == 1 ? 8 : 4;

// st[r][j] = lane group r's scores of keys[j] (j < n8, a multiple of 8), times scale: each
// a sum over the dims in order, one FMA a dim.
template <int R>
inline void scores(const Pass<R>& pass, const float* keys, int64_t n8, int64_t dim, __m256 scale,
                   __m256 (*st)[kBlockK]) {
    constexpr int kStep = kStepOf<R>;
    for (int64_t j0 = 0; j0 < n8; j0 += kStep) {
        __m256 acc[R][kStep];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < kStep; j++) acc[r][j] = _mm256_setzero_ps();
        const float* k = keys + j0 * dim;
        for (int64_t d = 0; d < dim; d++) {
            __m256 qd[R];
            for (int r = 0; r < R; r++) qd[r] = _mm256_load_ps(pass.lg[r]->q + d * kLanes);
            for (int j = 0; j < kStep; j++) {
                const __m256 kj = _mm256_broadcast_ss(k + j * dim + d);
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(qd[r], kj, acc[r][j]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < kStep; j++) st[r][j0 + j] = _mm256_mul_ps(acc[r][j], scale);
    }
}

// A lane group's online softmax over one key block [s0, s0 + n8) of scores st: the causal
// mask, the running max and sum updated, the block's probabilities into p (n8 x 8 lanes);
// returns the factor the output held so far is scaled by.
inline __m256 softmax_block(LaneGroup& lg, __m256* st, int64_t s0, int64_t n8, float* p) {
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
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j++) {
        __m256 e = exp8(_mm256_sub_ps(st[j], new_max));
        _mm256_store_ps(p + j * kLanes, e);
        sum = _mm256_add_ps(sum, e);
    }
    lg.sum = _mm256_add_ps(_mm256_mul_ps(lg.sum, alpha), sum);
    lg.max = new_max;
    return alpha;
}

// P . V: each lane group's output (scaled by its alpha) plus its probabilities p[r] (n8 x 8
// lanes) times the values' rows, kStep dims a pass over the keys, each dim's sum over the
// keys in order.
template <int R>
inline void add_values(const Pass<R>& pass, const float (*p)[kBlockK * kLanes], const __m256* alpha,
                       const float* values, int64_t n8, int64_t dim) {
    constexpr int kStep = kStepOf<R>;
    for (int64_t d0 = 0; d0 < dim; d0 += kStep) {
        __m256 acc[R][kStep];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < kStep; i++)
                acc[r][i] = _mm256_mul_ps(_mm256_load_ps(pass.lg[r]->out + (d0 + i) * kLanes), alpha[r]);
        for (int64_t j = 0; j < n8; j++) {
            __m256 pj[R];
            for (int r = 0; r < R; r++) pj[r] = _mm256_load_ps(p[r] + j * kLanes);
            const float* v = values + j * dim + d0;
            for (int i = 0; i < kStep; i++) {
                const __m256 vi = _mm256_broadcast_ss(v + i);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(pj[r], vi, acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < kStep; i++) _mm256_store_ps(pass.lg[r]->out + (d0 + i) * kLanes, acc[r][i]);
    }
}

// One key block [s0, s0 + n) for the lane groups of query heads [g, g + R) of one token
// range (groups: head-major, `parts` ranges a head; the same tokens, so the same keys
// visible): scores, online softmax and P . V. keys, values: (kBlockK, D) the block's keys'
// rows, zero past the task's; keys from n to n8 (later than every valid lane's position)
// are masked.
template <int R>
void attend_heads(std::vector<LaneGroup>& groups, int64_t g, int64_t part, int64_t parts,
                  const float* keys, const float* values, int64_t s0, int64_t n, int64_t dim,
                  __m256 scale) {
    Pass<R> pass;
    for (int r = 0; r < R; r++) pass.lg[r] = &groups[(g + r) * parts + part];
    const int64_t n8 = (n + 7) / 8 * 8;
    __m256 st[R][kBlockK];
    scores(pass, keys, n8, dim, scale, st);
    alignas(32) float p[R][kBlockK * kLanes];
    __m256 alpha[R];
    for (int r = 0; r < R; r++) alpha[r] = softmax_block(*pass.lg[r], st[r], s0, n8, p[r]);
    add_values(pass, p, alpha, values, n8, dim);
}

// Heads a pass takes from the `left` of a KV head's query heads not yet taken: three, but
// two and two of four (not three and one).
inline int heads_of_pass(int64_t left) {
    return left == 4 ? 2 : (int)std::min<int64_t>(kPassHeads, left);
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
        for (int64_t part = 0; part < parts; part++) {
            const int64_t part_end = groups[part].key_end;  // every head's lane group alike
            if (s0 >= part_end) continue;
            const int64_t visible = std::min(n, part_end - s0);
            for (int64_t g = 0; g < group;) {
                const int heads = heads_of_pass(group - g);
                if (heads == 3)
                    attend_heads<3>(groups, g, part, parts, keys, values, s0, visible, dim, vscale);
                else if (heads == 2)
                    attend_heads<2>(groups, g, part, parts, keys, values, s0, visible, dim, vscale);
                else
                    attend_heads<1>(groups, g, part, parts, keys, values, s0, visible, dim, vscale);
                g += heads;
            }
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
