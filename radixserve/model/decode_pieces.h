// How the decode-attention kernels (decode_attention.cpp, decode_attention_avx512.cpp) cut a
// batch's one-token rows into the pieces a task attends together. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace decode_pieces {

// A piece: the rows order[first .. first + rows) of a plan, by increasing length, attended by
// one task; below `shared` (and below its own length) every row reads the slots of the
// piece's longest row.
struct Piece {
    int64_t first, rows, shared;
};

struct Plan {
    std::vector<int64_t> order;  // batch rows, each piece's consecutive
    std::vector<Piece> pieces;
};

// Leading positions where table rows a and b hold the same slots, below `len`.
inline int64_t same_slots(const int64_t* a, const int64_t* b, int64_t len) {
    if (a == b) return len;
    int64_t s = 0;
    while (s < len && a[s] == b[s]) s++;
    return s;
}

// The batch cut into pieces of at most max_rows rows, never under a sliding window:
// - runs of rows of one request (the same table row, lengths not decreasing: a decode
//   step's token and its drafted tokens, verified in one pass);
// - rows of different requests whose first min_shared slots are the same (a prefix cached
//   once: the requests of one system prompt) too, so that its K and V are read once for
//   all their queries: rows of min_shared positions or more are sorted by their first slot
//   (a request's own rows keep their order), the shorter ones after them, then matched on
//   their first min_shared slots; a piece's `shared` is then the prefix every row holds in
//   common with its longest row. Per call: a sort of the batch and one pass over each
//   grouped row's slots. A run of rows that may go together is cut into pieces of about
//   equal size.
// Then the pieces with most rows are halved while pieces x KV heads leave a thread without
// two tasks (one request's verified draft must still keep every thread busy).
inline Plan plan(const int64_t* table, int64_t table_stride, const int64_t* rows,
                 const int64_t* seq_lens, int64_t batch, int64_t window, int64_t max_rows,
                 int64_t kv_heads, int64_t threads, int64_t min_shared) {
    Plan plan;
    auto slots = [&](int64_t b) { return table + rows[b] * table_stride; };
    plan.order.resize(batch);
    for (int64_t b = 0; b < batch; b++) plan.order[b] = b;
    const bool grouping = window == 0 && max_rows > 1;
    if (grouping)  // rows that may share a prefix side by side
        std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t x, int64_t y) {
            const bool long_x = seq_lens[x] >= min_shared, long_y = seq_lens[y] >= min_shared;
            if (long_x != long_y) return long_x;
            return long_x && slots(x)[0] < slots(y)[0];
        });
    // rows [i, j) of the order as one piece: by increasing length, and what they share
    auto add_piece = [&](int64_t i, int64_t j) {
        const auto first = plan.order.begin() + i, last = plan.order.begin() + j;
        std::stable_sort(first, last, [&](int64_t x, int64_t y) { return seq_lens[x] < seq_lens[y]; });
        const int64_t longest = *(last - 1);
        int64_t shared = seq_lens[longest];
        for (auto it = first; it != last - 1; it++) {
            const int64_t len = seq_lens[*it];
            const int64_t same = same_slots(slots(*it), slots(longest), len);
            if (same < len) shared = std::min(shared, same);
        }
        plan.pieces.push_back({i, j - i, shared});
    };
    for (int64_t i = 0; i < batch;) {
        const int64_t head = plan.order[i];
        int64_t end = i + 1;  // the run of rows that may go with the head
        for (; grouping && end < batch; end++) {
            const int64_t b = plan.order[end], prev = plan.order[end - 1];
            if (rows[b] == rows[prev] && seq_lens[b] >= seq_lens[prev]) continue;  // its own
            const int64_t need = std::min(seq_lens[b], seq_lens[head]);
            if (need < min_shared || same_slots(slots(b), slots(head), min_shared) < min_shared)
                break;
        }
        // a run of more than max_rows: pieces of about equal size (16 rows of one prefix at
        // 5 a piece: 4, 4, 4, 4 rather than 5, 5, 5, 1, which leaves a thread idle)
        const int64_t run = end - i, count = (run + max_rows - 1) / max_rows;
        for (int64_t p = 0; p < count; p++) add_piece(i + run * p / count, i + run * (p + 1) / count);
        i = end;
    }
    while ((int64_t)plan.pieces.size() * kv_heads < 2 * threads) {
        auto most = std::max_element(plan.pieces.begin(), plan.pieces.end(),
                                     [](const Piece& a, const Piece& b) { return a.rows < b.rows; });
        if (most->rows < 2) break;
        const int64_t half = most->rows / 2;
        // the first half's longest row shares at least what every row shared with the
        // longest of all, below its own length
        const Piece rest{most->first + half, most->rows - half, most->shared};
        most->rows = half;
        most->shared = std::min(most->shared, seq_lens[plan.order[most->first + half - 1]]);
        plan.pieces.insert(most + 1, rest);
    }
    return plan;
}

}  // namespace decode_pieces
