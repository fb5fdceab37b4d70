// fp32 linear products of many rows (prefill chunks, large mixed steps) on Intel AMX, for
// weights that are GGUF codes dequantized (cpu_kernels.coded_runs finds them): in every run
// of 32 columns of a weight row, w = d * q + m for integer codes q (Q4_1: 0..15; Q8_0:
// -128..127, m = 0) and fp32 d, m.
//
//   out (m, n) fp32 = x (m, k) fp32 @ W.T + bias
//   out[r][f] = bias[f] + sum over runs j of ( d[f][j] * P[r][f][j] + m[f][j] * S[r][j] ),
//   P[r][f][j] = sum of x[r][c] * q[f][c] over run j's 32 columns c,  S[r][j] = sum of x[r][c]
//
// The codes are small integers, exact in bf16; x is split into three bf16 parts
// hi + mid + lo == x exactly (each the rounding of what the parts before it leave; fp32's 24
// significant bits fit in three of bf16's 8 plus sign), so every product a tile instruction
// forms (bf16 x bf16, exact in fp32) is exact, and P is x . q summed in fp32: products that
// an fp32 kernel would round, summed in fp32 in another order. What differs from fp32
// arithmetic on W is only the order of the sums and W's own rounding (w is d * q + m
// rounded; here d * q + m is not rounded). Three tile products per run of 32 columns instead
// of one fp32 FMA per column: AMX's bf16 tile rate is ~16x the cores' fp32 FMA rate, so this
// beats the best fp32 products (MKL, at the FMA peak) by the factor measured in
// radixserve/hardware.py CODED_AMX.
//
// Layout (cpu_kernels.CodedAmxLinear.pack): the codes as AMX B tiles, a block of 16 output
// features by one run a tile (16 rows x 32 bf16, row p pair c holding q[16 b + c][32 j + 2 p
// + {0, 1}]), a block's runs one after the other; beside them per block and run 16 d then
// 16 m (fp32). x goes through `fp32_amx_split` first: its three parts (3, mp, k) bf16 (mp: m
// rounded up to 16 rows, zeros past m) and its run sums S (mp, k / 32) fp32; a product of
// the same x by several weights (q, k and v) splits it once (CodedAmxLinear).
//
// Compute: per 128 rows of x, a thread takes a stretch of pairs of blocks (32 features), and
// per pair and 16 rows, per run: two accumulator tiles zeroed, the pair's two B tiles, each
// part's A tile (lo first: the small terms summed first) into both; the two sums stored and
// folded into fp32 row sums by d and m (`fold`) while the next run's products fill the other
// two accumulator tiles, so the vector unit's work overlaps the tile unit's. Intel Xeon
// (AMX), 2 threads, SmolLM2's 30 layers at 1,024 rows: four accumulators (32 rows x 2 blocks)
// stored, then folded before the next run's products could start, ran 436-468 ms; one 16 x 16
// accumulator held in registers (4 tile loads per 3 products) 478; this 393-396; with no fold
// at all 310 (MKL 692). Rows of x per pass over a thread's pairs (the same sums, whatever
// the rows), random codes: 128 385-410 ms, 64 369-379, 32 365-370, 16 375-382; on the real
// weights 32 against 128 was 376-389 vs 386-402 at 1,024 rows but 53 vs 49 at 128: kept 128.
//
// Needs AMX-TILE, AMX-BF16, AVX512-BF16 and the tile data permission from Linux (the bf16
// kernel's `bf16_amx_enable`, asked once per process).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "linear_groups.h"
#include "simd_avx512.h"

namespace {

constexpr int64_t kRun = 32;        // columns per run: one tile product's depth
constexpr int64_t kTile = 16 * 32;  // bf16 elements of one B tile
constexpr int64_t kRowBlock = 128;  // rows of x whose parts stay in cache across a thread's pairs

void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// One run of 16 rows x 2 blocks: tiles C0, C1 (0/1 or 2/3, alternate runs) the sums, 4/5 x's
// parts, 6/7 the codes. (The tile intrinsics take their tile numbers as literals: a macro.)
#define PRODUCTS(C0, C1, x, plane, ld, w0, w1)      \
    do {                                            \
        _tile_zero(C0);                             \
        _tile_zero(C1);                             \
        _tile_loadd(6, (w0), 64);                   \
        _tile_loadd(7, (w1), 64);                   \
        _tile_loadd(4, (x) + 2 * (plane), (ld));    \
        _tile_dpbf16ps(C0, 4, 6);                   \
        _tile_dpbf16ps(C1, 4, 7);                   \
        _tile_loadd(5, (x) + (plane), (ld));        \
        _tile_dpbf16ps(C0, 5, 6);                   \
        _tile_dpbf16ps(C1, 5, 7);                   \
        _tile_loadd(4, (x), (ld));                  \
        _tile_dpbf16ps(C0, 4, 6);                   \
        _tile_dpbf16ps(C1, 4, 7);                   \
    } while (0)

// One run's two stored tiles t (16 rows x 16 fp32 each) into acc (16 rows x 32): acc += d * P,
// then acc += m * S.
inline void fold(const float* t, const float* sc0, const float* sc1, const float* s, int64_t runs,
                   float* acc, bool has_min) {
    const __m512 d0 = _mm512_loadu_ps(sc0), d1 = _mm512_loadu_ps(sc1);
    const __m512 m0 = _mm512_loadu_ps(sc0 + 16), m1 = _mm512_loadu_ps(sc1 + 16);
    for (int r = 0; r < 16; r++) {
        float* a = acc + r * 32;
        __m512 a0 = _mm512_fmadd_ps(d0, _mm512_load_ps(t + r * 16), _mm512_load_ps(a));
        __m512 a1 = _mm512_fmadd_ps(d1, _mm512_load_ps(t + 256 + r * 16), _mm512_load_ps(a + 16));
        if (has_min) {
            const __m512 sr = _mm512_set1_ps(s[r * runs]);
            a0 = _mm512_fmadd_ps(m0, sr, a0);
            a1 = _mm512_fmadd_ps(m1, sr, a1);
        }
        _mm512_store_ps(a, a0);
        _mm512_store_ps(a + 16, a1);
    }
}

// 16 rows of x (its hi part; mid and lo `plane` elements further), sums their run sums, by
// blocks w and w + stride (codes), sc their scales: rows of the 32 features into o.
void pair16(const uint16_t* x, int64_t plane, int64_t k, const float* sums, const uint16_t* w,
            int64_t stride, const float* sc, int64_t runs, const float* bias, float* o, int64_t ldo,
            int64_t rows, bool has_min, float* tiles, float* acc) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : zero, b1 = bias ? _mm512_loadu_ps(bias + 16) : zero;
    for (int64_t r = 0; r < 16; r++) {
        _mm512_store_ps(acc + r * 32, b0);
        _mm512_store_ps(acc + r * 32 + 16, b1);
    }
    const uint16_t* w1 = w + stride;
    const float* sc1 = sc + runs * 32;
    const int64_t ld = k * 2;
    for (int64_t j = 0; j < runs; j += 2) {
        PRODUCTS(0, 1, x + j * kRun, plane, ld, w + j * kTile, w1 + j * kTile);
        if (j > 0) {
            _tile_stored(2, tiles + 512, 64);
            _tile_stored(3, tiles + 768, 64);
            fold(tiles + 512, sc + (j - 1) * 32, sc1 + (j - 1) * 32, sums + j - 1, runs, acc, has_min);
        }
        if (j + 1 < runs)
            PRODUCTS(2, 3, x + (j + 1) * kRun, plane, ld, w + (j + 1) * kTile, w1 + (j + 1) * kTile);
        _tile_stored(0, tiles, 64);
        _tile_stored(1, tiles + 256, 64);
        fold(tiles, sc + j * 32, sc1 + j * 32, sums + j, runs, acc, has_min);
    }
    if (runs % 2 == 0) {
        _tile_stored(2, tiles + 512, 64);
        _tile_stored(3, tiles + 768, 64);
        fold(tiles + 512, sc + (runs - 1) * 32, sc1 + (runs - 1) * 32, sums + runs - 1, runs, acc, has_min);
    }
    for (int64_t r = 0; r < rows; r++) {
        _mm512_storeu_ps(o + r * ldo, _mm512_load_ps(acc + r * 32));
        _mm512_storeu_ps(o + r * ldo + 16, _mm512_load_ps(acc + r * 32 + 16));
    }
}
}  // namespace

// x (m, k) fp32 -> parts (3, mp, k) bf16: hi, mid, lo with hi + mid + lo == x (rows m..mp-1
// zeros), and sums (mp, k / 32) fp32: each run of 32 columns of a row summed (zeros past m).
// k a multiple of 32, mp of 16 and >= m.
extern "C" void fp32_amx_split(const float* x, uint16_t* parts, float* sums, int64_t m,
                               int64_t mp, int64_t k, int threads) {
    const int64_t runs = k / kRun, plane = mp * k;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < mp; r++) {
        uint16_t* row = parts + r * k;
        if (r >= m) {
            for (int p = 0; p < 3; p++) memset(row + p * plane, 0, k * sizeof(uint16_t));
            memset(sums + r * runs, 0, runs * sizeof(float));
            continue;
        }
        for (int64_t j = 0; j < runs; j++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = j * kRun; c < (j + 1) * kRun; c += 16) {
                const __m512 v = _mm512_loadu_ps(x + r * k + c);
                const __m512 rest = _mm512_sub_ps(v, simd512::round_bf16(v));    // exact
                const __m512 last = _mm512_sub_ps(rest, simd512::round_bf16(rest));  // exact
                simd512::store_bf16(row + c, v);
                simd512::store_bf16(row + plane + c, rest);
                simd512::store_bf16(row + 2 * plane + c, last);
                sum = _mm512_add_ps(sum, v);
            }
            sums[r * runs + j] = _mm512_reduce_add_ps(sum);
        }
    }
}

// out (m, n) fp32 = x @ W.T + bias from x's split (parts, sums: fp32_amx_split with the same
// m, mp, k) and W's codes (codes, scales: the layout above); n a multiple of 32, k of 32;
// bias (n,) fp32 or null; has_min 0 for codes with no m (Q8_0).
extern "C" void fp32_amx_coded_linear(const uint16_t* parts, const float* sums, const uint16_t* codes,
                                      const float* scales, const float* bias, float* out, int64_t m,
                                      int64_t mp, int64_t n, int64_t k, int has_min, int threads) {
    const int64_t runs = k / kRun, stride = runs * kTile, pairs = n / 32, plane = mp * k;
#pragma omp parallel num_threads(threads)
    {
        configure();
        alignas(64) float tiles[1024];
        alignas(64) float acc[16 * 32];
        for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
            const int64_t r1 = r0 + kRowBlock < m ? r0 + kRowBlock : m;
            linear_groups::this_threads(pairs, pairs, [&](int64_t first, int64_t count) {
                for (int64_t pr = first; pr < first + count; pr++) {
                    const int64_t b = 2 * pr;
                    for (int64_t r = r0; r < r1; r += 16) {
                        pair16(parts + r * k, plane, k, sums + r * runs, codes + b * stride, stride,
                               scales + b * runs * 32, runs, bias ? bias + b * 16 : nullptr,
                               out + r * n + b * 16, n, r1 - r < 16 ? r1 - r : 16, has_min != 0,
                               tiles, acc);
                    }
                }
            });
        }
        _tile_release();
    }
}
