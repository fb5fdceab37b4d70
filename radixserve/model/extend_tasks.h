// The work list shared by the extend-attention builds (extend_attention.cpp,
// extend_attention_avx512.cpp): plain C++, no vector instructions. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace extend {

constexpr int64_t kBlockQ = 32;  // new tokens per task

// One task: request b's KV head kh for its new tokens [t0, t0 + kBlockQ); cost, the keys
// its last token attends.
struct Task {
    int64_t b, kh, t0, cost;
};

// Every task of the batch, costliest first (so that dynamically scheduled threads end
// together); q_starts[b], the row of q where request b's new tokens begin.
inline std::vector<Task> tasks_of(int64_t batch, int64_t kv_heads, const int64_t* prefix_lens,
                                  const int64_t* extend_lens, std::vector<int64_t>& q_starts) {
    std::vector<Task> tasks;
    q_starts.assign(batch, 0);
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
    return tasks;
}

}  // namespace extend
