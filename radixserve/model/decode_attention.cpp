// Decode attention over the KV pool for x86 CPUs with AVX2 + FMA, built and loaded by
// cpu_kernels.py.
//
//   out[b, h] = softmax_s(q[b, h] . K[slot(b, s), h / G] * scale) . V[slot(b, s), h / G]
//
// for each request b of a decode batch (one query token each), its positions
// s < seq_len[b], slot(b, s) = req_to_token[row[b], s], and G = heads / kv_heads query
// heads per KV head (GQA). K and V are read where they lie in the pool: no gathered copy of
// the batch's keys and values, no padding to the longest request, no mask. The torch path
// (index_select into a padded batch, then SDPA) spent 30% of a batch-64 decode step on this.
//
// One task per (request, KV head): its G query heads share every K and V row read.
// Arithmetic in fp32; the softmax subtracts the row maximum like every reference does.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
    int64_t i = 0;
    __m256 vp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += p * x[i];
}

}  // namespace

extern "C" {

// q, out: (B, H, D); k_pool, v_pool: (slots, KH, D); table: (rows, table_stride) int64;
// rows, seq_lens: (B,) int64. Every tensor contiguous fp32 / int64.
void decode_attention(const float* q, const float* k_pool, const float* v_pool,
                      const int64_t* table, const int64_t* rows, const int64_t* seq_lens,
                      float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t table_stride, float scale, int num_threads) {
    const int64_t group = heads / kv_heads;
    const int64_t tasks = batch * kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores;  // (G, S) of the current task
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / kv_heads, kh = task % kv_heads;
            const int64_t len = seq_lens[b];
            const int64_t* slots = table + rows[b] * table_stride;
            const float* qb = q + (b * heads + kh * group) * dim;
            float* ob = out + (b * heads + kh * group) * dim;
            scores.resize(group * len);
            for (int64_t s = 0; s < len; s++) {
                const float* k = k_pool + (slots[s] * kv_heads + kh) * dim;
                for (int64_t g = 0; g < group; g++) scores[g * len + s] = dot(qb + g * dim, k, dim) * scale;
            }
            for (int64_t g = 0; g < group; g++) {
                float* row = scores.data() + g * len;
                float peak = -INFINITY;
                for (int64_t s = 0; s < len; s++) peak = row[s] > peak ? row[s] : peak;
                float total = 0.f;
                for (int64_t s = 0; s < len; s++) {
                    row[s] = expf(row[s] - peak);
                    total += row[s];
                }
                const float inv = 1.f / total;
                for (int64_t s = 0; s < len; s++) row[s] *= inv;
                for (int64_t d = 0; d < dim; d++) ob[g * dim + d] = 0.f;
            }
            for (int64_t s = 0; s < len; s++) {
                const float* v = v_pool + (slots[s] * kv_heads + kh) * dim;
                for (int64_t g = 0; g < group; g++) axpy(scores[g * len + s], v, ob + g * dim, dim);
            }
        }
    }
}

}  // extern "C"
