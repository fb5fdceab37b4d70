// How the linear kernels (bf16_linear_amx.cpp, fp32_linear.cpp) share out a product's
// blocks of 16 output features among the threads of a parallel region. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <omp.h>
#include <stdint.h>

#include <type_traits>

namespace linear_groups {

// Inside a parallel region: body(first block, count) for each group of consecutive blocks
// this thread takes, up to `size` blocks a group, fewer where that would leave a thread
// without work; each thread's groups are consecutive (one stretch of the weights). A body
// taking a third argument gets the blocks of this thread's next group there (0 after its
// last), which it may fetch ahead.
template <typename Body>
inline void this_threads(int64_t blocks, int64_t size, Body body) {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per_thread = (blocks + threads - 1) / threads;
    if (per_thread < size) size = per_thread < 1 ? 1 : per_thread;
    const int64_t groups = (blocks + size - 1) / size;
    const int64_t end = groups * (id + 1) / threads;
    auto count_of = [&](int64_t g) { return blocks - g * size < size ? blocks - g * size : size; };
    for (int64_t g = groups * id / threads; g < end; g++) {
        if constexpr (std::is_invocable_v<Body, int64_t, int64_t, int64_t>)
            body(g * size, count_of(g), g + 1 < end ? count_of(g + 1) : 0);
        else
            body(g * size, count_of(g));
    }
}

}  // namespace linear_groups
