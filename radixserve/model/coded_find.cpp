// Finding the low-bit codes in an fp32 weight that GGUF's quantized blocks dequantized into
// (cpu_kernels.coded_runs; the kernels that read them: fp32_linear.cpp CODED). Every run of
// 32 columns of a row must be (d * q) + m bit for bit, the product rounded before the sum:
// - Q4_1: m the run's least value (q = 0 there), d the step to its greatest in 15 steps,
//   q in 0..15;
// - Q8_0: m = 0 (adding it is exact), d the greatest magnitude over 127, q in -128..127.
// d is tried as the GGUF stores it (the step rounded to fp16, first), as fp32 computes it,
// then the two fp16 values beside the first; each run takes the first that gives it back.
// q = round-half-even((w - m) / d), clamped to the form's range (0 for d = 0, a run of one
// value). One pass over the weight on one thread (SmolLM2-135M's at load: ~0.3 s, where the
// same in torch's ops took ~1.7 s, and several times that while the server's other
// processes started beside it); it stops at the first run that is no codes.
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kRun = 32;
constexpr int kNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// a * b rounded, then + c rounded: the empty asm hides the product from the compiler's
// contraction into an FMA (one rounding, not two)
inline __m256 mul_then_add(__m256 a, __m256 b, __m256 c) {
    __m256 product = _mm256_mul_ps(a, b);
    asm("" : "+x"(product));
    return _mm256_add_ps(product, c);
}

inline float horizontal(__m256 v, bool greatest) {
    __m128 h = greatest ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                        : _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s = _mm_movehl_ps(h, h);
    h = greatest ? _mm_max_ps(h, s) : _mm_min_ps(h, s);
    s = _mm_shuffle_ps(h, h, 1);
    return _mm_cvtss_f32(greatest ? _mm_max_ss(h, s) : _mm_min_ss(h, s));
}

// q of the run's values for d: true, with q, where every value comes back bit for bit
inline bool fits(const float* x, float d, float m, float low, float high, int16_t* q_out) {
    const bool flat = d == 0.0f;
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m256 divisor = flat ? _mm256_set1_ps(1.0f) : vd;
    const __m256 lo = _mm256_set1_ps(low), hi = _mm256_set1_ps(high);
    alignas(32) float q[kRun];
    for (int i = 0; i < kRun; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v, vm), divisor), kNearestEven);
        c = flat ? _mm256_setzero_ps() : _mm256_min_ps(_mm256_max_ps(c, lo), hi);
        const __m256 back = mul_then_add(vd, c, vm);
        const __m256i same = _mm256_cmpeq_epi32(_mm256_castps_si256(back), _mm256_castps_si256(v));
        if (_mm256_movemask_ps(_mm256_castsi256_ps(same)) != 0xFF) return false;
        _mm256_store_ps(q + i, c);
    }
    for (int i = 0; i < kRun; i++) q_out[i] = (int16_t)q[i];
    return true;
}

inline float from_half(uint16_t h) { return _cvtsh_ss(h); }

}  // namespace

// An (n, k) fp32 weight (k a multiple of 32) as codes of `form` (0: Q4_1, 1: Q8_0): 1, with
// d and m (n x k / 32 fp32 each) and q (n x k int16), where every run is such codes; 0 at
// the first that is not (a value that is not finite is none).
extern "C" int coded_find(const float* w, int64_t n, int64_t k, int form, float* d, float* m,
                          int16_t* q) {
    const bool q4_1 = form == 0;
    const float low = q4_1 ? 0.0f : -128.0f, high = q4_1 ? 15.0f : 127.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 top = _mm256_set1_ps(3.402823466e38f);
    const int64_t runs = k / kRun;
    for (int64_t r = 0; r < n * runs; r++) {
        const float* x = w + r * kRun;
        __m256 least = _mm256_loadu_ps(x), greatest = least, magnitude = _mm256_setzero_ps();
        __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (int i = 0; i < kRun; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            least = _mm256_min_ps(least, v);
            greatest = _mm256_max_ps(greatest, v);
            const __m256 a = _mm256_andnot_ps(sign, v);
            magnitude = _mm256_max_ps(magnitude, a);
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, top, _CMP_LE_OQ));  // NaN: false
        }
        if (_mm256_movemask_ps(finite) != 0xFF) return 0;
        const float lowest = q4_1 ? horizontal(least, false) : 0.0f;
        const float step = q4_1 ? (horizontal(greatest, true) - lowest) / high
                                : horizontal(magnitude, true) / high;
        const uint16_t half = _cvtss_sh(step, kNearestEven);  // step >= 0
        const uint16_t below = half == 0 ? 0 : half - 1;      // toward 0 (inf: to 65504)
        const uint16_t above = half >= 0x7BFF ? 0x7BFF : half + 1;  // toward 65504
        const float candidates[4] = {from_half(half), step, from_half(below), from_half(above)};
        bool found = false;
        for (float c : candidates) {
            if (fits(x, c, lowest, low, high, q + r * kRun)) {
                d[r] = c;
                m[r] = lowest;
                found = true;
                break;
            }
        }
        if (!found) return 0;
    }
    return 1;
}
