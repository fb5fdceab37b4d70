// The AMX tile configuration the project's AMX kernels load (bf16_linear_amx.cpp,
// decode_attention_avx512.cpp and extend_attention_avx512.cpp built with AMX): palette 1,
// each tile's rows and bytes per row set by the kernel. The kernels' digest covers this
// file too (cpu_kernels.py).
#pragma once
#include <stdint.h>

#ifdef __AMX_BF16__
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
#endif
