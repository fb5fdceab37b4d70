// Helpers shared by the AVX-512 kernels (decode_attention_avx512.cpp, fused_ops.cpp's 16-lane
// build): AVX-512 F/BW/VL/DQ and AVX512-BF16. The 16-lane counterparts of simd_avx2.h; the
// kernels' digest covers this file too (cpu_kernels.py).
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace simd512 {

// e^x for 16 lanes, simd_avx2.h's exp8 (the same reduction and polynomial): below -87 the
// result flushes to 0; x is clamped at 88.
inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    // p * 2^n by vscalefps: the bits of p times 2^n built in an exponent field (checked on
    // every float in (-100, 100)), one instruction instead of four. Intel Xeon (AMX), the
    // extend kernel's AMX build alone, SmolLM2's heads, ms per layer (medians of 15): 2 x 512
    // tokens 1.14 -> 1.07, 1 x 544 0.66 -> 0.62, 1 x 1,024 2.10 -> 2.02; decode unchanged.
    return _mm512_maskz_mov_ps(~underflow, _mm512_scalef_ps(p, n));
}

// e^x for 16 lanes bit for bit as torch computes it for fp32 vectors: simd_avx2.h's
// exp8_torch (SLEEF's expf_u10).
inline __m512 exp16_torch(__m512 x) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963407359924681f)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), x);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1);
    auto pow2 = [](__m512i e) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23));
    };
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half)), pow2(_mm512_sub_epi32(q, half)));
    u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), x, _CMP_LT_OQ),
                              _mm512_set1_ps(__builtin_inff()));
}

// 16 bf16 values at p as fp32 lanes (bf16 is the top half of an fp32).
inline __m512 load_bf16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 fp32 lanes rounded to bf16 (nearest, ties to even), as bf16 bits.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// 16 fp32 lanes rounded to bf16, stored at p.
inline void store_bf16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, to_bf16(v)); }

// 16 fp32 lanes rounded to bf16, kept as fp32.
inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

}  // namespace simd512
