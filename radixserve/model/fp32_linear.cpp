// fp32 linear layers on CPUs with AVX-512 or AVX2, one source built for either (a block of 16
// features is one 512-bit vector there, two 256-bit ones here: `Vec16`):
//
//   out (m, n) fp32 = x (m, k) fp32 @ W.T + bias,  W (n, k) fp32, bias (n,) fp32 or none
//
// A decode step reads every weight once for a handful of rows. oneDNN, given the weights
// pre-blocked, streams them at ~15 GB/s on the two cores of an AMD EPYC Zen 4 at 16 rows
// (where 30 GB/s is there), and MKL takes its slow paths on AMD CPUs. This kernel lays each
// weight out once (`fp32_blocked_pack`) in the order it reads it: blocks of 16 output
// features, a block holding, for each column c in turn, the 16 features' W[., c] (64
// bytes); blocks one after the other, each a contiguous k * 64 bytes.
//
// Compute: one 64-byte row of a block is a vector of 16 features' weights for one column,
// so a row of x's value in that column (broadcast) times it adds into 16 sums at once: one
// register per (row of x, block), no horizontal sums. Each thread takes whole groups of up
// to kGroup consecutive blocks and runs x's rows against them, kRows at a time (kRows x
// kGroup accumulators; the AVX2 build a block at a time, kPassBlocks), from L2: while it
// works on a group, it fetches its next group's weights (one stretch of memory) into L2, a
// line per block and column it reads.
//
// Order of the sums: each output's sum runs over the columns in order, one fp32 FMA a
// column, in chunks of `chunk` columns: each chunk's sum starts from zero and is added to the
// output (which starts as the bias, or as the first chunk's sum) in turn. That is the order
// of MKL's sgemm (whose microkernels take the columns in blocks of kc and add each block's
// products into C; a row of more than one block and less than two it cuts in two halves,
// and so does this kernel when the row's length is even); with MKL's kc as `chunk` the
// kernel's product is bit for bit torch's F.linear on the same CPU (cpu_kernels.py finds the
// chunk at start-up and checks each weight's shape), so a prefill may go through it without
// moving logits from the reference. chunk <= 0: one chunk.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "linear_groups.h"

namespace {

// 16 fp32 lanes: a block's 16 features for one column, or 16 of their sums.
#ifdef __AVX512F__
struct Vec16 {
    __m512 v;
    static Vec16 zero() { return {_mm512_setzero_ps()}; }
    static Vec16 load(const float* p) { return {_mm512_load_ps(p)}; }  // 64-byte aligned
    static Vec16 loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Vec16 broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
    void storeu(float* p) const { _mm512_storeu_ps(p, v); }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 add(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
constexpr int kRows = 8;  // rows of x at a time
#else
struct Vec16 {
    __m256 lo, hi;
    static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Vec16 load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
    static Vec16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static Vec16 broadcast(const float* p) {
        const __m256 b = _mm256_broadcast_ss(p);
        return {b, b};
    }
    void storeu(float* p) const {
        _mm256_storeu_ps(p, lo);
        _mm256_storeu_ps(p + 8, hi);
    }
};
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 add(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
// 6 rows x 1 block a pass: 12 of the 16 registers hold sums, 2 the block's weights, 1 x's
// broadcast (3 rows x 2 blocks needs 17: one sum spilled, its chain through memory, half the
// speed). x's rows packed column by column for the broadcasts (one stream, fixed offsets)
// ran 1.1x in L1 but no faster in the kernel (16-1,024 rows), and were not kept. AMD EPYC (Zen 3, AVX2), one thread, sums in L1, GFLOP/s of its 120 peak (three
// runs, a noisy machine): 6 x 1 block 73-87, 4 x 1 40, 4 rows x 24 features 76-90, 2 x 48
// features 55-68, 1 x 96 38-53.
constexpr int kRows = 6;
#endif
// blocks a pass takes: AVX-512 all of a group's (up to kGroup), AVX2 one at a time
#ifdef __AVX512F__
constexpr int kPassBlocks = 2;
#else
constexpr int kPassBlocks = 1;
#endif
// Blocks of 16 features at a time: kRows x kGroup = 16 accumulators. Against 3 blocks (24
// accumulators), AMD EPYC Zen 4, 2 threads, bit for bit the same (each feature's sum is
// its own), GFLOP/s 3 -> 2 blocks, one process alternating the two builds (medians of 13,
// ad hoc): 544 rows 207 -> 215 (gate|up, 3072 x 576), 214 -> 220 (down, 576 x 1536), 150 ->
// 155 (o, 576 x 576); 1,024 rows 202 -> 207 (gate|up), 202 -> 206 (qkv, 960 x 576); 16 rows
// from memory 169-179 -> 169-190 (gate|up), 170 -> 183 (the LM head), 157 -> 144 (qkv), from
// cache 205 -> 212-214. A ModelRunner prefill of 1,024 rows, three runs of each build
// alternated: 1194-1211 -> 1092-1178 ms; a 16-row decode step 40.2-41.6 -> 39.0-41.5 ms.
constexpr int kGroup = 2;
// x's rows a panel at a time, each thread running its groups of blocks against a panel
// before the next: a panel (64 x k floats, 147 kB at k = 576) stays in L2 across the
// groups, where x's whole rows (a prefill of 8,160 tokens: 18.8 MB) came from memory for
// each group. AMD EPYC Zen 4, 2 threads, 8160 rows, GFLOP/s, whole -> panels of 64 (128 and
// 256 alike): 143 -> 167 (1536 x 576), 175 -> 194 (576 x 1536), 178 -> 203 (576 x 576);
// 544 rows and decode steps (one panel) unchanged.
// a whole number of passes of at least 64 rows (AVX2: 66), so that a 64-row product (the
// plan's blocked rows) is one panel, not 63 rows and then 1 streaming every weight again
constexpr int64_t kPanel = (64 + kRows - 1) / kRows * kRows;

// The next group's weights fetched into L2 during each pass over a group's columns, rather
// than left to the hardware's prefetchers (which kept a decode step's first pass over each
// group waiting on memory: ~15-19 GB/s of the ~28 there). AMD EPYC Zen 4, 2 threads, the
// products of SmolLM2's 30 layers and LM head (540 MB of weights), ms, none -> in the first
// pass of rows -> in every pass (medians of 10, alternated, two runs each): 16 rows
// 29.6-34.0 -> 26.1-28.9 -> 24.8-25.7; 8 rows 23.6 -> 20.9 -> 20.2; 4 rows 24.7 -> 22.4;
// 32 rows 53.1 -> 47.2; 64 rows 97.0 -> 89.3; 1 row 21.4 -> 22.6 (at memory speed either
// way); 544 rows 768 -> 755. Into L1 instead, or two groups ahead: slower.
struct Ahead {
    const char* lines = nullptr;  // the next group's weights, or null
    int64_t count = 0;            // its 64-byte lines
};

// Columns [first, end) of a product (one chunk of its sums; see the order of the sums
// above): x's `rows` rows (k apart, x at column 0) times the `count` blocks whose column
// `first` is at w (`stride` apart), added into out's rows (n apart), which the first chunk
// starts as the bias or its sum. The loops over rows and blocks are unrolled so that the
// sums stay in registers (GCC kept them on the stack otherwise: half the speed).
template <int count, int rows>
void chunk_times_group(const float* x, int64_t k, int64_t first, int64_t end, const float* w,
                       int64_t stride, const float* bias, float* out, int64_t n, Ahead ahead) {
    Vec16 acc[rows][count];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int c = 0; c < count; c++) acc[r][c] = Vec16::zero();
    for (int64_t col = first; col < end; col++) {
        Vec16 wv[count];
#pragma GCC unroll 4
        for (int c = 0; c < count; c++) wv[c] = Vec16::load(w + c * stride + (col - first) * 16);
#pragma GCC unroll 4
        for (int c = 0; c < count; c++)
            if (col * count + c < ahead.count)
                _mm_prefetch(ahead.lines + (col * count + c) * 64, _MM_HINT_T1);
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const Vec16 xv = Vec16::broadcast(x + r * k + col);
#pragma GCC unroll 4
            for (int c = 0; c < count; c++) acc[r][c] = fmadd(xv, wv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < count; c++) {
        const Vec16 b = bias ? Vec16::loadu(bias + c * 16) : Vec16::zero();
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            float* o = out + r * n + c * 16;
            Vec16 sum = acc[r][c];
            if (first > 0)
                sum = add(Vec16::loadu(o), sum);
            else if (bias)
                sum = add(b, sum);
            sum.storeu(o);
        }
    }
}

// chunk_times_group<count, rows> for rows <= R, a compile-time count of rows each.
template <int count, int R>
inline void chunk_rows(int64_t rows, const float* x, int64_t k, int64_t first, int64_t end,
                       const float* w, int64_t stride, const float* bias, float* out, int64_t n,
                       Ahead ahead) {
    if constexpr (R > 1)
        if (rows < R)
            return chunk_rows<count, R - 1>(rows, x, k, first, end, w, stride, bias, out, n, ahead);
    chunk_times_group<count, R>(x, k, first, end, w, stride, bias, out, n, ahead);
}

// Block c of a group's `ahead`: its share of the next group's lines (each block's pass
// fetches as many as it has columns), where the group's blocks take passes of their own.
inline Ahead block_share(Ahead ahead, int c, int64_t k) {
    if (ahead.lines == nullptr || ahead.count <= c * k) return Ahead{};
    return Ahead{ahead.lines + c * k * 64, ahead.count - c * k};
}

// All of x's m rows, kRows at a time, times columns [first, end) of the group's blocks: in
// one pass where a pass takes them all, else a block at a time, all rows against it (its
// columns' weights stay in L1 across the passes).
template <int count>
void chunk_all_rows(const float* x, int64_t m, int64_t k, int64_t first, int64_t end,
                    const float* w, int64_t stride, const float* bias, float* out, int64_t n,
                    Ahead ahead) {
    if constexpr (count > kPassBlocks) {
        for (int c = 0; c < count; c++)
            chunk_all_rows<1>(x, m, k, first, end, w + c * stride, stride,
                              bias ? bias + c * 16 : nullptr, out + c * 16, n,
                              block_share(ahead, c, k));
    } else {
        for (int64_t r0 = 0; r0 < m; r0 += kRows)
            chunk_rows<count, kRows>(m - r0 < kRows ? m - r0 : kRows, x + r0 * k, k, first, end,
                                     w, stride, bias, out + r0 * n, n, ahead);
    }
}

// The columns cut into chunks: chunk <= 0 or over k, one; a row of more than one chunk and
// less than two, of even length, two halves (MKL's way, above).
inline int64_t effective_chunk(int64_t k, int64_t chunk) {
    if (chunk <= 0 || chunk > k) return k;
    if (k < 2 * chunk && k % 2 == 0) return k / 2;
    return chunk;
}

// x's m rows times the group's blocks, chunk by chunk of columns. Where a pass takes the
// group's blocks, x's rows outer (a pass of rows runs every chunk); else chunks outer
// (chunk_all_rows: each block's chunk of weights stays in L1 while every row runs).
template <int count>
void group(const float* x, int64_t m, int64_t k, int64_t chunk, const float* w, int64_t stride,
           const float* bias, float* out, int64_t n, Ahead ahead) {
    if constexpr (count > kPassBlocks) {
        for (int64_t first = 0; first < k; first += chunk) {
            const int64_t end = first + chunk < k ? first + chunk : k;
            chunk_all_rows<count>(x, m, k, first, end, w + first * 16, stride, bias, out, n, ahead);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = m - r0 < kRows ? m - r0 : kRows;
        for (int64_t first = 0; first < k; first += chunk) {
            const int64_t end = first + chunk < k ? first + chunk : k;
            chunk_rows<count, kRows>(rows, x + r0 * k, k, first, end, w + first * 16, stride, bias,
                                     out + r0 * n, n, ahead);
        }
    }
}

// CODED: fp32 weights that are low-bit codes in disguise, as GGUF's quantized blocks
// dequantize (the default model's come so), in one of two forms, every run of 32 columns of
// a row:
// - Q4_1: w = (d * q) + m, q in 0..15, d and m fp32 (two IEEE roundings: the product, then
//   the sum): 6 bits a weight instead of 32;
// - Q8_0: w = d * q, q in -128..127 (one rounding): 9 bits a weight.
// cpu_kernels.CodedLinear finds the codes and checks that they give back every weight bit
// for bit; the kernel decodes them into fp32 in cache as a product reads them, a chunk of
// columns at a time, then runs the same FMAs in the same order as the blocked kernel: its
// bits. A decode step, bound by reading the weights from memory, reads under a fifth (under a
// third) of them (figures: radixserve/hardware.py CODED_LINEAR).
//
// Layout: blocks of 16 output features, one after the other; a block is k / 32 runs of
// Form::kBytes bytes, run j (columns 32 j .. 32 j + 31) holding the 16 features' d (16
// fp32), for Q4_1 their m (16 fp32) and 16 column pairs of 16 bytes (byte f of pair p:
// feature f's q of column 32 j + 2 p in its low nibble, of 32 j + 2 p + 1 in its high), for
// Q8_0 32 columns of 16 bytes (byte f of column c: feature f's q).
constexpr int64_t kCodedRun = 32;  // columns per d

// The run's 32 columns of 16 features into out (32 x 16 fp32), each weight (d * q) + m or
// d * q with the product rounded before the sum: AVX-512's _round_ forms, and AVX2's
// `apart`, keep the compiler from fusing them into an FMA (one rounding, not two).
#ifdef __AVX512F__
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
struct Q4_1 {
    static constexpr int64_t kBytes = 384;
    static void decode(const uint8_t* run, float* out) {
        const __m512i nibble = _mm512_set1_epi32(15);
        const __m512 d = _mm512_loadu_ps((const float*)run);
        const __m512 m = _mm512_loadu_ps((const float*)run + 16);
        for (int p = 0; p < kCodedRun / 2; p++) {
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(run + 128 + p * 16)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, nibble));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
            _mm512_store_ps(out + 2 * p * 16, _mm512_add_round_ps(_mm512_mul_round_ps(lo, d, kNearest), m, kNearest));
            _mm512_store_ps(out + (2 * p + 1) * 16,
                            _mm512_add_round_ps(_mm512_mul_round_ps(hi, d, kNearest), m, kNearest));
        }
    }
};
struct Q8_0 {
    static constexpr int64_t kBytes = 576;
    static void decode(const uint8_t* run, float* out) {
        const __m512 d = _mm512_loadu_ps((const float*)run);
        for (int c = 0; c < kCodedRun; c++) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(run + 64 + c * 16)));
            _mm512_store_ps(out + c * 16, _mm512_mul_round_ps(_mm512_cvtepi32_ps(q), d, kNearest));
        }
    }
};
#else
// a * b rounded, then + c rounded: the empty asm hides the product from the compiler's
// contraction into an FMA
inline __m256 apart(__m256 a, __m256 b, __m256 c) {
    __m256 product = _mm256_mul_ps(a, b);
    asm("" : "+x"(product));
    return _mm256_add_ps(product, c);
}
// 8 bytes at p as 8 int32 lanes, unsigned or signed
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline __m256i widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
struct Q4_1 {
    static constexpr int64_t kBytes = 384;
    static void decode(const uint8_t* run, float* out) {
        const __m256i nibble = _mm256_set1_epi32(15);
        const float* dm = (const float*)run;
        for (int h = 0; h < 2; h++) {  // features 8 h .. 8 h + 7
            const __m256 d = _mm256_loadu_ps(dm + 8 * h), m = _mm256_loadu_ps(dm + 16 + 8 * h);
            for (int p = 0; p < kCodedRun / 2; p++) {
                const __m256i q = widen_u8(run + 128 + p * 16 + 8 * h);
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, nibble));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
                _mm256_store_ps(out + 2 * p * 16 + 8 * h, apart(lo, d, m));
                _mm256_store_ps(out + (2 * p + 1) * 16 + 8 * h, apart(hi, d, m));
            }
        }
    }
};
struct Q8_0 {
    static constexpr int64_t kBytes = 576;
    static void decode(const uint8_t* run, float* out) {
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_loadu_ps((const float*)run + 8 * h);
            for (int c = 0; c < kCodedRun; c++) {
                const __m256 q = _mm256_cvtepi32_ps(widen_i8(run + 64 + c * 16 + 8 * h));
                _mm256_store_ps(out + c * 16 + 8 * h, _mm256_mul_ps(q, d));
            }
        }
    }
};
#endif

// Columns [first, end) (multiples of kCodedRun) of `count` coded blocks (at codes, `stride`
// bytes apart) decoded into w (count blocks of (end - first) x 16 fp32, `wstride` floats
// apart), the next group's codes fetched into L2 meanwhile (a run's lines per run decoded).
template <typename Form, int count>
void decode_runs(const uint8_t* codes, int64_t stride, int64_t first, int64_t end, float* w,
                 int64_t wstride, Ahead ahead) {
    constexpr int64_t lines = Form::kBytes / 64;
    for (int64_t j = first / kCodedRun; j < end / kCodedRun; j++) {
#pragma GCC unroll 4
        for (int c = 0; c < count; c++) {
            const int64_t line = (j * count + c) * lines;
            for (int64_t l = line; l < line + lines && l < ahead.count; l++)
                _mm_prefetch(ahead.lines + l * 64, _MM_HINT_T1);
            Form::decode(codes + c * stride + j * Form::kBytes, w + c * wstride + (j * kCodedRun - first) * 16);
        }
    }
}

// The group's blocks chunk by chunk: each chunk's columns decoded once (into the calling
// thread's scratch), then all of x's rows against them.
template <typename Form, int count>
void coded_group(const float* x, int64_t m, int64_t k, int64_t chunk, const uint8_t* codes,
                 int64_t stride, const float* bias, float* out, int64_t n, Ahead ahead,
                 float* scratch) {
    for (int64_t first = 0; first < k; first += chunk) {
        const int64_t end = first + chunk < k ? first + chunk : k;
        decode_runs<Form, count>(codes, stride, first, end, scratch, chunk * 16, ahead);
        chunk_all_rows<count>(x, m, k, first, end, scratch, chunk * 16, bias, out, n, Ahead{});
    }
}

// Inside a parallel region: body(r0, rows, first block, count, next) for each kPanel-row
// panel of an m-row product (rows r0 .. r0 + rows - 1) and each group of this thread's
// blocks of 16 of its n features (linear_groups::this_threads: next, the thread's next
// group's blocks, 0 after its last).
template <typename Body>
void each_panel_group(int64_t m, int64_t n, Body body) {
    for (int64_t r0 = 0; r0 < m; r0 += kPanel) {
        const int64_t rows = m - r0 < kPanel ? m - r0 : kPanel;
        linear_groups::this_threads(n / 16, kGroup, [&](int64_t b, int64_t count, int64_t next) {
            body(r0, rows, b, count, next);
        });
    }
}

// out (m, n) = x (m, k) @ W.T + bias for W held as Form's codes (CODED above; n a multiple
// of 16, k of 32), the sums in chunks of `chunk` columns as fp32_blocked_linear takes them
// (the chunk it ends with must be a multiple of 32: cpu_kernels.CodedLinear checks).
template <typename Form>
void coded_linear(const float* x, const uint8_t* codes, const float* bias, float* out, int64_t m,
                  int64_t n, int64_t k, int threads, int64_t chunk) {
    const int64_t stride = k / kCodedRun * Form::kBytes;
    chunk = effective_chunk(k, chunk);
#pragma omp parallel num_threads(threads)
    {
        // the decoded chunk: the thread's own, kept from call to call
        static thread_local float* scratch = nullptr;
        static thread_local int64_t capacity = 0;
        if (capacity < kGroup * chunk * 16) {
            free(scratch);
            capacity = kGroup * chunk * 16;
            scratch = static_cast<float*>(aligned_alloc(64, capacity * sizeof(float)));
        }
        each_panel_group(m, n, [&](int64_t r0, int64_t rows, int64_t b, int64_t count, int64_t next) {
            const uint8_t* c = codes + b * stride;
            const float* gb = bias ? bias + b * 16 : nullptr;
            float* o = out + r0 * n + b * 16;
            const Ahead ahead{next ? (const char*)(c + count * stride) : nullptr, next * stride / 64};
            const float* xp = x + r0 * k;
            if (count == 1)
                coded_group<Form, 1>(xp, rows, k, chunk, c, stride, gb, o, n, ahead, scratch);
            else
                coded_group<Form, kGroup>(xp, rows, k, chunk, c, stride, gb, o, n, ahead, scratch);
        });
    }
}

}  // namespace

// W (n, k) → the layout above; n a multiple of 16.
extern "C" void fp32_blocked_pack(const float* w, float* out, int64_t n, int64_t k) {
#pragma omp parallel for
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t col = 0; col < k; col++)
            for (int64_t f = 0; f < 16; f++) out[(b * k + col) * 16 + f] = w[(b * 16 + f) * k + col];
}

// out (m, n) = x (m, k) @ W.T + bias; x contiguous, n a multiple of 16, bias (n,) or null;
// the sums over the columns in chunks of `chunk` (<= 0: one chunk).
extern "C" void fp32_blocked_linear(const float* x, const float* packed, const float* bias, float* out,
                                    int64_t m, int64_t n, int64_t k, int threads, int64_t chunk) {
    const int64_t stride = k * 16;
    chunk = effective_chunk(k, chunk);
#pragma omp parallel num_threads(threads)
    each_panel_group(m, n, [&](int64_t r0, int64_t rows, int64_t b, int64_t count, int64_t next) {
        const float* w = packed + b * stride;
        const float* gb = bias ? bias + b * 16 : nullptr;
        float* o = out + r0 * n + b * 16;
        const Ahead ahead{next ? (const char*)(w + count * stride) : nullptr, next * k};
        const float* xp = x + r0 * k;
        switch (count) {
            case 1: group<1>(xp, rows, k, chunk, w, stride, gb, o, n, ahead); break;
            case 2: group<2>(xp, rows, k, chunk, w, stride, gb, o, n, ahead); break;
            default: group<kGroup>(xp, rows, k, chunk, w, stride, gb, o, n, ahead); break;
        }
    });
}

// coded_linear of the two forms (see CODED above)
extern "C" void fp32_coded_linear(const float* x, const uint8_t* codes, const float* bias,
                                  float* out, int64_t m, int64_t n, int64_t k, int threads,
                                  int64_t chunk) {
    coded_linear<Q4_1>(x, codes, bias, out, m, n, k, threads, chunk);
}
extern "C" void fp32_coded8_linear(const float* x, const uint8_t* codes, const float* bias,
                                   float* out, int64_t m, int64_t n, int64_t k, int threads,
                                   int64_t chunk) {
    coded_linear<Q8_0>(x, codes, bias, out, m, n, k, threads, chunk);
}
