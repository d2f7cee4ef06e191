#pragma once
// e4m3 weights widened in AVX-512 registers, for the files built with the AVX-512 flags (the AVX-512
// and AMX kernels). Static: each such file keeps its own copy (packed.h says why).
#include <immintrin.h>

#include <cstdint>

namespace hmoe {

// 32 e4m3 codes -> their 32 values in bf16, in place order (exact: every e4m3 value is a bf16 value).
// A code of exponent e >= 1 is 2^(e-7) (1 + m/8): in bf16 its 7 magnitude bits shifted to bits 4..10
// plus 120 << 7 (the exponent rebiased from 7 to 127, the mantissa on top of bf16's 7 bits). Exponent 0
// (m x 2^-9, zero included) comes from a table of 8, indexed by the magnitude. vpmovsxbw copies the
// sign into bits 7..15; bit 15 is the bf16 sign. NaN codes never reach a kernel (packing refuses them).
static inline __m512i fp8_bf16(const uint8_t* codes) {
  alignas(64) static const uint16_t kExponent0[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  const __m512i mag = _mm512_and_si512(s, _mm512_set1_epi16(0x7F));
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                    _mm512_load_si512(kExponent0));
  return _mm512_ternarylogic_epi32(v, s, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // v | (s & 0x8000)
}

}  // namespace hmoe
