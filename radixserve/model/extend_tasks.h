// The work list shared by the extend-attention builds (extend_attention.cpp,
// extend_attention_avx512.cpp): plain C++, no vector instructions. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace extend {

constexpr int64_t kBlockQ = 32;  // new tokens per task (at most)

// One task: request b's KV head kh for its new tokens [t0, t0 + n); cost, the keys its last
// token attends.
struct Task {
    int64_t b, kh, t0, n, cost;
};

// New tokens per task: kBlockQ, or half of it where a batch of fewer tasks than two per
// thread would leave a thread idle for its last round. The shared-prefix workload's mixed
// steps extend one request by a 32-token question after a 512-token cached prefix: 3 tasks
// (SmolLM2's KV heads) on 2 threads ran in two rounds, one of them on one thread; as 6 tasks
// of 16 tokens they run in three rounds of half the work each: that kernel call 318-342 ->
// 281-297 us (AMD EPYC Zen 4, AVX-512 fp32 build, SmolLM2's heads; 2 and 3 such requests,
// 6 and 9 tasks, unchanged). Each query's arithmetic is the same either way (its lane
// group attends the same key blocks), so the output is too.
// A build may take longer blocks, up to `max_block` (halving from it), where the batch still
// makes four tasks per thread at that size: each key block is then copied once for more
// queries (extend_attention_avx512.cpp, whose figures are there).
inline int64_t block_of(int64_t batch, int64_t kv_heads, const int64_t* extend_lens,
                        int64_t threads, int64_t max_block) {
    auto tasks_of_size = [&](int64_t block) {
        int64_t tasks = 0;
        for (int64_t b = 0; b < batch; b++) tasks += (extend_lens[b] + block - 1) / block * kv_heads;
        return tasks;
    };
    for (int64_t block = max_block; block > kBlockQ; block /= 2)
        if (tasks_of_size(block) >= 4 * threads) return block;
    const int64_t tasks = tasks_of_size(kBlockQ);
    const bool uneven = threads > 1 && tasks < 2 * threads && tasks % threads != 0;
    return uneven ? kBlockQ / 2 : kBlockQ;
}

// Every task of the batch, costliest first (so that dynamically scheduled threads end
// together); q_starts[b], the row of q where request b's new tokens begin.
inline std::vector<Task> tasks_of(int64_t batch, int64_t kv_heads, const int64_t* prefix_lens,
                                  const int64_t* extend_lens, int64_t threads,
                                  std::vector<int64_t>& q_starts, int64_t max_block = kBlockQ) {
    const int64_t block = block_of(batch, kv_heads, extend_lens, threads, max_block);
    std::vector<Task> tasks;
    q_starts.assign(batch, 0);
    int64_t start = 0;
    for (int64_t b = 0; b < batch; b++) {
        q_starts[b] = start;
        start += extend_lens[b];
        for (int64_t t0 = 0; t0 < extend_lens[b]; t0 += block) {
            const int64_t n = std::min(block, extend_lens[b] - t0);
            for (int64_t kh = 0; kh < kv_heads; kh++)
                tasks.push_back({b, kh, t0, n, prefix_lens[b] + t0 + n});
        }
    }
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const Task& x, const Task& y) { return x.cost > y.cost; });
    return tasks;
}

}  // namespace extend
