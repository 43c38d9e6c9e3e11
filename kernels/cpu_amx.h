// AMX tiles (Intel Sapphire Rapids and later): eight 2-D registers of up to 16 rows x 64 bytes and
// a bfloat16 matrix multiply-accumulate on them (_tile_dpbf16ps: C[16 x 16] float32 +=
// A[16 x 32] bf16 x B, B in pairs of rows along the shared dimension). Compiled in where the build
// targets a CPU that has AMX-BF16 (-march=native); used only where Linux grants the process the
// tile state (amx_permitted) and the caller has not turned it off.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define BATCHGEN_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace batchgen {

// Linux hands out the 8 KiB tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a process that uses tiles without it dies of SIGILL. Asked once.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Every tile 16 rows of 64 bytes. The configuration is per thread: load it before the first tile
// instruction of a work item, release the tiles after the last (oneDNN loads its own per call).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// r[i] lane j -> r[j] lane i, for 32-bit lanes: unpacks of 32- and 64-bit pairs, then two rounds
// of 128-bit lane shuffles.
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + k + 4], 0x88);
      t[8 * i + k + 4] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

}  // namespace batchgen

#endif
