// Helpers shared by the AVX2 + FMA kernels (decode_attention.cpp, fused_ops.cpp's 8-lane
// build). The kernels' digest covers this file too (cpu_kernels.py), so a change here
// rebuilds them.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace simd {

// The sum of v's 8 lanes.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 minimax polynomial
// (relative error ~2e-7, fp32 rounding), 2^n put into the exponent bits. Below -87 the
// result flushes to 0; x is clamped at 88 (e^88 is near fp32's largest).
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// e^x for 8 lanes bit for bit as torch computes it for fp32 vectors (Vectorized<float>::exp:
// SLEEF's expf_u10, 1 ulp): x = q ln2 + s with ln2 in two parts, e^s by a degree-7
// polynomial, then 2^q in two halves (exact). Below -104 the result is 0, above 100
// infinity. What SiLU uses where its output must be torch's (fp32 SiLU * up).
inline __m256 exp8_torch(__m256 x) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(1.442695040888963407359924681f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), x);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i half = _mm256_srai_epi32(q, 1);
    auto pow2 = [](__m256i e) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    };
    u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(_mm256_sub_epi32(q, half)));
    u = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    const __m256 inf = _mm256_set1_ps(__builtin_inff());
    return _mm256_blendv_ps(u, inf, _mm256_cmp_ps(_mm256_set1_ps(100.0f), x, _CMP_LT_OQ));
}

// 8 bf16 values at p as fp32 lanes (bf16 is the top half of an fp32).
inline __m256 load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// 8 fp32 lanes rounded to bf16 (nearest, ties to even; inputs are finite), kept as fp32.
inline __m256 round_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFFF0000)));
}

// 8 fp32 lanes rounded to bf16, stored at p.
inline void store_bf16(uint16_t* p, __m256 v) {
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}

}  // namespace simd
