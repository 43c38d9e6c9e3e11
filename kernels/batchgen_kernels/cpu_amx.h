// AMX tiles (Intel Sapphire Rapids and later): eight 2-D registers of up to 16 rows x 64 bytes and
// a bfloat16 matrix multiply-accumulate on them (_tile_dpbf16ps: C[16 x 16] float32 +=
// A[16 x 32] bf16 x B, B in pairs of rows along the shared dimension). Compiled in where the build
// targets a CPU that has AMX-BF16 (-march=native); used only where Linux grants the process the
// tile state (amx_permitted) and the caller has not turned it off.
//
// amx_attend: attention of up to 16 query heads (lanes) over the same paged keys, on tiles: the
// decode kernel's pass over the blocks a pack of rows shares (cpu_attention.cpp), and a short
// prefill chunk's positions over their context (cpu_prefill.cpp).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define BATCHGEN_AMX 1

#include "cpu_intrin.h"
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

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


// S^T = K Q^T for 16 keys (rows of ``kb``, head_dim 32 * P) into ``dst`` (16 x 16 floats): tile C
// the product, tile K the keys, tiles 2 .. 2 + P - 1 the query pieces (loaded by the caller). A
// macro: the tile intrinsics take their tile numbers as literals.
#define BATCHGEN_SCORE_TILE(C, K, P, kb, dst) \
  do {                                        \
    _tile_zero(C);                            \
    _tile_loadd(K, (kb), 64 * (P));           \
    _tile_dpbf16ps(C, K, 2);                  \
    _tile_loadd(K, (kb) + 32, 64 * (P));      \
    _tile_dpbf16ps(C, K, 3);                  \
    if constexpr ((P) == 4) {                 \
      _tile_loadd(K, (kb) + 64, 64 * (P));    \
      _tile_dpbf16ps(C, K, 4);                \
      _tile_loadd(K, (kb) + 96, 64 * (P));    \
      _tile_dpbf16ps(C, K, 5);                \
    }                                         \
    _tile_stored(C, (dst), 64);               \
  } while (0)

// The lanes of amx_attend: query head g of row r is lane r * group + g, head kv_head * group + g.
constexpr int kAmxLanes = 16;

// Attention of the query heads of ``rows`` rows (``group`` per kv head, rows * group <= 16: one per
// lane) over the first ``keys`` keys of the paged caches ([kv_heads, num_blocks, block_size, dim],
// block_size a multiple of 16) through ``table``; row r sees only its first ``limits[r]`` keys where
// ``limits`` is given (a prefill chunk's causal mask). bf16 products with float32 sums, as the bf16
// dot instruction's passes, in two phases over the keys:
//
// Phase A, per 32 keys: the scores of 16 keys for all lanes are one tile product S^T = K Q^T (A: 16
// keys x 32 dims straight from the cache, B: the lanes' query pairs, laid out once; one product per
// 32 dims), stored as 16 lane vectors. The online softmax runs on them per lane, but the running
// maximum moves only where a score passes it by more than kLazyRescale (weights up to e^8 stay exact
// in float32, and bf16 rounding is relative), so the accumulators rarely need rescaling (``lazy``;
// else the maximum moves whenever a score passes it, as in the other passes). The weights, rounded
// to bf16 in pairs of keys, are transposed into the A tile of phase B (lane x 32 keys) and kept,
// with each rescale.
//
// The lazy maximum costs accuracy: with the exact one the largest weight of a tile is 1, exact in
// bf16, and in a peaked softmax it carries most of the output; a lagging maximum rounds it like
// the rest. Decode keeps the exact maximum (the lazy one raised its error and saved no time);
// prefill chunks take the lazy one, which saves time there, and their error stays within the
// bounds the kernels are held to against torch's flash kernel (tests/kernels/test_cpu_prefill.py).
// Phase B, per 64 dims of the head: the weighted sums P V accumulate in four tiles (lane x 16 dims,
// in the order of 16-bit unpacks) over the kept weights and the values interleaved in pairs of keys,
// with the rescales of phase A replayed between chunks. Keys past ``keys`` in the last chunk score
// -inf and their values are read as zeros.
//
// ``sinks`` (or null): a logit per query head whose value vector is zero. ``state`` (or null): per
// (row, head), stride head_dim + 2: running maximum, running sum, the unnormalized sums (the decode
// kernel's per-row pass goes on from it). ``out`` (or null): the normalized outputs, [rows, heads,
// head_dim] as ``q``.
constexpr float kLazyRescale = 8.0f;

template <int N>  // N: head_dim / 16 (4 or 8)
void amx_attend(const uint16_t* q, int64_t heads, const uint16_t* k_cache, const uint16_t* v_cache,
                const int64_t* table, int64_t keys, int64_t rows, int64_t group, int64_t num_blocks,
                int64_t block_size, int64_t kv_head, float scale, const float* sinks, const int64_t* limits,
                float* state, uint16_t* out, bool lazy) {
  constexpr int D = 16 * N, P = N / 2;  // P: 32-dim pieces
  static_assert(P == 2 || P == 4, "head_dim 64 or 128");
  const int64_t chunks = (keys + 31) / 32;
  alignas(64) uint32_t qp[D / 2][kAmxLanes];  // B tiles of S^T: piece c is rows 16c .. 16c + 15
  thread_local std::vector<uint32_t> weights;  // per chunk: the A tile of phase B, [lane][key pair]
  thread_local std::vector<float> rescales;    // per chunk: 16 lanes' factors (a NaN first: none)
  weights.resize(static_cast<size_t>(chunks) * 256);
  rescales.resize(static_cast<size_t>(chunks) * kAmxLanes);
  for (int j = 0; j < D / 2; ++j)
    for (int lane = 0; lane < kAmxLanes; ++lane) qp[j][lane] = 0;
  v16 m = v16{} - INFINITY, l = v16{};
  i32x16 limit = i32x16{} + static_cast<int32_t>(keys);  // keys each lane sees
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t lane = r * group + g, head = kv_head * group + g;
      const uint16_t* qh = q + (r * heads + head) * D;
      for (int j = 0; j < D / 2; ++j) std::memcpy(&qp[j][lane], qh + 2 * j, 4);
      if (sinks) {
        m[lane] = sinks[head];
        l[lane] = 1.0f;
      }
      if (limits) limit[lane] = static_cast<int32_t>(limits[r]);
    }
  int64_t fewest = keys;  // below this every lane sees every key
  for (int lane = 0; lane < rows * group; ++lane) fewest = std::min<int64_t>(fewest, limit[lane]);
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  auto offset = [&](int64_t pos) { return head_base + (table[pos / block_size] * block_size + pos % block_size) * D; };
  configure_full_tiles();
  // phase A. Tiles: 0 / 6 the scores, 1 / 7 the keys, 2 .. 2 + P - 1 the query pieces
  _tile_loadd(2, &qp[0][0], 64);
  _tile_loadd(3, &qp[16][0], 64);
  if constexpr (P == 4) {
    _tile_loadd(4, &qp[32][0], 64);
    _tile_loadd(5, &qp[48][0], 64);
  }
  const v16 minus_inf = v16{} - INFINITY;
  // the scores of chunk ch (32 keys x 16 lanes) into s: keys 0-15 on tiles 0 / 1, 16-31 on 6 / 7
  auto scores = [&](int64_t ch, float (*s)[kAmxLanes]) {
    for (int g = 0; g < 2; ++g) {
      const int64_t pos = 32 * ch + 16 * g;
      const int64_t valid = std::min<int64_t>(std::max<int64_t>(keys - pos, 0), 16);
      if (valid > 0) {
        if (g == 0)
          BATCHGEN_SCORE_TILE(0, 1, P, k_cache + offset(pos), s[0]);
        else
          BATCHGEN_SCORE_TILE(6, 7, P, k_cache + offset(pos), s[16]);
      }
      for (int64_t k = valid; k < 16; ++k) std::memcpy(s[16 * g + k], &minus_inf, sizeof minus_inf);
    }
  };
  // Chunk ch + 1's tile products are issued before chunk ch's softmax, which runs while they do
  alignas(64) float buffers[2][32][kAmxLanes];
  scores(0, buffers[0]);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    if (ch + 1 < chunks) scores(ch + 1, buffers[(ch + 1) & 1]);
    float(*s)[kAmxLanes] = buffers[ch & 1];
    v16 e[32];
    v16 top = minus_inf;
    const bool masked = 32 * ch + 32 > fewest;
    for (int k = 0; k < 32; ++k) {
      e[k] = load16(s[k]) * scale;
      if (masked) e[k] = i32x16{} + static_cast<int32_t>(32 * ch + k) >= limit ? minus_inf : e[k];
      top = e[k] > top ? e[k] : top;
    }
    float* factors = rescales.data() + ch * kAmxLanes;
    if (_mm512_cmp_ps_mask((__m512)top, (__m512)(lazy ? m + kLazyRescale : m), _CMP_GT_OQ)) {
      // a lane's maximum moves: every lane to its own
      const v16 mx = top > m ? top : m;
      const v16 corr = exp16(m - mx);  // 0 where m is -inf
      l *= corr;
      m = mx;
      std::memcpy(factors, &corr, sizeof corr);
    } else {
      factors[0] = NAN;
    }
    __m512i w[16];  // w[j] lane: the weights of keys 2j (low half) and 2j + 1 as bf16
    for (int j = 0; j < 16; ++j) {
      const v16 lo = exp16(e[2 * j] - m), hi = exp16(e[2 * j + 1] - m);  // 0 for -inf
      l += lo + hi;
      const v16 rl = round_bf16(lo), rh = round_bf16(hi);
      const u32x16 word = ((u32x16)rh & 0xffff0000u) | ((u32x16)rl >> 16);
      w[j] = (__m512i)word;
    }
    transpose16x16(w);  // w[lane]: that lane's 16 key pairs
    for (int lane = 0; lane < kAmxLanes; ++lane) _mm512_storeu_si512(weights.data() + ch * 256 + lane * 16, w[lane]);
  }
  // phase B. Tiles: 0 the weights, 1 the values, 4 .. 7 the sums of 64 dims
  alignas(64) float sums[D / 64][4][kAmxLanes][16];
  for (int half = 0; half < D / 64; ++half) {
    float(&part)[4][kAmxLanes][16] = sums[half];
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const float* factors = rescales.data() + ch * kAmxLanes;
      if (ch > 0 && factors[0] == factors[0]) {
        _tile_stored(4, part[0], 64);
        _tile_stored(5, part[1], 64);
        _tile_stored(6, part[2], 64);
        _tile_stored(7, part[3], 64);
        for (int t = 0; t < 4; ++t)
          for (int lane = 0; lane < kAmxLanes; ++lane) {
            const v16 x = load16(part[t][lane]) * factors[lane];
            std::memcpy(part[t][lane], &x, sizeof x);
          }
        _tile_loadd(4, part[0], 64);
        _tile_loadd(5, part[1], 64);
        _tile_loadd(6, part[2], 64);
        _tile_loadd(7, part[3], 64);
      }
      alignas(64) uint32_t vp[4][16][16];  // [tile][key pair][dim in the unpack order]
      const __m512i zero = _mm512_setzero_si512();
      for (int g = 0; g < 2; ++g) {
        const int64_t pos = 32 * ch + 16 * g;
        const int64_t valid = std::min<int64_t>(std::max<int64_t>(keys - pos, 0), 16);
        const uint16_t* vb = valid > 0 ? v_cache + offset(pos) + 64 * half : nullptr;
        for (int j = 0; j < 8; ++j)
          for (int c = 0; c < 2; ++c) {
            const __m512i x = 2 * j < valid ? _mm512_loadu_si512(vb + 2 * j * D + c * 32) : zero;
            const __m512i y = 2 * j + 1 < valid ? _mm512_loadu_si512(vb + (2 * j + 1) * D + c * 32) : zero;
            _mm512_store_si512(vp[2 * c][8 * g + j], _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(vp[2 * c + 1][8 * g + j], _mm512_unpackhi_epi16(x, y));
          }
      }
      _tile_loadd(0, weights.data() + ch * 256, 64);
      _tile_loadd(1, vp[0], 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, vp[1], 64);
      _tile_dpbf16ps(5, 0, 1);
      _tile_loadd(1, vp[2], 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_loadd(1, vp[3], 64);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, part[0], 64);
    _tile_stored(5, part[1], 64);
    _tile_stored(6, part[2], 64);
    _tile_stored(7, part[3], 64);
  }
  _tile_release();
  // tile 2c + s of a half, column i: dim 32c + 8 (i / 4) + 4s + i % 4 of that half: dims 32c .. 32c + 15
  // are quarters 0, 1 of tiles 2c, 2c + 1 interleaved, dims 32c + 16 .. 32c + 31 their quarters 2, 3
  static const i32x16 low = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  static const i32x16 high = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t lane = r * group + g, at = r * heads + kv_head * group + g;
      v16 x[N];  // the lane's sums in the order of dims
      for (int half = 0; half < D / 64; ++half)
        for (int c = 0; c < 2; ++c) {
          const v16 a = load16(sums[half][2 * c][lane]), b = load16(sums[half][2 * c + 1][lane]);
          x[4 * half + 2 * c] = __builtin_shuffle(a, b, low);
          x[4 * half + 2 * c + 1] = __builtin_shuffle(a, b, high);
        }
      if (state) {
        float* st = state + at * (D + 2);
        st[0] = m[lane];
        st[1] = l[lane];
        for (int j = 0; j < N; ++j) store16(st + 2 + 16 * j, x[j]);
      }
      if (out) {
        const float inv = l[lane] > 0 ? 1.0f / l[lane] : 0.0f;
        for (int j = 0; j < N; ++j) store16(out + at * D + 16 * j, x[j] * inv);
      }
    }
}

}  // namespace batchgen

#endif
