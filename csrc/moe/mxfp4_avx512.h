#pragma once
// mxfp4 weights widened in AVX-512 registers, for the files built with the AVX-512 flags (the AVX-512 and AMX
// kernels). Static: each such file keeps its own copy (packed.h says why).
#include <immintrin.h>

#include <cstdint>

namespace hmoe {

// The 16 e2m1 values in bf16 (exact: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives are bf16 values), twice:
// vpermw indexes with a word's 5 low bits, so bit 4 (the next code's lowest bit) picks the same value.
static inline __m512i e2m1_bf16_table() {
  alignas(64) static const uint16_t kTable[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  return _mm512_load_si512(kTable);
}

// One 64-byte half step (16 rows' words, packed.h) -> the bf16 pairs of its K pair s (0..3): each word's
// codes of pair s are its nibble s.
template <int s>
static inline __m512i mxfp4_pair_bf16(__m512i words, __m512i table) {
  return _mm512_permutexvar_epi16(s ? _mm512_srli_epi16(words, 4 * s) : words, table);
}

// 16 e8m0 exponents -> their scales 2^(e - 127) in fp32 (exact for e in 1..254).
static inline __m512 e8m0_ps(const uint8_t* e) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23));
}

}  // namespace hmoe
