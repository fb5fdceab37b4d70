// How the decode-attention kernels (decode_attention.cpp, decode_attention_avx512.cpp) cut a
// batch's one-token rows into the pieces a task attends together. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace decode_pieces {

// Runs of consecutive rows of one request (the same table row, lengths not decreasing: a
// decode step's token and its drafted tokens, verified in one pass) of at most max_rows,
// never under a sliding window; then the pieces with most rows halved while pieces x KV
// heads leave a thread without two tasks (one request's verified draft must still keep
// every thread busy). (first row, rows) each.
inline std::vector<std::pair<int64_t, int64_t>> of(const int64_t* rows, const int64_t* seq_lens,
                                                   int64_t batch, int64_t window,
                                                   int64_t max_rows, int64_t kv_heads,
                                                   int64_t threads) {
    std::vector<std::pair<int64_t, int64_t>> pieces;
    for (int64_t b = 0; b < batch; b++) {
        if (!pieces.empty()) {
            auto& last = pieces.back();
            const int64_t prev = last.first + last.second - 1;
            if (window == 0 && last.second < max_rows && rows[b] == rows[prev] &&
                seq_lens[b] >= seq_lens[prev]) {
                last.second++;
                continue;
            }
        }
        pieces.push_back({b, 1});
    }
    while ((int64_t)pieces.size() * kv_heads < 2 * threads) {
        auto most = std::max_element(pieces.begin(), pieces.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
        if (most->second < 2) break;
        const int64_t half = most->second / 2;
        const std::pair<int64_t, int64_t> rest{most->first + half, most->second - half};
        most->second = half;
        pieces.insert(most + 1, rest);
    }
    return pieces;
}

}  // namespace decode_pieces
