// AMX kernels (built with -mamx-tile -mamx-bf16 -mamx-int8 plus AVX-512) for experts with many
// tokens: the kernels of amx_kernels.inc over the real tile instructions.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moe/fp8_avx512.h"
#include "moe/mxfp4_avx512.h"
#include "moe/packed.h"

namespace hmoe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void tiles_begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
void tiles_end() { _tile_release(); }

// GCC's tile intrinsics paste the register number into inline assembly, so it must be a
// literal: each template picks its literal here.
#define HMOE_TILE_LITERAL(t, OP)      \
  if constexpr (t == 0) OP(0);        \
  else if constexpr (t == 1) OP(1);   \
  else if constexpr (t == 2) OP(2);   \
  else if constexpr (t == 3) OP(3);   \
  else if constexpr (t == 4) OP(4);   \
  else if constexpr (t == 5) OP(5);   \
  else if constexpr (t == 6) OP(6);   \
  else OP(7)

template <int t> void tile_zero() {
#define HMOE_OP(n) _tile_zero(n)
  HMOE_TILE_LITERAL(t, HMOE_OP);
#undef HMOE_OP
}
template <int t> void tile_load(const void* src, size_t stride) {
#define HMOE_OP(n) _tile_loadd(n, src, stride)
  HMOE_TILE_LITERAL(t, HMOE_OP);
#undef HMOE_OP
}
template <int t> void tile_store(void* dst, size_t stride) {
#define HMOE_OP(n) _tile_stored(n, dst, stride)
  HMOE_TILE_LITERAL(t, HMOE_OP);
#undef HMOE_OP
}
// C tile c (0..3) += A tile 4 + c / 2 . B tile 6 + c % 2.
template <int c> void tile_dp_bf16() {
  if constexpr (c == 0) _tile_dpbf16ps(0, 4, 6);
  else if constexpr (c == 1) _tile_dpbf16ps(1, 4, 7);
  else if constexpr (c == 2) _tile_dpbf16ps(2, 5, 6);
  else _tile_dpbf16ps(3, 5, 7);
}
template <int c> void tile_dp_i8() {
  if constexpr (c == 0) _tile_dpbssd(0, 4, 6);
  else if constexpr (c == 1) _tile_dpbssd(1, 4, 7);
  else if constexpr (c == 2) _tile_dpbssd(2, 5, 6);
  else _tile_dpbssd(3, 5, 7);
}
#undef HMOE_TILE_LITERAL

#include "moe/amx_kernels.inc"

}  // namespace

// Linux hands out AMX tile state only to processes that ask for it (XFEATURE_XTILEDATA).
bool amx_request_permission() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
}

const Kernels& kernels_amx() {
  static const Kernels k = make_kernels();
  return k;
}

}  // namespace hmoe
