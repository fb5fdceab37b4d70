// How the linear kernels (bf16_linear_amx.cpp, fp32_linear_avx512.cpp) share out a product's
// blocks of 16 output features among the threads of a parallel region. The kernels' digest
// covers this file too (cpu_kernels.py).
#pragma once
#include <omp.h>
#include <stdint.h>

namespace linear_groups {

// Inside a parallel region: body(first block, count) for each group of consecutive blocks
// this thread takes, up to `size` blocks a group, fewer where that would leave a thread
// without work; each thread's groups are consecutive (one stretch of the weights).
template <typename Body>
inline void this_threads(int64_t blocks, int64_t size, Body body) {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per_thread = (blocks + threads - 1) / threads;
    if (per_thread < size) size = per_thread < 1 ? 1 : per_thread;
    const int64_t groups = (blocks + size - 1) / size;
    for (int64_t g = groups * id / threads; g < groups * (id + 1) / threads; g++) {
        const int64_t b = g * size;
        body(b, blocks - b < size ? blocks - b : size);
    }
}

}  // namespace linear_groups
