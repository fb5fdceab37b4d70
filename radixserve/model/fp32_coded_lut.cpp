// fp32 linear products of many rows (prefill chunks, large mixed steps) for weights that are
// 4-bit GGUF codes dequantized (cpu_kernels.coded_runs finds them: in every run of 32 columns
// of a weight row, w = d * q + m for q in 0..15), by tables of subset sums instead of FMAs.
//
//   out[r][f] = bias[f] + sum over runs j of ( d[f][j] * P[r][f][j] + m[f][j] * S[r][j] ),
//   P[r][f][j] = sum of x[r][c] * q[f][c] over run j's 32 columns c,  S[r][j] = sum of x[r][c]
//
// Write q = q0 + 2 q1 + 4 q2 + 8 q3 (its bits). Over a group of 8 columns, sum of x[c] * q[c]
// = sum over bits b of 2^b * T[i_b], where T[i] is the sum of the x[c] whose column is set in
// the byte i, and i_b the byte of bit b of the 8 codes. So per group, rows of x and output
// feature: 4 lookups and 3 multiply-adds by 2 (exact) instead of 8 FMAs, with the 256 sums T
// built once per group and rows of x (~290 adds) and read by every output feature. Vectors run
// over rows of x (16 with AVX-512, 8 with AVX2): a lookup is one vector load at an offset
// read from the packed codes. Nothing is rounded but sums of x (T's and the accumulators'):
// fp32 arithmetic in another order, as near the exact product as MKL's (tests).
//
// What it is worth depends on how many FMAs a core issues a cycle. Per feature, 16 rows and
// 16 columns the kernel issues ~11 512-bit loads (8 lookups, the accumulator, d, m) and ~30
// other instructions where MKL issues 16 512-bit FMAs. On an Intel Xeon, which issues two
// 512-bit FMAs (8 cycles) and two 512-bit loads a cycle, that loop runs as fast as MKL, and
// with the tables and transposes the kernel 0.89-0.97x MKL (a SmolLM2 layer's products, q, k
// and v in one call, 128-1,024 rows, 2 threads). A core that issues one 512-bit FMA a cycle (AMD's Zen 4: 16 cycles for MKL) and
// one 512-bit load should run it in ~11: so the runner measures it against MKL at start-up and
// uses it where it wins (radixserve/hardware.py CODED_LUT).
//
// Layout (cpu_kernels.CodedLutLinear.pack): a product's columns in chunks of `chunk` groups
// (1, 2 or 4: one chunk's tables, chunk * 256 vectors, stay in L1 while every feature reads
// them); per chunk, feature, group and bit b the byte offset of T[i_b] in the chunk's tables
// (uint16; (group * 256 + i_b) * lanes * 4); scales (2, runs, n): d then m per run and
// feature. Per block of `lanes` rows a thread transposes x (columns as vectors of rows; by
// lanes x lanes blocks in registers), sums the runs (S), and per chunk builds its tables and
// adds each feature's part of the chunk, for every product of the call (`Part`), into an
// accumulator of the block's rows (y, feature-major), folding by d; m * S at a run's first
// chunk; then transposes y into each product's out.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

constexpr int64_t kRun = 32;   // columns per run of codes (one d, one m)
constexpr int64_t kGroup = 8;  // columns per table: 256 subset sums

// A lane type: its vector of `n` floats (rows of x) and the few operations the kernel uses.
// lo32 / hi32 interleave floats, lo64 / hi64 pairs of floats, within each 128-bit lane;
// join_lanes ends a transpose (see transpose).
struct Lanes8 {  // AVX2: 8 rows of x a vector
    using V = __m256;
    static constexpr int64_t n = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_load_ps(p); }
    static V loadu(const float* p) { return _mm256_loadu_ps(p); }
    static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
    static void store(float* p, V v) { _mm256_store_ps(p, v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V set1(float v) { return _mm256_set1_ps(v); }
    static V lo32(V a, V b) { return _mm256_unpacklo_ps(a, b); }
    static V hi32(V a, V b) { return _mm256_unpackhi_ps(a, b); }
    static V lo64(V a, V b) {
        return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
    }
    static V hi64(V a, V b) {
        return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
    }
    // u[g + j]'s 128-bit lane h: column 4h + j of rows g..g+3 -> r[c]: column c
    static void join_lanes(const V* u, V* r) {
        for (int j = 0; j < 4; j++) {
            r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
            r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
        }
    }
};

#ifdef __AVX512F__
struct Lanes16 {  // AVX-512: 16 rows of x a vector
    using V = __m512;
    static constexpr int64_t n = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_load_ps(p); }
    static V loadu(const float* p) { return _mm512_loadu_ps(p); }
    static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
    static void store(float* p, V v) { _mm512_store_ps(p, v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V set1(float v) { return _mm512_set1_ps(v); }
    static V lo32(V a, V b) { return _mm512_unpacklo_ps(a, b); }
    static V hi32(V a, V b) { return _mm512_unpackhi_ps(a, b); }
    static V lo64(V a, V b) {
        return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    }
    static V hi64(V a, V b) {
        return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    }
    // u[g + j]'s 128-bit lane h: column 4h + j of rows g..g+3 -> r[c]: column c
    static void join_lanes(const V* u, V* r) {
        for (int j = 0; j < 4; j++) {  // lanes h of u[j], u[4 + j], u[8 + j], u[12 + j]
            const V lo_ab = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
            const V hi_ab = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
            const V lo_cd = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
            const V hi_cd = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
            r[j] = _mm512_shuffle_f32x4(lo_ab, lo_cd, 0x88);
            r[4 + j] = _mm512_shuffle_f32x4(lo_ab, lo_cd, 0xDD);
            r[8 + j] = _mm512_shuffle_f32x4(hi_ab, hi_cd, 0x88);
            r[12 + j] = _mm512_shuffle_f32x4(hi_ab, hi_cd, 0xDD);
        }
    }
};
#endif

// r[i] = row i of an n x n block -> r[j] = its column j: floats, then pairs interleaved within
// 128-bit lanes (u[g + j], lane h: column 4h + j of rows g..g+3), then the lanes joined.
template <typename L>
inline void transpose(typename L::V* r) {
    typename L::V t[L::n], u[L::n];
    for (int i = 0; i < L::n; i += 2) {
        t[i] = L::lo32(r[i], r[i + 1]);
        t[i + 1] = L::hi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < L::n; g += 4)
        for (int j = 0; j < 2; j++) {
            u[g + 2 * j] = L::lo64(t[g + j], t[g + j + 2]);
            u[g + 2 * j + 1] = L::hi64(t[g + j], t[g + j + 2]);
        }
    L::join_lanes(u, r);
}

float* aligned_floats(int64_t count) {
    const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
    return static_cast<float*>(aligned_alloc(64, bytes));
}

// The 256 sums of the 8 column vectors xt[0..7] (each `L::n` rows) over every subset, the
// subset i's sum at t + i * L::n: T[i] = A[i's low bits] + B[its high bits], the sums over
// subsets of the first kLow columns (A, kept in registers) and of the rest (B).
template <typename L>
inline void subset_sums(const float* xt, float* t) {
    constexpr int kLow = L::n == 16 ? 4 : 3;  // A: 16 vectors of 32 registers, or 8 of 16
    constexpr int kLowSums = 1 << kLow, kHighSums = 256 >> kLow;
    typename L::V a[kLowSums], b;
    a[0] = L::zero();
    for (int bit = 0; bit < kLow; bit++) {
        const typename L::V v = L::load(xt + bit * L::n);
        for (int i = 0; i < 1 << bit; i++) a[(1 << bit) + i] = L::add(a[i], v);
    }
    alignas(64) float high[kHighSums * L::n];
    L::store(high, L::zero());
    for (int bit = 0; bit < 8 - kLow; bit++) {
        const typename L::V v = L::load(xt + (kLow + bit) * L::n);
        for (int i = 0; i < 1 << bit; i++)
            L::store(high + ((1 << bit) + i) * L::n, L::add(L::load(high + i * L::n), v));
    }
    for (int h = 0; h < kHighSums; h++) {
        b = L::load(high + h * L::n);
        float* row = t + h * kLowSums * L::n;
        for (int i = 0; i < kLowSums; i++) L::store(row + i * L::n, L::add(a[i], b));
    }
}

// One product of a call (cpu_kernels.CodedLutLinear.products: PART_FIELDS int64 each): its
// packed weight (offsets, scales), bias or null, out (m, n), n, and whether any m is nonzero.
struct Part {
    const uint16_t* offsets;
    const float* scales;
    const float* bias;
    float* out;
    int64_t n, has_min;
};
static_assert(sizeof(Part) == 6 * sizeof(int64_t), "cpu_kernels.py PART_FIELDS");

// Every part's product of x: one pass over x's blocks of rows, each block's tables built once
// and read by every part's features (q, k and v of one x: the tables of 960 features, not of
// 576, 192 and 192).
template <typename L, int Chunk>
void coded_lut(const float* x, const Part* parts, int count, int64_t m, int64_t k, int threads) {
    constexpr int64_t R = L::n;
    const int64_t blocks = (m + R - 1) / R, runs = k / kRun, chunks = k / kGroup / Chunk;
    int64_t features = 0;
    for (int p = 0; p < count; p++) features += parts[p].n;
#pragma omp parallel num_threads(threads)
    {
        float* xt = aligned_floats(k * R);
        float* sums = aligned_floats(runs * R);
        float* tables = aligned_floats(Chunk * 256 * R);
        float* ys = aligned_floats(features * R);  // the parts' accumulators, one after another
        const char* tb = reinterpret_cast<const char*>(tables);
        const typename L::V two = L::set1(2.0f);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * R, rows = m - r0 < R ? m - r0 : R;
            for (int64_t c = 0; c < k; c += R) {  // R x R blocks of x, as columns of R rows
                typename L::V v[R];
                for (int64_t r = 0; r < R; r++) v[r] = r < rows ? L::loadu(x + (r0 + r) * k + c) : L::zero();
                transpose<L>(v);
                for (int64_t j = 0; j < R; j++) L::store(xt + (c + j) * R, v[j]);
            }
            for (int64_t j = 0; j < runs; j++) {
                typename L::V s = L::zero();
                for (int64_t c = 0; c < kRun; c++) s = L::add(s, L::load(xt + (j * kRun + c) * R));
                L::store(sums + j * R, s);
            }
            for (int p = 0, at = 0; p < count; at += parts[p++].n * R)
                for (int64_t f = 0; f < parts[p].n; f++)
                    L::store(ys + at + f * R, L::set1(parts[p].bias ? parts[p].bias[f] : 0.0f));
            for (int64_t ch = 0; ch < chunks; ch++) {
                for (int g = 0; g < Chunk; g++)
                    subset_sums<L>(xt + (ch * Chunk + g) * kGroup * R, tables + g * 256 * R);
                const int64_t run = ch * Chunk * kGroup / kRun;
                const bool run_starts = (ch * Chunk * kGroup) % kRun == 0;
                const typename L::V s = L::load(sums + run * R);
                float* y = ys;
                for (int p = 0; p < count; y += parts[p++].n * R) {
                    const int64_t n = parts[p].n;
                    const float* d = parts[p].scales + run * n;
                    const float* mins = parts[p].scales + (runs + run) * n;
                    const bool with_min = parts[p].has_min && run_starts;
                    const uint16_t* o = parts[p].offsets + ch * n * Chunk * 4;
                    for (int64_t f = 0; f < n; f++, o += Chunk * 4) {
                        typename L::V acc;
                        for (int g = 0; g < Chunk; g++) {
                            auto at = [&](int bit) {
                                return L::load(reinterpret_cast<const float*>(tb + o[4 * g + bit]));
                            };
                            typename L::V a = at(3);
                            a = L::fmadd(a, two, at(2));
                            a = L::fmadd(a, two, at(1));
                            a = L::fmadd(a, two, at(0));
                            acc = g == 0 ? a : L::add(acc, a);
                        }
                        typename L::V yf = L::fmadd(L::set1(d[f]), acc, L::load(y + f * R));
                        if (with_min) yf = L::fmadd(L::set1(mins[f]), s, yf);
                        L::store(y + f * R, yf);
                    }
                }
            }
            const float* y = ys;
            for (int p = 0; p < count; y += parts[p++].n * R) {
                const int64_t n = parts[p].n;
                float* out = parts[p].out;
                int64_t f0 = 0;
                for (; f0 + R <= n; f0 += R) {  // R x R blocks of y, as rows of out
                    typename L::V v[R];
                    for (int64_t j = 0; j < R; j++) v[j] = L::load(y + (f0 + j) * R);
                    transpose<L>(v);
                    for (int64_t r = 0; r < rows; r++) L::storeu(out + (r0 + r) * n + f0, v[r]);
                }
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t f = f0; f < n; f++) out[(r0 + r) * n + f] = y[f * R + r];
            }
        }
        free(xt);
        free(sums);
        free(tables);
        free(ys);
    }
}

template <typename L>
void coded_lut_chunk(const float* x, const Part* parts, int count, int64_t m, int64_t k, int chunk,
                     int threads) {
    if (chunk == 1) coded_lut<L, 1>(x, parts, count, m, k, threads);
    else if (chunk == 2) coded_lut<L, 2>(x, parts, count, m, k, threads);
    else coded_lut<L, 4>(x, parts, count, m, k, threads);
}

}  // namespace

// For each of the `count` parts, out (m, n) = x (m, k) @ W.T + bias (bias may be null) for W
// packed as above with `lanes` rows a vector (8; 16 where built for AVX-512) and `chunk`
// groups (1, 2 or 4) a chunk; k a multiple of 32. Returns 0, or -1 for lanes this build lacks
// (nothing written).
extern "C" int fp32_lut_coded_linears(const float* x, const int64_t* parts, int count, int64_t m,
                                      int64_t k, int lanes, int chunk, int threads) {
    const Part* p = reinterpret_cast<const Part*>(parts);
    if (lanes == 8) {
        coded_lut_chunk<Lanes8>(x, p, count, m, k, chunk, threads);
        return 0;
    }
#ifdef __AVX512F__
    if (lanes == 16) {
        coded_lut_chunk<Lanes16>(x, p, count, m, k, chunk, threads);
        return 0;
    }
#endif
    return -1;
}
