// bf16 linear layers of few rows (decode steps) on Intel AMX:
//
//   out (m, n) bf16 = x (m, k) bf16 @ W.T + bias,  W (n, k) bf16, bias fp32 or none
//
// Decode steps are bound by reading the weights from memory: each step streams every
// weight once for a handful of rows. oneDNN's AMX kernels, given the same pre-blocked
// weights, read them at ~15 GB/s on 2 cores in a decode step of SmolLM2; this kernel lays
// each weight out once (`bf16_amx_pack`) as the AMX B tiles it consumes, in the order it
// consumes them, so a product is a few sequential streams (~24 GB/s measured; see
// radixserve/hardware.py AMX_LINEAR).
//
// Layout: W is cut into blocks of 16 output features; a block is k / 32 tiles of 16 rows
// x 32 bf16 (1 KiB), tile j holding, in row p and pair c, W[16 b + c][32 j + 2 p + {0, 1}]
// (the pairs `_tile_dpbf16ps` multiplies with a row of x's 32-column slice j). Blocks are
// stored one after the other, each a contiguous k * 32 bytes.
//
// Compute: each thread takes whole groups of up to 4 blocks (4 accumulator tiles, one A
// tile for x's slice, two B tiles loaded in turn), all of x's rows in chunks of 16 rows
// (past 16 rows, a partial last chunk read from a zero-padded copy), the fp32 sums rounded
// to bf16 (round to nearest even, as torch rounds) after the bias is added in fp32. The
// products are exact bf16 x bf16 summed in fp32: the same arithmetic as oneDNN's, in
// another order. A SiLU MLP's gate/up product can come out as its activation instead
// (`bf16_amx_linear_silu_mul`, AMX build only).
//
// The kernel needs the tile data permission from Linux (arch_prctl ARCH_REQ_XCOMP_PERM;
// `bf16_amx_enable`, called once before any product), AMX-TILE, AMX-BF16 and AVX512-BF16.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "amx_tiles.h"
#include "linear_groups.h"
#include "simd_avx512.h"

namespace {

constexpr int64_t kTile = 16 * 32;  // bf16 elements of one B tile (16 rows of 64 bytes)
constexpr int kGroup = 4;           // output blocks per group: the accumulator tiles
// Products of 32 rows or more take groups of up to 6 blocks (three 32 x 32 products per
// 32-row chunk of x, which stays in cache for them), so that SmolLM2's products of 12, 36
// and 192 blocks split evenly over two threads (groups of 4: k and v's 12 blocks went 4 and
// 8). The same bits. Intel Xeon (AMX), 2 threads, SmolLM2's 30 layers of distinct weights at
// 1,024 rows, the kernel alone, ms (medians of 7): q 10.5 -> 9.9, k 4.7 -> 3.9, v 4.2 ->
// 3.5, o 9.7 -> 9.1, down 31.8 -> 27.9, gate/up 50.5 alike; all six 111.4 -> 104.7 (groups
// of 8: 106.7, of 2: down 34.9, its x chunk read once per pair of blocks).
constexpr int kWideGroup = 6;

#ifdef __AMX_BF16__
// Tiles 0..3: accumulators (rows x 16 fp32); 4: x's slice (rows x 32 bf16); 5, 6: W's
// tiles (16 pairs x 16 features).
void configure(int rows) {
    TileConfig cfg;
    for (int t = 0; t < 5; t++) cfg.rows[t] = rows, cfg.colsb[t] = 64;
    for (int t = 5; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// Products of 32 rows or more (prefill chunks, large mixed steps) go 32 rows x 2 blocks at a
// time: per slice of x two A tiles and two B tiles feed four tile products (tiles 0-3 the
// sums, 4-5 x's two 16-row chunks, 6-7 the blocks), half the tile loads per product of the
// 16-row path, whose B tile waits for the product before it to be loaded again. Each sum
// takes the same products in the same order as there: the same bits. Intel Xeon (AMX), 2
// threads, bf16 prefill forwards of SmolLM2 (the products of up to 1,024 rows through the
// kernel), medians of 5, ms: 1 x 544 tokens 109-110 -> 105, 2 x 512 203-206 -> 201-202;
// through the kernel whatever the rows: 2 x 544 234 -> 232, 4 x 512 463 -> 440 (oneDNN 351-365
// there). The kernel alone, weights in cache, 1,024 rows: ~2.0-2.1 TFLOP/s on SmolLM2's
// shapes (oneDNN on the plain weight 1.2-2.6).
template <typename Between>
inline void accumulate2x2(const uint16_t* x, int64_t ldx, const uint16_t* w0, const uint16_t* w1,
                          int64_t slices, Between between) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* x1 = x + 16 * ldx;
    for (int64_t j = 0; j < slices; j++) {
        _tile_loadd(4, x + j * 32, ldx * 2);
        _tile_loadd(6, w0 + j * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + j * kTile, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x1 + j * 32, ldx * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        between(j);
    }
}

// The four tiles of a 32-row x 2-block product, stored (rows 0-15 of the two blocks at 0 and
// 256, rows 16-31 at 512 and 768), waiting to go out a few rows at a time while the next
// product's tile instructions run: the vector work of rounding (and of the activation) then
// overlaps the tile unit's instead of following it (figures: radixserve/hardware.py
// AMX_ROWS).
// Act: false, the two blocks + bias rounded to bf16 (one 64-byte row of out per row); true,
// bf16(silu(g)) * u of a gate block g and its up block u (group_silu_mul).
template <bool Act>
struct Pending {
    static constexpr int64_t kRows = 32;
    float* tiles;                  // 4 x 256 fp32, 64-byte aligned
    uint16_t* out = nullptr;       // row 0 of the block's output
    int64_t ldo = 0;
    const float* bias = nullptr;   // 32 fp32 (Act: none)
    int64_t done = kRows;          // rows written (kRows: none waiting)

    void advance(int64_t upto) {
        for (; done < upto && done < kRows; done++) {
            const float* lo = tiles + done / 16 * 512 + done % 16 * 16;
            write(lo, lo + 256, out + done * ldo);
        }
    }
    void finish() { advance(kRows); }
    // tiles 0-3 in, to go to out (ldo apart) with bias; the previous ones must be out
    void stash(uint16_t* o, int64_t ld, const float* b) {
        _tile_stored(0, tiles, 64);
        _tile_stored(1, tiles + 256, 64);
        _tile_stored(2, tiles + 512, 64);
        _tile_stored(3, tiles + 768, 64);
        out = o, ldo = ld, bias = b, done = 0;
    }

    void write(const float* lo, const float* hi, uint16_t* o) const {
        const __m512 zero = _mm512_setzero_ps();
        if constexpr (Act) {
            // + 0: the plain product's sums with no bias (the same zeros' signs)
            const __m512 g = simd512::round_bf16(_mm512_add_ps(_mm512_load_ps(lo), zero));
            const __m512 u = simd512::round_bf16(_mm512_add_ps(_mm512_load_ps(hi), zero));
            const __m512 act = simd512::round_bf16(_mm512_div_ps(
                g, _mm512_add_ps(_mm512_set1_ps(1.0f), simd512::exp16_torch(_mm512_sub_ps(zero, g)))));
            simd512::store_bf16(o, _mm512_mul_ps(act, u));
        } else {
            const __m512 v0 = _mm512_add_ps(_mm512_load_ps(lo), bias ? _mm512_loadu_ps(bias) : zero);
            const __m512 v1 = _mm512_add_ps(_mm512_load_ps(hi), bias ? _mm512_loadu_ps(bias + 16) : zero);
            _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        }
    }
};

// One 32-row x 2-block product into tiles 0-3, the waiting block's rows written 2 per slice
// of x meanwhile (all of them by its end), then this one left waiting in its place.
template <bool Act>
inline void product2x2(Pending<Act>& pending, const uint16_t* x, int64_t ldx, const uint16_t* w0,
                       const uint16_t* w1, int64_t slices, uint16_t* out, int64_t ldo,
                       const float* bias) {
    accumulate2x2(x, ldx, w0, w1, slices, [&](int64_t j) { pending.advance(2 * (j + 1)); });
    pending.finish();
    pending.stash(out, ldo, bias);
}

// The sums of `count` blocks (starting at w, `stride` elements apart) for one chunk of
// x's rows (x: its first row; ldx: elements per row), into tiles 0..count-1.
template <int count>
inline void accumulate(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t stride,
                       int64_t slices) {
    _tile_zero(0);
    if constexpr (count > 1) _tile_zero(1);
    if constexpr (count > 2) _tile_zero(2);
    if constexpr (count > 3) _tile_zero(3);
    for (int64_t j = 0; j < slices; j++, w += kTile) {
        _tile_loadd(4, x + j * 32, ldx * 2);
        _tile_loadd(5, w, 64);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (count > 1) {
            _tile_loadd(6, w + stride, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if constexpr (count > 2) {
            _tile_loadd(5, w + 2 * stride, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if constexpr (count > 3) {
            _tile_loadd(6, w + 3 * stride, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
}

// The rows of a tile stored in scratch (16 fp32 each) + bias, rounded to bf16, into out's
// rows (ldo apart). (The tile intrinsics take their tile number as a literal.)
inline void store(const float* scratch, int64_t rows, const float* bias, uint16_t* out,
                  int64_t ldo) {
    __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(scratch + r * 16), b);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
}

// Rows [first, m) of x, 16 at a time, against `count` (<= 4) blocks: tiles 0..count-1.
// tail: x's last, partial chunk of rows zero-padded to 16 (null where none is read past m).
template <int count>
void rows16(const uint16_t* x, const uint16_t* tail, int64_t first, int64_t m, int64_t k,
            const uint16_t* w, int64_t stride, const float* bias, uint16_t* out, int64_t n,
            float* scratch) {
    for (int64_t r0 = first; r0 < m; r0 += 16) {
        int64_t rows = m - r0 < 16 ? m - r0 : 16;
        const uint16_t* chunk = tail && rows < 16 ? tail : x + r0 * k;
        accumulate<count>(chunk, k, w, stride, k / 32);
        uint16_t* o = out + r0 * n;
        _tile_stored(0, scratch, 64);
        store(scratch, rows, bias, o, n);
        if constexpr (count > 1) {
            _tile_stored(1, scratch, 64);
            store(scratch, rows, bias ? bias + 16 : nullptr, o + 16, n);
        }
        if constexpr (count > 2) {
            _tile_stored(2, scratch, 64);
            store(scratch, rows, bias ? bias + 32 : nullptr, o + 32, n);
        }
        if constexpr (count > 3) {
            _tile_stored(3, scratch, 64);
            store(scratch, rows, bias ? bias + 48 : nullptr, o + 48, n);
        }
    }
}

// All of x's rows against `count` consecutive blocks (up to kWideGroup): 32 rows x 2 blocks
// at a time while 32 rows remain (an odd last block 16 rows at a time), then the rest 16
// at a time, 4 blocks at once.
template <int count>
void group(const uint16_t* x, const uint16_t* tail, int64_t m, int64_t k, const uint16_t* w,
           int64_t stride, const float* bias, uint16_t* out, int64_t n, float* scratch) {
    int64_t first = 0;  // rows before it went 32 at a time
    if constexpr (count > 1) {
        Pending<false> pending{scratch + 256};
        for (; first + 32 <= m; first += 32) {
            for (int c = 0; c + 1 < count; c += 2)
                product2x2(pending, x + first * k, k, w + c * stride, w + (c + 1) * stride, k / 32,
                           out + first * n + c * 16, n, bias ? bias + c * 16 : nullptr);
            if constexpr (count % 2) {  // the group's last block, alone
                for (int64_t r0 = first; r0 < first + 32; r0 += 16) {
                    accumulate<1>(x + r0 * k, k, w + (count - 1) * stride, stride, k / 32);
                    _tile_stored(0, scratch, 64);
                    store(scratch, 16, bias ? bias + (count - 1) * 16 : nullptr,
                          out + r0 * n + (count - 1) * 16, n);
                }
            }
        }
        pending.finish();
    }
    if constexpr (count > 4) {
        rows16<4>(x, tail, first, m, k, w, stride, bias, out, n, scratch);
        rows16<count - 4>(x, tail, first, m, k, w + 4 * stride, stride, bias ? bias + 64 : nullptr,
                          out + 64, n, scratch);
    } else {
        rows16<count>(x, tail, first, m, k, w, stride, bias, out, n, scratch);
    }
}

// The gate/up product of a SiLU MLP with its activation in the epilogue: out (m, n) =
// bf16(bf16(silu(g)) * u) for g, u the bf16 products of x with the [gate | up] weight's two
// halves (packed as one weight of 2n features: gate's blocks, then up's). Each row of a
// block of gate features and the same block of up's rounded to bf16 as the plain kernel
// stores them, then silu and the product as fused_ops.cpp's silu_mul computes them (torch's
// e^x and rounding): the bits of the plain product followed by silu_mul, without writing the
// 2n-wide product to memory and reading it back. `count` pairs of blocks (gate block i at w
// + i * stride, its up block `half` elements further), all of x's rows: 32 at a time (gate
// and up as product2x2's two blocks), the rest 16 at a time (figures: radixserve/hardware.py
// AMX_ROWS).
void group_silu_mul(const uint16_t* x, const uint16_t* tail, int64_t m, int64_t k,
                    const uint16_t* w, int64_t stride, int64_t half, int64_t count,
                    uint16_t* out, int64_t n, float* scratch) {
    Pending<true> pending{scratch};
    int64_t first = 0;
    for (; first + 32 <= m; first += 32)
        for (int64_t c = 0; c < count; c++)
            product2x2(pending, x + first * k, k, w + c * stride, w + c * stride + half, k / 32,
                       out + first * n + c * 16, n, nullptr);
    pending.finish();
    for (int64_t r0 = first; r0 < m; r0 += 16) {
        const int64_t rows = m - r0 < 16 ? m - r0 : 16;
        const uint16_t* chunk = tail && rows < 16 ? tail : x + r0 * k;
        for (int64_t c = 0; c < count; c++) {
            accumulate<2>(chunk, k, w + c * stride, half, k / 32);
            _tile_stored(0, scratch, 64);
            _tile_stored(1, scratch + 256, 64);
            for (int64_t r = 0; r < rows; r++)
                pending.write(scratch + r * 16, scratch + 256 + r * 16, out + (r0 + r) * n + c * 16);
        }
    }
}

#else
// The AVX512-BF16 build (no AMX): the same layout read a 64-byte row at a time, which is
// what vdpbf16ps takes: row kp of a block holds the 16 features' pair of columns 2 kp, 2 kp
// + 1, so one instruction adds a row of x's pair (broadcast) times it into 16 sums, one
// register per row of x and block, no horizontal sums. Up to kRows rows of x at a time
// against a group's blocks (kRows x kGroup accumulators), the group's weights re-read from
// cache for the next rows.
constexpr int kRows = 6;

template <int count, int rows>
void rows_times_group(const uint16_t* x, int64_t k, const uint16_t* w, int64_t stride,
                      const float* bias, uint16_t* out, int64_t n) {
    __m512 acc[rows][count];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < count; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < k / 2; kp++) {
        __m512bh wv[count];
        for (int c = 0; c < count; c++)
            wv[c] = (__m512bh)_mm512_loadu_si512(w + c * stride + kp * 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(
                *reinterpret_cast<const int32_t*>(x + r * k + 2 * kp));
            for (int c = 0; c < count; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int c = 0; c < count; c++) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + c * 16),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], b))));
    }
}

template <int count>
void group(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t stride,
           const float* bias, uint16_t* out, int64_t n) {
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const uint16_t* xr = x + r0 * k;
        uint16_t* o = out + r0 * n;
        switch (m - r0 < kRows ? m - r0 : kRows) {
            case 1: rows_times_group<count, 1>(xr, k, w, stride, bias, o, n); break;
            case 2: rows_times_group<count, 2>(xr, k, w, stride, bias, o, n); break;
            case 3: rows_times_group<count, 3>(xr, k, w, stride, bias, o, n); break;
            case 4: rows_times_group<count, 4>(xr, k, w, stride, bias, o, n); break;
            case 5: rows_times_group<count, 5>(xr, k, w, stride, bias, o, n); break;
            default: rows_times_group<count, 6>(xr, k, w, stride, bias, o, n); break;
        }
    }
}

#endif

}  // namespace

#ifdef __AMX_BF16__
extern "C" int bf16_amx_enable() {
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#else
extern "C" int bf16_amx_enable() { return 1; }  // no tile state to ask for
#endif

// W (n, k) → the tile layout above; n a multiple of 16, k of 32.
extern "C" void bf16_amx_pack(const uint16_t* w, uint16_t* out, int64_t n, int64_t k) {
    const int64_t slices = k / 32;
#pragma omp parallel for
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t j = 0; j < slices; j++) {
            uint16_t* tile = out + (b * slices + j) * kTile;
            for (int64_t p = 0; p < 16; p++)
                for (int64_t c = 0; c < 16; c++) {
                    const uint16_t* src = w + (b * 16 + c) * k + j * 32 + 2 * p;
                    tile[p * 32 + c * 2] = src[0];
                    tile[p * 32 + c * 2 + 1] = src[1];
                }
        }
}

#ifdef __AMX_BF16__
namespace {
// Past 16 rows x is read in chunks of 16 rows: its partial last chunk as a zero-padded copy
// (the calling thread's, kept from call to call), or null where m needs none.
const uint16_t* padded_tail(const uint16_t* x, int64_t m, int64_t k) {
    static thread_local std::vector<uint16_t> padded;
    if (m <= 16 || m % 16 == 0) return nullptr;
    const int64_t last = m / 16 * 16;
    padded.assign(16 * k, 0);
    memcpy(padded.data(), x + last * k, (m - last) * k * sizeof(uint16_t));
    return padded.data();
}
}  // namespace

// out (m, n) = x (m, k) @ W.T + bias; x contiguous, n a multiple of 16, k of 32; bias (n,)
// fp32 or null.
extern "C" void bf16_amx_linear(const uint16_t* x, const uint16_t* packed, const float* bias,
                                uint16_t* out, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = n / 16, stride = k / 32 * kTile;
    const uint16_t* tail = padded_tail(x, m, k);
#pragma omp parallel num_threads(threads)
    {
        configure(m < 16 ? static_cast<int>(m) : 16);
        alignas(64) float scratch[5 * 16 * 16];  // a tile's rows, then Pending's four tiles
        linear_groups::this_threads(blocks, m >= 32 ? kWideGroup : kGroup, [&](int64_t b, int64_t count) {
            const uint16_t* w = packed + b * stride;
            const float* gb = bias ? bias + b * 16 : nullptr;
            uint16_t* o = out + b * 16;
            switch (count) {
                case 1: group<1>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
                case 2: group<2>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
                case 3: group<3>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
                case 4: group<4>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
                case 5: group<5>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
                default: group<kWideGroup>(x, tail, m, k, w, stride, gb, o, n, scratch); break;
            }
        });
        _tile_release();
    }
}

// out (m, n) = silu(x @ gate.T) * (x @ up.T) as described at group_silu_mul, for `packed`
// the [gate | up] weight (2n, k) in the layout above, no bias (the argument is there for the
// linear kernels' signature: it must be null); n a multiple of 16, k of 32.
extern "C" void bf16_amx_linear_silu_mul(const uint16_t* x, const uint16_t* packed,
                                         const float* bias, uint16_t* out, int64_t m, int64_t n,
                                         int64_t k, int threads) {
    (void)bias;
    const int64_t stride = k / 32 * kTile, half = n / 16 * stride;
    const uint16_t* tail = padded_tail(x, m, k);
#pragma omp parallel num_threads(threads)
    {
        configure(m < 16 ? static_cast<int>(m) : 16);
        alignas(64) float scratch[4 * 16 * 16];
        // pairs of blocks per group: past 32 rows 4, x's 32-row chunk serving more of them
        // from cache (SmolLM2's gate/up at 1,024 rows, 30 layers: 52.3 -> 50.9 ms; 3: 51.4)
        linear_groups::this_threads(n / 16, m >= 32 ? 4 : kGroup / 2, [&](int64_t b, int64_t count) {
            group_silu_mul(x, tail, m, k, packed + b * stride, stride, half, count, out + b * 16, n,
                           scratch);
        });
        _tile_release();
    }
}
#else
extern "C" void bf16_amx_linear(const uint16_t* x, const uint16_t* packed, const float* bias,
                                uint16_t* out, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = n / 16, stride = k / 32 * kTile;
#pragma omp parallel num_threads(threads)
    linear_groups::this_threads(blocks, kGroup, [&](int64_t b, int64_t count) {
        const uint16_t* w = packed + b * stride;
        const float* gb = bias ? bias + b * 16 : nullptr;
        uint16_t* o = out + b * 16;
        switch (count) {
            case 1: group<1>(x, m, k, w, stride, gb, o, n); break;
            case 2: group<2>(x, m, k, w, stride, gb, o, n); break;
            case 3: group<3>(x, m, k, w, stride, gb, o, n); break;
            default: group<4>(x, m, k, w, stride, gb, o, n); break;
        }
    });
}
#endif
