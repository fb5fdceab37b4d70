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
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(~underflow, e);
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
