// Linear layers on the CPU: y = x @ W^T + bias for float32 and bfloat16 weights packed once at load
// time, for the row counts inference runs (a decode step's 1-256 rows; prefill in any count).
//
// oneDNN's packed GEMM slows down at the 8-64 rows of beam search's decode steps and of the experts
// of a mixture-of-experts layer (per-call setup, blocking for large rows). This kernel is one
// register-blocked loop that keeps its rate from 8 rows up (rates in docs/kernels.md):
//
//   W packed by 16 output columns ("a column vector"): float32 [N/16][K][16]; bfloat16
//   [N/16][K/2][16][2] (pairs of K inside each 32-bit lane, the layout of AVX-512 BF16's dot
//   instruction, which multiplies and adds two bf16 pairs per lane). Columns past N are zeros.
//
//   A register block is 6 rows x 4 column vectors (24 accumulators): per K step (a K pair in bf16)
//   4 weight vectors are loaded, each row's x value (pair) broadcast, 24 FMAs (dot products). The
//   64 columns' panel of W (K x 64 values) stays in L2 while every block of rows passes over it.
//
//   Gated ([gate; up] of a SwiGLU MLP): the columns are packed gate vector i, up vector i, gate
//   vector i + 1, ... so that a register block holds gates and ups of the same outputs; the
//   epilogue writes silu(gate) * up (the MLP's hidden activation, half the columns) instead of
//   both, with the rounding points of cpu_ops.cpp's silu_mul in bf16 (gate and up rounded to bf16,
//   silu(gate) rounded, the product rounded): one pass where the GEMM and silu_mul took two.
//
//   Weights stream: a model's layers together outgrow the caches, so each step reads every panel
//   from memory. While a panel's row blocks compute, each prefetches its share of the next panel's
//   lines into L2 (where both panels and the rows fit there), so that the next panel's first row
//   block does not wait on memory.
//
// Threads take contiguous ranges of column vectors (no reduction across threads). Accumulation is
// float32 from the bias (float32); the bf16 output is rounded to nearest even, as oneDNN and
// torch round a bf16 GEMM's float32 accumulators, and can be written widened to float32 (the LM
// head's logits: ``(x @ W^T).float()`` in one pass).
//
// On AVX2 with FMA (no AVX-512) both dtypes run the same packing, panels and threads with a block
// of 3 rows x 2 column vectors on 8-float registers (12 accumulators, the 3 rows' broadcasts, one
// weight register: all 16); bf16 pairs are widened to float32 in registers (see the AVX2
// block_bf16). Without AVX2 and FMA, the entry points return 1 and
// the caller keeps oneDNN or F.linear; tests/model/test_linear.py checks every path the CPU has
// against F.linear in float64.
//
// int8 weights (per-row scales) stay one byte each, packed [N/16][K][16], widened by the
// conversion instructions; the epilogue multiplies each column by its scale and adds the bias.
// FP8 weights (E4M3, a quantized checkpoint's, batchgen/model/quant.py) stay one byte each, packed
// [N/16][K][16], and are widened in registers: a byte sign-extended to 16 bits, shifted left by 7
// and masked is the float16 with the same sign, exponent field and mantissa (exponent bias 15, not
// 7: the value times 2^-8, subnormals included), which F16C's conversion widens exactly to float32.
// The products accumulate from zero; the epilogue multiplies each column by its scale times 2^8
// and adds the bias. x is float32 or bf16, as the model's dtype.
//
// MXFP4 weights (gpt-oss's experts: E2M1 codes, a power-of-two scale per 32 inputs) stay half a
// byte each, packed [N/16][K/2][16] (a byte holds a column's K pair, the first in the low nibble)
// with float32 scales [N/16][K/32][16]. A code's float16 has one byte set: the high one, sign and
// the code's 3 bits shifted by one (a table lookup, pshufb), 2^-14 times the code's value; the
// scale, stored times 2^14, multiplies the widened vector before the FMAs.
//
// On AMX (amx_part below) bf16 runs on tiles, and so do the quantized weights with bf16
// activations: int8, FP8 with a scale per column and MXFP4 (widened exactly to bf16 pairs),
// block-wise FP8 and int4 (two codes a byte, with a bf16 scale and zero point per column and
// group) with each weight scaled and rounded to bf16, a pair of column vectors at a time into a
// scratch buffer (the next pair's while the tiles multiply this one's), then the bf16 loop. W8A8
// on AMX-INT8 multiplies int8 by int8 (w8a8_amx).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include <unistd.h>

#if defined(__AVX512F__)
#include "cpu_intrin.h"
#define BATCHGEN_GEMM_F32 1
#define BATCHGEN_GEMM_AVX512 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BATCHGEN_GEMM_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_intrin.h"
#define BATCHGEN_GEMM_F32 1  // on 8-float registers
#define BATCHGEN_GEMM_BF16 1  // bf16 weights widened to float32 in registers, FMA products
#endif
#if defined(BATCHGEN_GEMM_F32) && defined(__F16C__)
#define BATCHGEN_GEMM_QUANT 1  // int8, FP8 and MXFP4 weights widened in registers (FP8, MXFP4 through F16C)
#endif

#include <omp.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

namespace {

// The packed MXFP4 layout's element: one column's K pair of E2M1 codes
struct Fp4Pair {
  uint8_t codes;
};

// The packed int4 layout's element: two 4-bit codes (unsigned) of a 16-column vector's K pair, byte j
// holding input j % 2 of the pair for column j / 2 (low nibble) and column 8 + j / 2 (high nibble),
// with a scale and a zero point per column and group of inputs
struct Int4Pair {
  uint8_t codes;
};

// The packed block-wise FP8 layout's element: one E4M3 byte, as FP8's (uint8_t), with a scale per
// column and group of inputs (each group's scale multiplies the widened weights before the FMAs)
struct Fp8Block {
  uint8_t bits;
};

// bf16 GEMMs on AMX tiles where they run (gemm_amx turns them off for tests and benchmarks)
[[maybe_unused]] bool amx_enabled = true;

#ifdef BATCHGEN_GEMM_AVX512
constexpr int kRows = 6;  // rows per register block
constexpr int kCols = 4;  // column vectors per register block
#else
// AVX2 has 16 registers of 8 floats: 3 rows x 2 column vectors (each two registers) keep 12
// accumulators, the 3 rows' broadcasts and one weight register in them.
constexpr int kRows = 3;
constexpr int kCols = 2;
#endif

// Software prefetch of the next column panel while this one computes. A model's weights together
// outgrow the caches, so every layer's panels come from memory once per step; without this, each
// panel's first row block waits on those loads while the remaining blocks compute from L2 with the
// memory idle. Each row block of a panel fetches its share of the next panel's cache lines into
// L2, spread evenly over its K steps: ``per`` lines every ``every`` steps, from ``next`` to ``end``.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 1, per = 0;

  // block ``j`` of ``blocks`` over the panel at [lo, hi), in a loop of ``steps`` K steps
  Prefetch(const char* lo, const char* hi, int64_t j, int64_t blocks, int64_t steps) {
    const int64_t lines = (hi - lo + 63) / 64, share = (lines + blocks - 1) / blocks;
    if (share <= 0 || steps <= 0 || j * share >= lines) return;
    next = lo + j * share * 64;
    end = std::min(hi, next + share * 64);
    if (share >= steps) {
      per = (share + steps - 1) / steps;
    } else {
      per = 1;
      every = steps / share;
    }
  }
};

// Three quarters of a core's L2 (1 MiB where the C library does not say)
inline int64_t l2_budget() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20) * 3 / 4;
  }();
  return bytes;
}

// One K step's part of a block's prefetch (``countdown``: steps to the next issue)
inline void prefetch_step(Prefetch& pf, int64_t& countdown) {
  if (--countdown) return;
  countdown = pf.every;
  for (int64_t p = 0; p < pf.per && pf.next < pf.end; ++p, pf.next += 64) __builtin_prefetch(pf.next, 0, 2);  // into L2
}

#ifdef BATCHGEN_GEMM_AVX512

inline __mmask16 lanes(int n) { return static_cast<__mmask16>((1u << n) - 1u); }

// The accumulators of an R x C register block set to the bias (zero without one). Two loops, not
// a select between the bias and zeros: that one GCC compiles to a copy through the stack in
// 32-byte halves, read back as whole vectors (a store-forwarding stall per accumulator).
template <int R, int C>
inline void start_from_bias(__m512 (&acc)[R][C], const float* bias) {
  if (bias) {
    for (int c = 0; c < C; ++c) {
      __m512 b = _mm512_loadu_ps(bias + c * 16);
      asm("" : "+v"(b));  // a register, not a copy of memory (see above)
      for (int r = 0; r < R; ++r) acc[r][c] = b;
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
}

// silu(gate) * up for the gate / up vector pairs of one row's accumulators; ``Bf16``: each
// intermediate rounded to bf16 where torch rounds it. The vectors stay in registers (casts, not
// copies through memory: those cost a store-forwarding stall per vector).
template <int C, bool Bf16>
inline void gated_row(const __m512* acc, float* out) {
  for (int c = 0; c < C; c += 2) {
    batchgen::v16 g = (batchgen::v16)acc[c], u = (batchgen::v16)acc[c + 1];
    if constexpr (Bf16) g = batchgen::round_bf16(g), u = batchgen::round_bf16(u);
    batchgen::v16 s = batchgen::silu16(g);
    if constexpr (Bf16) s = batchgen::round_bf16(s);
    s *= u;
    _mm512_storeu_ps(out + c / 2 * 16, (__m512)s);
  }
}

// R rows x C column vectors of y from x (rows ldx apart) and the packed columns wp (vectors
// vstride apart); the last vector writes ``lastn`` lanes. Gated: C is even and the block writes
// C / 2 vectors of silu(gate) * up.
template <int R, int C, bool Gated, bool Pf>
inline void block_f32(const float* x, int64_t ldx, const float* wp, int64_t k, int64_t vstride, const float* bias,
                      float* y, int64_t ldy, int lastn, Prefetch pf) {
  __m512 acc[R][C];
  start_from_bias<R, C>(acc, bias);
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    __m512 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_ps(wp + c * vstride + i * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xb, acc[r][c]);
    }
  }
  if constexpr (Gated) {
    for (int r = 0; r < R; ++r) gated_row<C, false>(acc[r], y + r * ldy);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (c == C - 1 && lastn < 16)
        _mm512_mask_storeu_ps(y + r * ldy + c * 16, lanes(lastn), acc[r][c]);
      else
        _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
    }
}

#elif defined(BATCHGEN_GEMM_F32)

// The AVX2 blocks' accumulators: R rows x C column vectors of two 8-float registers each.
template <int R, int C>
inline void start_from_bias(__m256 (&acc)[R][C][2], const float* bias) {
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h) {
      const __m256 b = bias ? _mm256_loadu_ps(bias + c * 16 + h * 8) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) acc[r][c][h] = b;
    }
}

// one row's accumulators into C * 16 floats (aligned), for the epilogues on 16-lane vectors
template <int C>
inline void store_row(const __m256 (&acc)[C][2], float* row) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h) _mm256_store_ps(row + c * 16 + h * 8, acc[c][h]);
}

// block_f32 on AVX2: each 16-column vector is two 8-float registers; the epilogue passes a row's
// accumulators through memory (the tail vector's ``lastn`` lanes copied, silu(gate) * up computed
// on 16-lane vectors as the AVX-512 block does).
template <int R, int C, bool Gated, bool Pf>
inline void block_f32(const float* x, int64_t ldx, const float* wp, int64_t k, int64_t vstride, const float* bias,
                      float* y, int64_t ldy, int lastn, Prefetch pf) {
  __m256 acc[R][C][2];
  start_from_bias<R, C>(acc, bias);
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    // the rows' broadcasts first, then one weight register at a time: R + 1 + 4R registers
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + i);
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256 w = _mm256_load_ps(wp + c * vstride + i * 16 + h * 8);
        for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(w, xb[r], acc[r][c][h]);
      }
  }
  // unrolled, so that the accumulators are only ever indexed by constants and stay in registers
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[C * 16];
    store_row<C>(acc[r], row);
    if constexpr (Gated) {
      for (int c = 0; c < C; c += 2) {
        const batchgen::v16 g = batchgen::load16(row + c * 16), u = batchgen::load16(row + (c + 1) * 16);
        batchgen::store16(y + r * ldy + c / 2 * 16, batchgen::silu16(g) * u);
      }
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        float* out = y + r * ldy + c * 16;
        if (c == C - 1 && lastn < 16) {
          std::memcpy(out, row + c * 16, lastn * sizeof(float));
        } else {
          _mm256_storeu_ps(out, acc[r][c][0]);
          _mm256_storeu_ps(out + 8, acc[r][c][1]);
        }
      }
    }
  }
}


// block_bf16 on AVX2 (no bf16 dot instruction): each 32-bit lane of the packed layout holds a K
// pair of one column; shifting it left by 16 gives the first value as a float32, masking off the
// low half the second, exactly. So per K pair, one pass over the C x 2 registers' worth of columns
// with the first K value's broadcasts, then one with the second's (the same cache lines, from L1),
// so that 12 accumulators, 3 broadcasts and one weight register could fit the 16 registers (GCC
// hoists both passes' broadcasts and spills a few accumulators, so this runs below the float32
// path's rate). Products of bf16 values
// are exact in float32, so this sums the same products as the dot instruction; the output is
// rounded once to bf16 (gated: at cpu_ops.cpp's rounding points).
template <int R, int C, typename O, bool Gated, bool Pf>
inline void block_bf16(const uint16_t* x, int64_t ldx, const uint32_t* wp, int64_t k, int64_t vstride,
                       const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  __m256 acc[R][C][2];
  start_from_bias<R, C>(acc, bias);
  const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u)));  // the second of a pair
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k / 2; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    for (int half = 0; half < 2; ++half) {
      __m256 xb[R];
      for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(batchgen::load(x + r * ldx + 2 * i + half));
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs =
              _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + c * vstride + i * 16 + h * 8));
          const __m256 w = half ? _mm256_and_ps(_mm256_castsi256_ps(pairs), high)
                                : _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
          for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(w, xb[r], acc[r][c][h]);
        }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[C * 16];
    store_row<C>(acc[r], row);
    if constexpr (Gated) {
      for (int c = 0; c < C; c += 2) {
        const batchgen::v16 g = batchgen::round_bf16(batchgen::load16(row + c * 16));
        const batchgen::v16 u = batchgen::round_bf16(batchgen::load16(row + (c + 1) * 16));
        batchgen::store16(y + r * ldy + c / 2 * 16, batchgen::round_bf16(batchgen::silu16(g)) * u);
      }
    } else {
      for (int c = 0; c < C; ++c) {
        const int width = c == C - 1 ? lastn : 16;
        alignas(64) O out[16];
        if constexpr (std::is_same_v<O, float>)
          batchgen::store16(out, batchgen::round_bf16(batchgen::load16(row + c * 16)));
        else
          batchgen::store16(out, batchgen::load16(row + c * 16));
        std::memcpy(y + r * ldy + c * 16, out, width * sizeof(O));
      }
    }
  }
}

#endif

#if defined(BATCHGEN_GEMM_BF16) && defined(BATCHGEN_GEMM_AVX512)

// O: uint16_t (bf16 out) or float (bf16-rounded values widened to float32)
template <int R, int C, typename O, bool Gated, bool Pf>
inline void block_bf16(const uint16_t* x, int64_t ldx, const uint32_t* wp, int64_t k, int64_t vstride,
                       const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  __m512 acc[R][C];
  start_from_bias<R, C>(acc, bias);
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k / 2; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    __m512bh w[C];
    for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wp + c * vstride + i * 16);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xb);
    }
  }
  if constexpr (Gated) {
    for (int r = 0; r < R; ++r) {
      alignas(64) float row[C / 2 * 16];
      gated_row<C, true>(acc[r], row);
      for (int c = 0; c < C / 2; ++c) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + c * 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * 16), h);
      }
    }
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[r][c]);
      if constexpr (std::is_same_v<O, float>) {
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        if (c == C - 1 && lastn < 16)
          _mm512_mask_storeu_ps(y + r * ldy + c * 16, lanes(lastn), f);
        else
          _mm512_storeu_ps(y + r * ldy + c * 16, f);
      } else if (c == C - 1 && lastn < 16) {
        _mm256_mask_storeu_epi16(y + r * ldy + c * 16, lanes(lastn), h);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * 16), h);
      }
    }
}

#endif

#ifdef BATCHGEN_GEMM_QUANT

// 16 E4M3 bytes as 16 float16 values of 2^-8 times theirs (see the file's head)
inline __m256i fp8_as_half(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
}

// one row's 16-lane epilogue of the quantized blocks: y = acc * scale + bias (either may be null),
// in O (bf16 rounded to nearest even); the first ``width`` lanes
template <typename O>
inline void scaled_store(const float* acc, const float* scale, const float* bias, O* y, int width) {
  batchgen::v16 v = batchgen::load16(acc);
  if (scale) v *= batchgen::load16(scale);
  if (bias) v += batchgen::load16(bias);
  alignas(64) O out[16];
  batchgen::store16(out, v);
  std::memcpy(y, out, width * sizeof(O));
}

// The high bytes of the float16 values of E2M1 codes 0-15 times 2^-14: sign, then the code's
// exponent and mantissa bits one place up (the low byte is zero)
inline __m128i fp4_half_table() {
  return _mm_setr_epi8(0x00, 0x02, 0x04, 0x06, 0x08, 0x0a, 0x0c, 0x0e, static_cast<char>(0x80),
                       static_cast<char>(0x82), static_cast<char>(0x84), static_cast<char>(0x86),
                       static_cast<char>(0x88), static_cast<char>(0x8a), static_cast<char>(0x8c),
                       static_cast<char>(0x8e));
}

// One K pair of 16 columns (16 bytes) as the high bytes of 16 float16 values each: ``first`` the
// low nibbles' (the pair's first K), ``second`` the high nibbles'
inline void fp4_high_bytes(const Fp4Pair* p, __m128i table, __m128i& first, __m128i& second) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0f);
  first = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
  second = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
}

#ifdef BATCHGEN_GEMM_AVX512

// The quantized blocks' epilogue: every row's C vectors through scaled_store (scale and bias per
// column, either null), the last vector's ``lastn`` lanes
template <int R, int C, typename O>
inline void store_scaled(const __m512 (&acc)[R][C], const float* scale, const float* bias, O* y, int64_t ldy,
                         int lastn) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      alignas(64) float row[16];
      _mm512_store_ps(row, acc[r][c]);
      scaled_store(row, scale ? scale + c * 16 : nullptr, bias ? bias + c * 16 : nullptr, y + r * ldy + c * 16,
                   c == C - 1 ? lastn : 16);
    }
}

// R rows x C column vectors of y = (x @ W^T) * scale + bias with W one byte a weight (vectors
// vstride bytes apart): FP8 (W uint8_t) or int8 (W int8_t), a scale per column in the epilogue;
// or block-wise FP8 (W Fp8Block), the scales per column and group of ``group`` inputs (each
// vector's k / group of them, 16 floats each, sstride floats apart) multiplying the widened weights
template <int R, int C, typename T, typename W, typename O, bool Pf>
inline void block_bytes(const T* x, int64_t ldx, const W* wp, int64_t k, int64_t vstride, const float* scale,
                        int64_t group, const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  constexpr bool grouped = std::is_same_v<W, Fp8Block>;
  const int64_t step = grouped ? group : k, sstride = k / step * 16;
  __m512 acc[R][C];
  start_from_bias<R, C>(acc, nullptr);
  int64_t countdown = pf.every;
  for (int64_t g = 0; g < k; g += step)
    for (int64_t i = g; i < g + step; ++i) {
      if constexpr (Pf) prefetch_step(pf, countdown);
      __m512 w[C];
      for (int c = 0; c < C; ++c) {
        const W* p = wp + c * vstride + i * 16;
        if constexpr (std::is_same_v<W, int8_t>)
          w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        else
          w[c] = _mm512_cvtph_ps(fp8_as_half(reinterpret_cast<const uint8_t*>(p)));
        if constexpr (grouped) w[c] = _mm512_mul_ps(w[c], _mm512_loadu_ps(scale + c * sstride + g / step * 16));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(batchgen::load(x + r * ldx + i));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xb, acc[r][c]);
      }
    }
  store_scaled<R, C>(acc, grouped ? nullptr : scale, bias, y, ldy, lastn);
}

// R rows x C column vectors of y = x @ W^T + bias with W MXFP4 (vectors vstride pairs apart, their
// scales sstride floats apart)
template <int R, int C, typename T, typename O, bool Pf>
inline void block_mxfp4(const T* x, int64_t ldx, const Fp4Pair* wp, int64_t k, int64_t vstride, const float* scale,
                        int64_t sstride, const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  __m512 acc[R][C];
  start_from_bias<R, C>(acc, bias);
  const __m128i table = fp4_half_table();
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k / 2; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    __m512 w[2][C];
    for (int c = 0; c < C; ++c) {
      const __m512 s = _mm512_loadu_ps(scale + c * sstride + i / 16 * 16);
      __m128i first, second;
      fp4_high_bytes(wp + c * vstride + i * 16, table, first, second);
      w[0][c] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(first), 8)), s);
      w[1][c] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(second), 8)), s);
    }
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(batchgen::load(x + r * ldx + 2 * i + half));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[half][c], xb, acc[r][c]);
      }
  }
  store_scaled<R, C>(acc, nullptr, nullptr, y, ldy, lastn);
}

#else

// store_scaled on AVX2: a row's two 8-float halves per vector through memory
template <int R, int C, typename O>
inline void store_scaled(const __m256 (&acc)[R][C][2], const float* scale, const float* bias, O* y, int64_t ldy,
                         int lastn) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[C * 16];
    store_row<C>(acc[r], row);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      scaled_store(row + c * 16, scale ? scale + c * 16 : nullptr, bias ? bias + c * 16 : nullptr,
                   y + r * ldy + c * 16, c == C - 1 ? lastn : 16);
  }
}

// block_bytes on AVX2: each 16-column vector's bytes widen to two 8-float registers
template <int R, int C, typename T, typename W, typename O, bool Pf>
inline void block_bytes(const T* x, int64_t ldx, const W* wp, int64_t k, int64_t vstride, const float* scale,
                        int64_t group, const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  constexpr bool grouped = std::is_same_v<W, Fp8Block>;
  const int64_t step = grouped ? group : k, sstride = k / step * 16;
  __m256 acc[R][C][2];
  start_from_bias<R, C>(acc, nullptr);
  int64_t countdown = pf.every;
  for (int64_t g = 0; g < k; g += step)
    for (int64_t i = g; i < g + step; ++i) {
      if constexpr (Pf) prefetch_step(pf, countdown);
      __m256 xb[R];
      for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(batchgen::load(x + r * ldx + i));
      for (int c = 0; c < C; ++c) {
        const W* p = wp + c * vstride + i * 16;
        if constexpr (std::is_same_v<W, int8_t>) {
          for (int h = 0; h < 2; ++h) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + h * 8));
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(w, xb[r], acc[r][c][h]);
          }
        } else {
          const __m256i half = fp8_as_half(reinterpret_cast<const uint8_t*>(p));
          for (int h = 0; h < 2; ++h) {
            __m256 w = _mm256_cvtph_ps(h ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half));
            if constexpr (grouped) w = _mm256_mul_ps(w, _mm256_loadu_ps(scale + c * sstride + g / step * 16 + h * 8));
            for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(w, xb[r], acc[r][c][h]);
          }
        }
      }
    }
  store_scaled<R, C>(acc, grouped ? nullptr : scale, bias, y, ldy, lastn);
}

// block_mxfp4 on AVX2: per K pair, one pass over the columns with the first K's broadcasts, then
// one with the second's (as the AVX2 block_bf16), each vector widened and scaled as it is used
template <int R, int C, typename T, typename O, bool Pf>
inline void block_mxfp4(const T* x, int64_t ldx, const Fp4Pair* wp, int64_t k, int64_t vstride, const float* scale,
                        int64_t sstride, const float* bias, O* y, int64_t ldy, int lastn, Prefetch pf) {
  __m256 acc[R][C][2];
  start_from_bias<R, C>(acc, bias);
  const __m128i table = fp4_half_table();
  const __m128i zero = _mm_setzero_si128();
  int64_t countdown = pf.every;
  for (int64_t i = 0; i < k / 2; ++i) {
    if constexpr (Pf) prefetch_step(pf, countdown);
    __m128i bytes[2][C];
    for (int c = 0; c < C; ++c) fp4_high_bytes(wp + c * vstride + i * 16, table, bytes[0][c], bytes[1][c]);
    for (int half = 0; half < 2; ++half) {
      __m256 xb[R];
      for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(batchgen::load(x + r * ldx + 2 * i + half));
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) {
          const __m128i halves = h ? _mm_unpackhi_epi8(zero, bytes[half][c]) : _mm_unpacklo_epi8(zero, bytes[half][c]);
          const __m256 w = _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_loadu_ps(scale + c * sstride + i / 16 * 16 + h * 8));
          for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(w, xb[r], acc[r][c][h]);
        }
    }
  }
  store_scaled<R, C>(acc, nullptr, nullptr, y, ldy, lastn);
}

#endif
#endif

// amx_part's scratch per thread, in uint32: a last block's rows zero-padded to 32 (32 * k bf16),
// then two pairs of vectors widened (2 * k * 16). Allocated by the thread that opens the parallel
// region: what a worker thread allocates comes from its own malloc arena, whose pages partly stay
// resident after the call (a loaded model's probes would keep them).
inline int64_t amx_scratch(int64_t k) { return 48 * k; }

// Whether amx_part needs its scratch for m rows (quantized weights always; bf16 for a partial last block)
template <typename W>
bool amx_needs_scratch(int64_t m) {
  return !std::is_same_v<W, uint32_t> || (m % 32 != 0 && m % 32 != 16);
}

#if defined(BATCHGEN_AMX) && defined(BATCHGEN_GEMM_BF16) && defined(BATCHGEN_GEMM_AVX512)
#define BATCHGEN_GEMM_AMX 1

// bf16 on AMX tiles, where the process may use them (batchgen::amx_permitted) and K is a multiple
// of 32. The packed layout is already the tiles' B operand: a column vector's K pairs are rows of
// 16 columns x 2 bf16, so 16 pairs (32 K) of one vector are one 16 x 64-byte tile, 1 KiB
// contiguous. A block is 32 rows x 2 column vectors: tiles 0-3 the four 16 x 16 float32 products,
// 4 / 5 two 16-row pieces of x (straight from its rows), 6 / 7 the two vectors' weights; per 32 K,
// four loads and four tile products. A thread walks its range of vectors a pair at a time, every
// block of rows (up to kAmxChunkRows, x's rows staying in L2) on the pair's weights, which come
// from memory once and from L1 / L2 for the pair's other row blocks; while it does, it prefetches
// the next pair's weights into L2, spread over the K loop of the first row block. Rows past m in
// a last partial block are zeros in a per-thread copy, made once for all the pairs. The epilogue
// adds the bias and rounds as block_bf16 does (gated: silu(gate) * up at cpu_ops.cpp's rounding
// points; O float: widened).
//
// At the 64 rows of a decode step, where each step reads every weight from memory, this streams
// the weights faster than oneDNN's AMX GEMM, whose per-call setup and blocking for large row counts
// slow it there (scripts/gemm_rates.py --cold measures both).
constexpr int64_t kAmxChunkRows = 256;

template <typename O, bool Gated>
inline void amx_epilogue(const float (*acc)[32], int64_t rows, int cols, const float* scale, const float* bias, O* y,
                         int64_t ldy, int lastn) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (Gated) {
      batchgen::v16 g = batchgen::load16(acc[r]), u = batchgen::load16(acc[r] + 16);
      if (bias) g += batchgen::load16(bias), u += batchgen::load16(bias + 16);
      g = batchgen::round_bf16(g);
      u = batchgen::round_bf16(u);
      const batchgen::v16 s = batchgen::round_bf16(batchgen::silu16(g)) * u;
      batchgen::store16(y + r * ldy, s);
    } else {
      for (int c = 0; c < cols; ++c) {
        batchgen::v16 v = batchgen::load16(acc[r] + 16 * c);
        if (scale) v *= batchgen::load16(scale + 16 * c);
        if (bias) v += batchgen::load16(bias + 16 * c);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
        const int width = c == cols - 1 ? lastn : 16;
        O* out = y + r * ldy + 16 * c;
        if constexpr (std::is_same_v<O, float>) {
          const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
          _mm512_mask_storeu_ps(out, lanes(width), f);
        } else {
          _mm256_mask_storeu_epi16(out, lanes(width), h);
        }
      }
    }
  }
}

// 16 bytes of a packed column vector's input (int8, or FP8 as 2^-8 times its value) as float32
inline __m512 widen_bytes(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 widen_bytes(const uint8_t* p) { return _mm512_cvtph_ps(fp8_as_half(p)); }

// The pairs [i0, i1) of one column vector of bytes ([k][16]) as bf16 pairs ([k / 2][16],
// amx_part's B operand): exact, an int8 value or an FP8 one times 2^-8 has at most 8 significant bits
template <typename W>
void bytes_as_pairs(const W* src, int64_t i0, int64_t i1, uint32_t* dst) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = i0; i < i1; ++i) {
    const __m512i first = _mm512_castps_si512(widen_bytes(src + 32 * i));
    const __m512i second = _mm512_castps_si512(widen_bytes(src + 32 * i + 16));
    // first's high half into the low half, second's high half kept: (first >> 16) | (second & high)
    _mm512_storeu_si512(dst + 16 * i, _mm512_ternarylogic_epi32(_mm512_srli_epi32(first, 16), second, high, 0xf8));
  }
}

// Two float32 vectors (a column vector's two inputs of a K pair) as 16 bf16 pairs, each rounded to
// nearest even, the first in the low half
inline __m512i bf16_pairs(__m512 first, __m512 second) {
  // one conversion of both (first's 16 words low, second's high), then the words interleaved
  const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(second, first));
}

// The pairs [i0, i1) of one column vector of int4 codes ([k / 2][16] bytes, gemm_pack_int4's) as
// bf16 pairs: (code - zero) * scale of the input's group (``scales`` / ``zeros`` bf16 [k / group][16];
// no zeros: 8 for every code, a symmetric checkpoint's) in float32, rounded to bf16 (nearest even).
// A pair's 16 bytes widened to 32-bit lanes are columns 0-7's bf16 pairs in order (low nibbles) and
// columns 8-15's (high nibbles): one conversion to bf16 makes the 16 pairs, each scale and zero
// point repeated over its column's two lanes. (code - zero) * scale is code * scale - zero * scale in
// one rounding: zero * scale, a product of two bf16 values, is exact in float32.
inline void int4_as_pairs(const Int4Pair* src, int64_t i0, int64_t i1, int64_t group, const uint16_t* scales,
                          const uint16_t* zeros, uint32_t* dst) {
  const __m512i low = _mm512_set1_epi32(0x0f);
  const __m512i first8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last8 = _mm512_add_epi32(first8, _mm512_set1_epi32(8));
  for (int64_t g = 2 * i0 / group, i = i0; i < i1; ++g) {  // a group's pairs at a time, its scales in registers
    const __m512 sv = (__m512)batchgen::load16(scales + 16 * g);
    const __m512 zs = _mm512_mul_ps(zeros ? (__m512)batchgen::load16(zeros + 16 * g) : _mm512_set1_ps(8.0f), sv);
    const __m512 s0 = _mm512_permutexvar_ps(first8, sv), s1 = _mm512_permutexvar_ps(last8, sv);
    const __m512 zs0 = _mm512_permutexvar_ps(first8, zs), zs1 = _mm512_permutexvar_ps(last8, zs);
    for (const int64_t end = std::min(i1, (g + 1) * group / 2); i < end; ++i) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i)));
      const __m512 a = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(codes, low)), s0, zs0);
      const __m512 b = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)), s1, zs1);
      _mm512_storeu_si512(dst + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// The pairs [i0, i1) of one column vector of block-wise FP8 ([k][16] bytes) as bf16 pairs: each
// weight times its group's scale (``scales`` float32 [k / group][16], times 2^8) in float32, rounded to bf16
inline void fp8_blocks_as_pairs(const Fp8Block* src, int64_t i0, int64_t i1, int64_t group, const float* scales,
                                uint32_t* dst) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (int64_t g = 2 * i0 / group, i = i0; i < i1; ++g) {  // a group's pairs at a time
    const __m512 sv = _mm512_loadu_ps(scales + 16 * g);
    for (const int64_t end = std::min(i1, (g + 1) * group / 2); i < end; ++i)
      _mm512_storeu_si512(dst + 16 * i, bf16_pairs(_mm512_mul_ps(widen_bytes(bytes + 32 * i), sv),
                                                   _mm512_mul_ps(widen_bytes(bytes + 32 * i + 16), sv)));
  }
}

// The pairs [i0, i1) of one column vector of MXFP4 pairs ([k / 2][16]) as bf16 pairs: each code's
// value times its group's power-of-two scale (``scales`` float32 [k / 32][16], times 2^14), exact in bf16
inline void mxfp4_as_pairs(const Fp4Pair* src, int64_t i0, int64_t i1, const float* scales, uint32_t* dst) {
  const __m128i table = fp4_half_table();
  for (int64_t i = i0; i < i1; ++i) {
    const __m512 sv = _mm512_loadu_ps(scales + i / 16 * 16);
    __m128i first, second;
    fp4_high_bytes(src + 16 * i, table, first, second);
    const __m512 a = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(first), 8)), sv);
    const __m512 b = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(second), 8)), sv);
    _mm512_storeu_si512(dst + 16 * i, bf16_pairs(a, b));
  }
}

// W: uint32_t, bf16 pairs; bytes (int8, FP8) packed [N/16][K][16] with a scale per column
// (``scale``, in the epilogue); block-wise FP8, bytes with a scale per column and group of
// ``group`` inputs (``scale``: float32 [N/16][K/group][16]); MXFP4 pairs with its scales
// (``scale``, gemm_pack_mxfp4's); or int4 pairs [N/16][K/2][16] with a scale and a zero point per
// column and group (``group_scales``, ``zeros``: bf16, the same layout). Quantized weights become
// bf16 pairs a pair of vectors at a time, once per chunk of rows. ``scratch``: this thread's
// amx_scratch(k), where amx_needs_scratch; null: allocated here.
template <typename O, bool Gated, typename W = uint32_t>
void amx_part(int t, int nt, const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const W* wp, int64_t n,
              const float* bias, O* y, int64_t ldy, const float* scale = nullptr,
              const uint16_t* group_scales = nullptr, const uint16_t* zeros = nullptr, int64_t group = 0,
              uint32_t* scratch = nullptr) {
  constexpr bool int4 = std::is_same_v<W, Int4Pair>;
  constexpr bool blocks = std::is_same_v<W, Fp8Block>;
  constexpr bool mxfp4 = std::is_same_v<W, Fp4Pair>;
  constexpr bool quantized = !std::is_same_v<W, uint32_t>;
  constexpr bool bytes = quantized && !int4 && !blocks && !mxfp4;
  const int64_t vectors = (n + 15) / 16;
  const int64_t unit = Gated ? 2 : 1;
  const int64_t vstride = bytes || blocks ? k * 16 : k / 2 * 16;  // W per vector
  const int64_t half = k / 2 * 16;  // uint32 per widened vector
  const int64_t steps = k / 32;
  const int64_t lo = vectors / unit * t / nt * unit, hi = vectors / unit * (t + 1) / nt * unit;
  if (lo >= hi || m == 0) return;
  std::unique_ptr<uint32_t[]> own;
  if (!scratch && amx_needs_scratch<W>(m)) {
    own.reset(new uint32_t[amx_scratch(k)]);
    scratch = own.get();
  }
  uint16_t* const pad = reinterpret_cast<uint16_t*>(scratch);  // a last block's rows, zero-padded
  // quantized weights: two pairs of vectors as bf16 pairs, the one being multiplied and the next
  uint32_t* const widened[2] = {quantized ? scratch + 16 * k : nullptr,
                                 quantized ? scratch + 16 * k + 2 * half : nullptr};
  // the pairs [i0, i1) of vector v's weights as bf16 pairs into dst (vector v's own widened slot)
  auto widen = [&](int64_t v, int64_t i0, int64_t i1, uint32_t* dst) {
    const W* src = wp + v * vstride;
    if constexpr (bytes) {
      bytes_as_pairs(src, i0, i1, dst);
    } else if constexpr (blocks) {
      fp8_blocks_as_pairs(src, i0, i1, group, scale + v * (k / group * 16), dst);
    } else if constexpr (mxfp4) {
      mxfp4_as_pairs(src, i0, i1, scale + v * (k / 32 * 16), dst);
    } else if constexpr (int4) {
      const int64_t per_vector = k / group * 16;
      int4_as_pairs(src, i0, i1, group, group_scales + v * per_vector, zeros ? zeros + v * per_vector : nullptr,
                    dst);
    }
  };
  // of the pair at v (cols vectors), the share [f0, f1) of its cols * k / 2 pairs, into dst
  auto widen_share = [&](int64_t v, int cols, int64_t f0, int64_t f1, uint32_t* dst) {
    for (int c = 0; c < cols; ++c) {
      const int64_t i0 = std::max<int64_t>(f0 - c * (k / 2), 0), i1 = std::min<int64_t>(f1 - c * (k / 2), k / 2);
      if (i0 < i1) widen(v + c, i0, i1, dst + c * half);
    }
  };
  auto cols_at = [&](int64_t v) { return v >= hi ? 0 : hi - v >= 2 ? 2 : 1; };  // vectors of the pair at v
  batchgen::configure_full_tiles();
  alignas(64) float acc[32][32];
  for (int64_t mc = 0; mc < m; mc += kAmxChunkRows) {
    const int64_t mend = std::min(m, mc + kAmxChunkRows);
    // the chunk's last block, where it is partial (not 16 rows), zero-padded once for every pair
    const int64_t tail = (mend - mc) % 32, tail_row = mend - tail;
    if (tail && tail != 16) {
      std::memset(pad, 0, static_cast<size_t>(32 * k) * sizeof(uint16_t));
      for (int64_t r = 0; r < tail; ++r) std::memcpy(pad + r * k, x + (tail_row + r) * ldx, k * sizeof(uint16_t));
    }
    // Quantized weights are widened a pair ahead: the next pair's share by share between the tile
    // products of this pair's row blocks, whose instructions run meanwhile on the tile unit
    if constexpr (quantized) widen_share(lo, cols_at(lo), 0, cols_at(lo) * (k / 2), widened[0]);
    int cur = 0;
    const int64_t blocks_in_chunk = (mend - mc + 31) / 32;
    for (int64_t v = lo; v < hi; v += 2, cur ^= 1) {
      const int cols = cols_at(v);
      const W* src = wp + v * vstride;
      const uint32_t* w0;
      if constexpr (quantized) w0 = widened[cur];
      else w0 = src;
      const uint32_t* w1 = w0 + half;
      const int next_cols = cols_at(v + 2);
      const int64_t next_pairs = next_cols * (k / 2), slots = blocks_in_chunk * steps;
      int64_t slot = 0;
      // the weights ahead prefetched into L2 during the first row block: quantized, the pair after
      // the next one (the next one's are read meanwhile by its widening); bf16, the next one
      const int64_t ahead = quantized ? 4 : 2;
      const char* next = reinterpret_cast<const char*>(src + ahead * vstride);
      const int64_t next_lines =
          v + ahead < hi ? std::min<int64_t>(2, hi - v - ahead) * vstride * static_cast<int64_t>(sizeof(W)) / 64 : 0;
      const int64_t per_step = (next_lines + steps - 1) / steps;
      const int lastn = (v + cols == vectors && n % 16) ? static_cast<int>(n % 16) : 16;
      for (int64_t mb = mc; mb < mend; mb += 32) {
        const int64_t rows = std::min<int64_t>(32, mend - mb);
        const uint16_t* a = x + mb * ldx;
        int64_t lda = ldx;
        if (rows < 32 && rows != 16) {
          a = pad;
          lda = k;
        }
        const bool two = rows > 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          if (mb == mc && per_step)
            for (int64_t i = s * per_step; i < std::min(next_lines, (s + 1) * per_step); ++i)
              _mm_prefetch(next + 64 * i, _MM_HINT_T1);
          _tile_loadd(4, a + 32 * s, lda * 2);
          _tile_loadd(6, w0 + 256 * s, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (cols == 2) {
            _tile_loadd(7, w1 + 256 * s, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two) {
            _tile_loadd(5, a + 16 * lda + 32 * s, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (cols == 2) _tile_dpbf16ps(3, 5, 7);
          }
          if constexpr (quantized) {
            if (next_cols) {
              widen_share(v + 2, next_cols, slot * next_pairs / slots, (slot + 1) * next_pairs / slots,
                          widened[cur ^ 1]);
              ++slot;
            }
          }
        }
        _tile_stored(0, &acc[0][0], 128);
        _tile_stored(1, &acc[0][16], 128);
        if (two) {
          _tile_stored(2, &acc[16][0], 128);
          _tile_stored(3, &acc[16][16], 128);
        }
        amx_epilogue<O, Gated>(acc, rows, cols, bytes ? scale + v * 16 : nullptr, bias ? bias + v * 16 : nullptr,
                               y + mb * ldy + v / unit * 16, ldy, lastn);
      }
    }
  }
  _tile_release();
}

// Whether a bf16 GEMM of inner size k runs on amx_part
inline bool amx_gemm(int64_t k) { return k % 32 == 0 && batchgen::amx_permitted() && amx_enabled; }

#endif

#if defined(BATCHGEN_GEMM_AMX) && defined(__AMX_INT8__)
#define BATCHGEN_GEMM_AMX_INT8 1

// W8A8 on AMX-INT8 tiles. Each row of x is rounded to int8 on its own grid (s = max|x| / 127,
// q = x / s to the nearest, clamped: round_tokens_int8's values), the int8 x int8 products are
// summed exactly in int32 (_tile_dpbssd), and the epilogue scales each sum by its row's s and its
// column's scale. The packed weight is the tiles' B operand: a column vector's inputs in quads,
// [ceil(n/16)][kp/4][16][4] bytes (kp: k rounded up to 64, zeros past k), so 64 inputs of one
// vector are one 16 x 64-byte tile, 1 KiB contiguous. Blocks, prefetch and row chunks are
// amx_part's (32 rows x 2 vectors, four int32 products); per 64 inputs, four loads and four tile
// products, twice the inputs of a bf16 step in half the weight bytes. The rounded rows live in one
// buffer of kp bytes a row, zero rows up to a whole block, so partial blocks need no copy.
constexpr int64_t kInt8Depth = 64;

inline int64_t int8_depth(int64_t k) { return (k + kInt8Depth - 1) / kInt8Depth * kInt8Depth; }

// x's row (k values) rounded to int8 into q (kp bytes, zeros past k); returns its scale
template <typename T>
float round_row_int8(const T* x, int64_t k, int64_t kp, int8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps((__m512)batchgen::load16(x + i)));
  float a = _mm512_reduce_max_ps(amax);
  for (; i < k; ++i) a = std::max(a, std::fabs(batchgen::load(x + i)));
  const float s = std::max(a, 1e-8f) / 127.0f;
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
  for (i = 0; i + 16 <= k; i += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps((__m512)batchgen::load16(x + i), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(v));
  }
  for (; i < k; ++i)
    q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(batchgen::load(x + i) / s), -128.0f), 127.0f));
  std::memset(q + k, 0, static_cast<size_t>(kp - k));
  return s;
}

template <typename O>
void amx_int8_part(int t, int nt, const int8_t* q, int64_t kp, int64_t m, const float* sx, const int8_t* wp,
                   int64_t n, const float* scale, const float* bias, O* y, int64_t ldy) {
  const int64_t vectors = (n + 15) / 16;
  const int64_t vstride = kp * 16;  // bytes per vector
  const int64_t steps = kp / kInt8Depth;
  const int64_t lo = vectors * t / nt, hi = vectors * (t + 1) / nt;
  if (lo >= hi || m == 0) return;
  batchgen::configure_full_tiles();
  alignas(64) int32_t acc[32][32];
  for (int64_t mc = 0; mc < m; mc += kAmxChunkRows) {
    const int64_t mend = std::min(m, mc + kAmxChunkRows);
    for (int64_t v = lo; v < hi; v += 2) {
      const int cols = hi - v >= 2 ? 2 : 1;
      const int8_t* w0 = wp + v * vstride;
      const int8_t* w1 = w0 + vstride;
      // the next pair's weights, prefetched into L2 during the first row block
      const char* next = reinterpret_cast<const char*>(w0 + cols * vstride);
      const int64_t next_lines = v + 2 < hi ? std::min<int64_t>(2, hi - v - 2) * vstride / 64 : 0;
      const int64_t per_step = (next_lines + steps - 1) / steps;
      const int lastn = (v + cols == vectors && n % 16) ? static_cast<int>(n % 16) : 16;
      for (int64_t mb = mc; mb < mend; mb += 32) {
        const int64_t rows = std::min<int64_t>(32, mend - mb);
        const int8_t* a = q + mb * kp;
        const bool two = rows > 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          if (mb == mc && per_step)
            for (int64_t i = s * per_step; i < std::min(next_lines, (s + 1) * per_step); ++i)
              _mm_prefetch(next + 64 * i, _MM_HINT_T1);
          _tile_loadd(4, a + kInt8Depth * s, kp);
          _tile_loadd(6, w0 + 1024 * s, 64);
          _tile_dpbssd(0, 4, 6);
          if (cols == 2) {
            _tile_loadd(7, w1 + 1024 * s, 64);
            _tile_dpbssd(1, 4, 7);
          }
          if (two) {
            _tile_loadd(5, a + 16 * kp + kInt8Depth * s, kp);
            _tile_dpbssd(2, 5, 6);
            if (cols == 2) _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, &acc[0][0], 128);
        _tile_stored(1, &acc[0][16], 128);
        if (two) {
          _tile_stored(2, &acc[16][0], 128);
          _tile_stored(3, &acc[16][16], 128);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 sr = _mm512_set1_ps(sx[mb + r]);
          for (int c = 0; c < cols; ++c) {
            const int64_t col = (v + c) * 16;
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc[r] + 16 * c)), sr);
            f = _mm512_mul_ps(f, _mm512_loadu_ps(scale + col));
            if (bias) f = _mm512_add_ps(f, _mm512_loadu_ps(bias + col));
            const __mmask16 mask = lanes(c == cols - 1 ? lastn : 16);
            O* out = y + (mb + r) * ldy + col;
            if constexpr (std::is_same_v<O, float>)
              _mm512_mask_storeu_ps(out, mask, f);
            else
              _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(f));
          }
        }
      }
    }
  }
  _tile_release();
}

// y [m, n] = W8A8 of x [m, k] (T) and the tile-packed weight; rounds x's rows, then the tiles
template <typename T>
void w8a8_amx(const T* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n, const float* scale,
              const float* bias, T* y, int64_t ldy, int threads) {
  BG_EXPECT(x && wp && scale && y && m >= 0 && k > 0 && n > 0 && (ldx >= k || m <= 1) && threads > 0);
  const int64_t kp = int8_depth(k), padded = (m + 31) / 32 * 32;
  std::unique_ptr<int8_t[]> q(new int8_t[padded * kp]);  // the rounded rows
  std::unique_ptr<float[]> sx(new float[std::max<int64_t>(m, 1)]);
  std::memset(q.get() + m * kp, 0, static_cast<size_t>((padded - m) * kp));
  int8_t* qd = q.get();
  float* sd = sx.get();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t r = m * t / nt; r < m * (t + 1) / nt; ++r) sd[r] = round_row_int8(x + r * ldx, k, kp, qd + r * kp);
#pragma omp barrier
    amx_int8_part<T>(t, nt, qd, kp, m, sd, wp, n, scale, bias, y, ldy);
  }
}

#endif

#ifdef BATCHGEN_GEMM_F32

// All m rows against C column vectors: full blocks of kRows, then the remainder, each block
// prefetching its share of the next panel, [next, next_end). O: the output's type (T, or float for
// bf16 widened). W: float, bf16 pairs (uint32_t), or quantized with ``scale``: FP8 or int8 bytes
// (uint8_t / int8_t, a scale per column), MXFP4 pairs (Fp4Pair, a scale per column and 32 inputs),
// block-wise FP8 bytes (Fp8Block, a scale per column and ``group`` inputs).
template <typename T, typename W, int C, typename O, bool Gated>
void column_panel(const T* x, int64_t ldx, int64_t m, int64_t k, const W* wp, int64_t vstride, const float* bias,
                  O* y, int64_t ldy, int lastn, const W* next, const W* next_end, const float* scale, int64_t group) {
  const int64_t blocks = (m + kRows - 1) / kRows;
  const int64_t steps = std::is_same_v<W, uint32_t> || std::is_same_v<W, Fp4Pair> ? k / 2 : k;
  const char* lo = reinterpret_cast<const char*>(next);
  const char* hi = reinterpret_cast<const char*>(next_end);
  auto run = [&](auto rows, int64_t r) {
    constexpr int R = decltype(rows)::value;
    const Prefetch pf(lo, hi, r / kRows, blocks, steps);
    // with nothing to prefetch, the block without the prefetch's step in its K loop
#ifdef BATCHGEN_GEMM_QUANT
    if constexpr (std::is_same_v<W, Fp4Pair>) {
      static_assert(!Gated, "MXFP4 weights are not packed gated");
      const int64_t sstride = k / 32 * 16;
      if (pf.per)
        block_mxfp4<R, C, T, O, true>(x + r * ldx, ldx, wp, k, vstride, scale, sstride, bias, y + r * ldy, ldy, lastn, pf);
      else
        block_mxfp4<R, C, T, O, false>(x + r * ldx, ldx, wp, k, vstride, scale, sstride, bias, y + r * ldy, ldy, lastn, pf);
    } else if constexpr (std::is_same_v<W, uint8_t> || std::is_same_v<W, int8_t> || std::is_same_v<W, Fp8Block>) {
      static_assert(!Gated, "FP8 and int8 weights are not packed gated");
      if (pf.per)
        block_bytes<R, C, T, W, O, true>(x + r * ldx, ldx, wp, k, vstride, scale, group, bias, y + r * ldy, ldy, lastn,
                                         pf);
      else
        block_bytes<R, C, T, W, O, false>(x + r * ldx, ldx, wp, k, vstride, scale, group, bias, y + r * ldy, ldy,
                                          lastn, pf);
    } else
#endif
#ifdef BATCHGEN_GEMM_BF16
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (pf.per)
        block_bf16<R, C, O, Gated, true>(x + r * ldx, ldx, wp, k, vstride, bias, y + r * ldy, ldy, lastn, pf);
      else
        block_bf16<R, C, O, Gated, false>(x + r * ldx, ldx, wp, k, vstride, bias, y + r * ldy, ldy, lastn, pf);
    } else
#endif
      if constexpr (std::is_same_v<T, float> && std::is_same_v<O, float>) {
      if (pf.per)
        block_f32<R, C, Gated, true>(x + r * ldx, ldx, wp, k, vstride, bias, y + r * ldy, ldy, lastn, pf);
      else
        block_f32<R, C, Gated, false>(x + r * ldx, ldx, wp, k, vstride, bias, y + r * ldy, ldy, lastn, pf);
    }
  };
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) run(std::integral_constant<int, kRows>{}, r);
  switch (m - r) {
    case 1: run(std::integral_constant<int, 1>{}, r); break;
    case 2: run(std::integral_constant<int, 2>{}, r); break;
    case 3: run(std::integral_constant<int, 3>{}, r); break;
    case 4: run(std::integral_constant<int, 4>{}, r); break;
    case 5: run(std::integral_constant<int, 5>{}, r); break;
    default: break;
  }
}

// Whether gemm_part runs W on amx_part (bf16 activations, k a multiple of 32, the tiles permitted)
template <typename T, typename W, bool Gated>
bool on_amx(int64_t k, int64_t group) {
#ifdef BATCHGEN_GEMM_AMX
  if constexpr (std::is_same_v<W, uint32_t>) return amx_gemm(k);
  if constexpr (std::is_same_v<T, uint16_t> && !Gated && !std::is_same_v<W, float>)
    return amx_gemm(k) && (!std::is_same_v<W, Fp8Block> || group % 2 == 0);
#endif
  (void)k, (void)group;
  return false;
}

// Thread t of nt's share of one GEMM: a contiguous range of column vectors (of gate / up pairs
// where Gated: n a multiple of 32, y [m, n / 2]). Called inside a parallel region.
template <typename T, typename W, typename O, bool Gated = false>
void gemm_part(int t, int nt, const T* x, int64_t ldx, int64_t m, int64_t k, const W* wp, int64_t n,
               const float* bias, O* y, int64_t ldy, const float* scale = nullptr, int64_t group = 0,
               uint32_t* scratch = nullptr) {
#ifdef BATCHGEN_GEMM_AMX
  // bf16 on the tiles; int8, FP8 and MXFP4 (exact) and block-wise FP8 (each weight times its
  // block's scale, rounded) with bf16 activations widened to bf16 pairs, then the same tiles
  if constexpr (std::is_same_v<W, uint32_t>) {
    if (on_amx<T, W, Gated>(k, group)) return amx_part<O, Gated>(t, nt, x, ldx, m, k, wp, n, bias, y, ldy,
                                                                  nullptr, nullptr, nullptr, 0, scratch);
  } else if constexpr (std::is_same_v<T, uint16_t> && !Gated && !std::is_same_v<W, float>) {
    if (on_amx<T, W, Gated>(k, group))
      return amx_part<O, false, W>(t, nt, x, ldx, m, k, wp, n, bias, y, ldy, scale, nullptr, nullptr, group, scratch);
  }
#else
  (void)scratch;
#endif
  const int64_t vectors = (n + 15) / 16;
  const int64_t unit = Gated ? 2 : 1;  // vectors that stay together
  constexpr bool pairs = std::is_same_v<W, uint32_t> || std::is_same_v<W, Fp4Pair>;  // an element holds a K pair
  const int64_t vstride = pairs ? k / 2 * 16 : k * 16;  // W elements per vector
  // Prefetching the next panel pays where both panels stay in L2 beside x's rows; with more rows
  // (prefill chunks) a panel's reuse hides the first block's wait anyway, and the rows streaming
  // through L2 would evict the prefetched lines before their use.
  const int64_t panel_bytes = kCols * vstride * static_cast<int64_t>(sizeof(W));
  const bool prefetch = 2 * panel_bytes + m * k * static_cast<int64_t>(sizeof(T)) <= l2_budget();
  const int64_t lo = vectors / unit * t / nt * unit, hi = vectors / unit * (t + 1) / nt * unit;
  for (int64_t v = lo; v < hi; v += kCols) {
    const int cn = static_cast<int>(std::min<int64_t>(kCols, hi - v));
    const int lastn = (v + cn == vectors && n % 16) ? static_cast<int>(n % 16) : 16;
    const W* w = wp + v * vstride;
    // the next panel of this thread's range (none after its last, none where it would not stay
    // in L2 beside this one and the rows)
    const W* next = w + cn * vstride;
    const W* next_end = prefetch ? wp + std::min<int64_t>(hi, v + cn + kCols) * vstride : next;
    const float* b = bias ? bias + v * 16 : nullptr;
    // FP8: a scale per column; MXFP4: per column and group of 32 inputs; block-wise FP8: of ``group``
    const int64_t per_vector = std::is_same_v<W, Fp4Pair> ? k / 32 * 16 : std::is_same_v<W, Fp8Block> ? k / group * 16 : 16;
    const float* sc = scale ? scale + v * per_vector : nullptr;
    O* out = y + v / unit * 16;
    switch (cn) {
      case 4: column_panel<T, W, 4, O, Gated>(x, ldx, m, k, w, vstride, b, out, ldy, lastn, next, next_end, sc, group); break;
      case 2: column_panel<T, W, 2, O, Gated>(x, ldx, m, k, w, vstride, b, out, ldy, lastn, next, next_end, sc, group); break;
      case 3:
        if constexpr (!Gated)
          column_panel<T, W, 3, O, false>(x, ldx, m, k, w, vstride, b, out, ldy, lastn, next, next_end, sc, group);
        break;
      default:
        if constexpr (!Gated)
          column_panel<T, W, 1, O, false>(x, ldx, m, k, w, vstride, b, out, ldy, lastn, next, next_end, sc, group);
        break;
    }
  }
}

// The threads that one GEMM of n columns can use (at least a column vector, a pair where Gated, each).
template <bool Gated>
int threads_for(int64_t n, int threads) {
  const int64_t units = (n + 15) / 16 / (Gated ? 2 : 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, units)));
}

template <typename T, typename W, typename O, bool Gated = false>
void gemm(const T* x, int64_t ldx, int64_t m, int64_t k, const W* wp, int64_t n, const float* bias, O* y,
          int64_t ldy, int threads, const float* scale = nullptr, int64_t group = 0) {
  BG_EXPECT(x && wp && y && m >= 0 && k > 0 && n > 0 && (ldx >= k || m <= 1) && threads > 0);
  BG_EXPECT((std::is_same_v<W, uint8_t> || std::is_same_v<W, int8_t> || std::is_same_v<W, Fp4Pair> ||
             std::is_same_v<W, Fp8Block>) == (scale != nullptr));
  BG_EXPECT((!std::is_same_v<W, Fp8Block> || (group > 0 && k % group == 0)));
  const int nt = threads_for<Gated>(n, threads);
  std::unique_ptr<uint32_t[]> scratch;  // amx_part's, one share per thread, from this thread's arena
#ifdef BATCHGEN_GEMM_AMX
  if (on_amx<T, W, Gated>(k, group) && amx_needs_scratch<W>(m)) scratch.reset(new uint32_t[nt * amx_scratch(k)]);
#endif
  uint32_t* const shares = scratch.get();
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    gemm_part<T, W, O, Gated>(t, omp_get_num_threads(), x, ldx, m, k, wp, n, bias, y, ldy, scale, group,
                              shares ? shares + t * amx_scratch(k) : nullptr);
  }
}

// A mixture-of-experts layer's experts (SwiGLU, gate_up packed gated) in one parallel region: the
// (token, slot) pairs sorted by expert (stable: token order within an expert), their rows gathered,
// every expert's gate_up GEMM with silu(gate) * up in its pass, then every expert's down GEMM, then
// each token's weighted sum over its slots in float32 (slot order), rounded once. Each thread
// takes its share of the columns of every expert's GEMMs, so work splits evenly whatever the
// counts: one parallel region and three barriers a layer where one by one each expert took two
// parallel regions and two Python calls.
template <typename T, typename W>
int experts(const T* x, int64_t tokens, int64_t d, int64_t top_k, const int64_t* chosen, const float* weights,
             int64_t count_experts, const int64_t* gate_up, const int64_t* gate_up_bias, const int64_t* down,
             const int64_t* down_bias, int64_t inter, T* out, int threads) {
  const int64_t pairs = tokens * top_k;
  std::unique_ptr<int64_t[]> start(new int64_t[count_experts + 1]());
  for (int64_t j = 0; j < pairs; ++j) {
    if (chosen[j] < 0 || chosen[j] >= count_experts) return 2;
    ++start[chosen[j] + 1];
  }
  for (int64_t e = 0; e < count_experts; ++e) start[e + 1] += start[e];
  std::unique_ptr<int64_t[]> fill(new int64_t[count_experts]);
  std::copy(start.get(), start.get() + count_experts, fill.get());
  std::unique_ptr<int64_t[]> slot_of(new int64_t[pairs]);  // the sorted row of pair j
  std::unique_ptr<int64_t[]> token_of(new int64_t[pairs]);  // the token of sorted row r
  for (int64_t j = 0; j < pairs; ++j) {
    const int64_t r = fill[chosen[j]]++;
    slot_of[j] = r;
    token_of[r] = j / top_k;
  }
  std::unique_ptr<T[]> xs(new T[pairs * d]), hidden(new T[pairs * inter]), ys(new T[pairs * d]);
  auto weight = [](const int64_t* ptrs, int64_t e) { return reinterpret_cast<const W*>(ptrs[e]); };
  auto bias = [](const int64_t* ptrs, int64_t e) { return ptrs ? reinterpret_cast<const float*>(ptrs[e]) : nullptr; };
#pragma omp parallel num_threads(std::max(1, threads))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t r = pairs * t / nt; r < pairs * (t + 1) / nt; ++r)
      std::memcpy(xs.get() + r * d, x + token_of[r] * d, d * sizeof(T));
#pragma omp barrier
    for (int64_t e = 0; e < count_experts; ++e) {
      const int64_t m = start[e + 1] - start[e];
      if (m)
        gemm_part<T, W, T, true>(t, nt, xs.get() + start[e] * d, d, m, d, weight(gate_up, e), 2 * inter,
                                 bias(gate_up_bias, e), hidden.get() + start[e] * inter, inter);
    }
#pragma omp barrier
    for (int64_t e = 0; e < count_experts; ++e) {
      const int64_t m = start[e + 1] - start[e];
      if (m)
        gemm_part<T, W, T>(t, nt, hidden.get() + start[e] * inter, inter, m, inter, weight(down, e), d,
                           bias(down_bias, e), ys.get() + start[e] * d, d);
    }
#pragma omp barrier
    for (int64_t i = tokens * t / nt; i < tokens * (t + 1) / nt; ++i) {
      for (int64_t c = 0; c < d; c += 16) {
        const int64_t width = std::min<int64_t>(16, d - c);
        float acc[16] = {};
        for (int64_t s = 0; s < top_k; ++s) {
          const float w = weights[i * top_k + s];
          const T* y = ys.get() + slot_of[i * top_k + s] * d + c;
          for (int64_t j = 0; j < width; ++j) acc[j] += w * batchgen::load(y + j);
        }
        for (int64_t j = 0; j < width; ++j) batchgen::store(out + i * d + c + j, acc[j]);
      }
    }
  }
  return 0;
}
#endif

// The quantized GEMMs' entry points: y [m, n] = (x [m, k] @ W^T) * scale + bias with W packed by
// gemm_pack_bytes (FP8 or int8) or gemm_pack_mxfp4; scale and bias float32, padded to whole
// vectors (bias may be null). FP8's scale is the column's times 2^8 (the widening's factor); int8's
// the column's; MXFP4's gemm_pack_mxfp4's; block-wise FP8's [ceil(n/16)][k/group][16], each the
// column's and group's times 2^8. 1 where the library has no such kernel (or k is not a multiple of
// 32 for MXFP4, of ``group`` for block-wise FP8).
template <typename T, typename W>
int quant_gemm(const T* x, int64_t ldx, int64_t m, int64_t k, const void* wp, int64_t n, const float* scale,
               const float* bias, T* y, int64_t ldy, int threads, int64_t group = 0) {
#ifdef BATCHGEN_GEMM_QUANT
  if (std::is_same_v<W, Fp4Pair> && k % 32) return 1;
  if (std::is_same_v<W, Fp8Block> && (group <= 0 || k % group)) return 1;
  gemm<T, W, T>(x, ldx, m, k, static_cast<const W*>(wp), n, bias, y, ldy, threads, scale, group);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)scale, (void)bias, (void)y, (void)ldy, (void)threads;
  (void)group;
  return 1;
#endif
}

// The W8A8 entry points (gemm_w8a8_amx_*): 1 where the library has no such kernel or the tiles are refused
template <typename T>
int w8a8_entry(const T* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n, const float* scale,
               const float* bias, T* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_AMX_INT8
  if (!batchgen::amx_permitted()) return 1;
  w8a8_amx<T>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)scale, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

// W [n, k] (row-major) into [ceil(n/16)][k][16]: each vector of 16 columns K-major, columns past n zero
template <typename E>
[[maybe_unused]] void pack_columns(const E* w, int64_t n, int64_t k, E* out) {
  const int64_t vectors = (n + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < vectors; ++v)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = v * 16 + j;
        out[(v * k + i) * 16 + j] = col < n ? w[col * k + i] : E{};
      }
}

}  // namespace

extern "C" {

// Whether bf16 GEMMs run on AMX tiles (where K is a multiple of 32): ``on`` 0 / 1 sets it, -1
// only asks. 0 where the tiles were not compiled in or Linux does not grant them.
int gemm_amx(int on) {
#ifdef BATCHGEN_GEMM_AMX
  if (on >= 0) amx_enabled = on != 0;
  return amx_enabled && batchgen::amx_permitted() ? 1 : 0;
#else
  (void)on;
  return 0;
#endif
}

// W [n, k] (row-major) into the packed layout: float32 [ceil(n/16)][k][16].
int gemm_pack_f32(const float* w, int64_t n, int64_t k, float* out) {
#ifdef BATCHGEN_GEMM_F32
  pack_columns(w, n, k, out);
  return 0;
#else
  (void)w, (void)n, (void)k, (void)out;
  return 1;
#endif
}

// W [n, k] bf16 (k even) into [ceil(n/16)][k/2][16] pairs (the first of a pair in the low half).
int gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint32_t* out) {
#ifdef BATCHGEN_GEMM_BF16
  if (k % 2) return 1;
  const int64_t vectors = (n + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < vectors; ++v)
    for (int64_t i = 0; i < k / 2; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = v * 16 + j;
        const uint32_t lo = col < n ? w[col * k + 2 * i] : 0, hi = col < n ? w[col * k + 2 * i + 1] : 0;
        out[(v * (k / 2) + i) * 16 + j] = lo | (hi << 16);
      }
  return 0;
#else
  (void)w, (void)n, (void)k, (void)out;
  return 1;
#endif
}

// y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) @ W^T + bias (float32 [n] or null).
int gemm_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const float* wp, int64_t n, const float* bias,
             float* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_F32
  gemm<float, float, float>(x, ldx, m, k, wp, n, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

int gemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint32_t* wp, int64_t n, const float* bias,
              uint16_t* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_BF16
  if (k % 2) return 1;
  gemm<uint16_t, uint32_t, uint16_t>(x, ldx, m, k, wp, n, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

// silu(gate) * up [m, n / 2] from W packed gated ([gate; up] rows, n a multiple of 32, gate and up
// vectors alternating; batchgen/model/linear.py reorders them before packing). 1 otherwise.
int gemm_gated_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const float* wp, int64_t n, const float* bias,
                   float* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_F32
  if (n % 32) return 1;
  gemm<float, float, float, true>(x, ldx, m, k, wp, n, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

int gemm_gated_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint32_t* wp, int64_t n,
                    const float* bias, uint16_t* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_BF16
  if (k % 2 || n % 32) return 1;
  gemm<uint16_t, uint32_t, uint16_t, true>(x, ldx, m, k, wp, n, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

// gemm_bf16 with y float32: each output rounded to bf16, then widened.
int gemm_bf16_widened(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint32_t* wp, int64_t n,
                      const float* bias, float* y, int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_BF16
  if (k % 2) return 1;
  gemm<uint16_t, uint32_t, float>(x, ldx, m, k, wp, n, bias, y, ldy, threads);
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

// Whether W8A8 runs on AMX-INT8 tiles here (compiled in, and Linux grants the tiles).
int gemm_amx_int8() {
#ifdef BATCHGEN_GEMM_AMX_INT8
  return batchgen::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// int8 W [n, k] into the tiles' layout, [ceil(n/16)][kp/4][16][4] (kp: k rounded up to 64; zeros
// past n and k).
int gemm_pack_int8_tiles(const int8_t* w, int64_t n, int64_t k, int8_t* out) {
  const int64_t vectors = (n + 15) / 16, quads = (k + 63) / 64 * 16;
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < vectors; ++v)
    for (int64_t i = 0; i < quads; ++i)
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t b = 0; b < 4; ++b) {
          const int64_t col = v * 16 + j, in = 4 * i + b;
          out[((v * quads + i) * 16 + j) * 4 + b] = col < n && in < k ? w[col * k + in] : 0;
        }
  return 0;
}

// W8A8: y [m, n] = (round_tokens_int8(x) @ W^T) * scale + bias, the rounded rows and the weight
// multiplied as int8 on AMX tiles, W packed by gemm_pack_int8_tiles; scale and bias float32 per
// column, padded to whole vectors. 1 where the library has no such kernel or the tiles are refused.
int gemm_w8a8_amx_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n,
                      const float* scale, const float* bias, float* y, int64_t ldy, int threads) {
  return w8a8_entry<float>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}
int gemm_w8a8_amx_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n,
                       const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
  return w8a8_entry<uint16_t>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}

// int4 codes [n, k] (bytes: unsigned 0-15 where ``offset`` is 0, signed -8..7 where it is 8) into
// [ceil(n/16)][k/2][16] bytes of code + offset, in Int4Pair's order (a K pair's byte j: input j % 2
// of column j / 2 low, of column 8 + j / 2 high); columns past n zero. 1 for an odd k.
int gemm_pack_int4(const uint8_t* q, int64_t n, int64_t k, int offset, uint8_t* out) {
  if (k % 2) return 1;
  const int64_t vectors = (n + 15) / 16, pairs = k / 2;
  auto code = [&](int64_t col, int64_t in) {
    const int value = offset ? static_cast<int>(static_cast<int8_t>(q[col * k + in])) : q[col * k + in];
    return static_cast<uint8_t>((value + offset) & 15);
  };
  // byte j of a pair: input 2i + j % 2 of column j / 2 (low nibble) and of column 8 + j / 2 (high)
  auto nibble = [&](int64_t col, int64_t in) { return col < n ? code(col, in) : static_cast<uint8_t>(0); };
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < vectors; ++v)
    for (int64_t i = 0; i < pairs; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = v * 16 + j / 2, in = 2 * i + j % 2;
        out[(v * pairs + i) * 16 + j] = static_cast<uint8_t>(nibble(col, in) | nibble(col + 8, in) << 4);
      }
  return 0;
}

// int4 weight-only in bf16 on AMX tiles: y [m, n] = x @ W^T + bias with W's codes [ceil(n/16)][k/2][16]
// (bytes of two unsigned codes, gemm_pack_int4's order), scales and zero points bf16
// [ceil(n/16)][k/group][16] (zero points null: 8 for all), each weight (code - zero) * scale rounded to bf16. 1 where the tiles do
// not run (not compiled in, refused or turned off; k not a multiple of 32; group odd or not
// dividing k).
int gemm_int4_amx_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                       const uint16_t* scales, const uint16_t* zeros, int64_t group, const float* bias, uint16_t* y,
                       int64_t ldy, int threads) {
#ifdef BATCHGEN_GEMM_AMX
  if (!amx_gemm(k) || group <= 0 || group % 2 || k % group) return 1;
  BG_EXPECT(x && wp && scales && y && m >= 0 && n > 0 && (ldx >= k || m <= 1) && threads > 0);
  const Int4Pair* w = reinterpret_cast<const Int4Pair*>(wp);
  const int nt = threads_for<false>(n, threads);
  std::unique_ptr<uint32_t[]> scratch(new uint32_t[nt * amx_scratch(k)]);  // from this thread's arena
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    amx_part<uint16_t, false, Int4Pair>(t, omp_get_num_threads(), x, ldx, m, k, w, n, bias, y, ldy, nullptr, scales,
                                        zeros, group, scratch.get() + t * amx_scratch(k));
  }
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)n, (void)scales, (void)zeros, (void)group, (void)bias;
  (void)y, (void)ldy, (void)threads;
  return 1;
#endif
}

// FP8 (E4M3) or int8 W [n, k] bytes into [ceil(n/16)][k][16] (columns past n zero).
int gemm_pack_bytes(const uint8_t* w, int64_t n, int64_t k, uint8_t* out) {
#ifdef BATCHGEN_GEMM_QUANT
  pack_columns(w, n, k, out);
  return 0;
#else
  (void)w, (void)n, (void)k, (void)out;
  return 1;
#endif
}

// MXFP4 W: blocks [n, k / 2] (a byte: two E2M1 codes, the first in the low nibble) and biased
// exponents [n, k / 32] into [ceil(n/16)][k/2][16] bytes and float32 scales [ceil(n/16)][k/32][16]
// (2^(exponent - 127) times 2^14). 1 where k is not a multiple of 32 or an exponent is above 240
// (a scale the widening's factor would overflow).
int gemm_pack_mxfp4(const uint8_t* blocks, const uint8_t* exponents, int64_t n, int64_t k, uint8_t* out,
                    float* scales) {
#ifdef BATCHGEN_GEMM_QUANT
  if (k % 32) return 1;
  for (int64_t i = 0; i < n * (k / 32); ++i)
    if (exponents[i] > 240) return 1;
  const int64_t vectors = (n + 15) / 16, groups = k / 32;
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < vectors; ++v) {
    for (int64_t i = 0; i < k / 2; ++i)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = v * 16 + j;
        out[(v * (k / 2) + i) * 16 + j] = col < n ? blocks[col * (k / 2) + i] : 0;
      }
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t col = v * 16 + j;
        const uint32_t bits = col < n ? static_cast<uint32_t>(exponents[col * groups + g] + 14) << 23 : 0;
        std::memcpy(scales + (v * groups + g) * 16 + j, &bits, sizeof bits);
      }
  }
  return 0;
#else
  (void)blocks, (void)exponents, (void)n, (void)k, (void)out, (void)scales;
  return 1;
#endif
}

int gemm_fp8_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                 const float* scale, const float* bias, float* y, int64_t ldy, int threads) {
  return quant_gemm<float, uint8_t>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}
int gemm_fp8_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                  const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
  return quant_gemm<uint16_t, uint8_t>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}
// block-wise FP8: ``scales`` per column and group of ``group`` inputs (see quant_gemm)
int gemm_fp8_block_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                       const float* scales, int64_t group, const float* bias, float* y, int64_t ldy, int threads) {
  return quant_gemm<float, Fp8Block>(x, ldx, m, k, wp, n, scales, bias, y, ldy, threads, group);
}
int gemm_fp8_block_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                        const float* scales, int64_t group, const float* bias, uint16_t* y, int64_t ldy, int threads) {
  return quant_gemm<uint16_t, Fp8Block>(x, ldx, m, k, wp, n, scales, bias, y, ldy, threads, group);
}
int gemm_int8_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n,
                  const float* scale, const float* bias, float* y, int64_t ldy, int threads) {
  return quant_gemm<float, int8_t>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}
int gemm_int8_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const int8_t* wp, int64_t n,
                   const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads) {
  return quant_gemm<uint16_t, int8_t>(x, ldx, m, k, wp, n, scale, bias, y, ldy, threads);
}
int gemm_mxfp4_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                   const float* scales, const float* bias, float* y, int64_t ldy, int threads) {
  return quant_gemm<float, Fp4Pair>(x, ldx, m, k, wp, n, scales, bias, y, ldy, threads);
}
int gemm_mxfp4_bf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* wp, int64_t n,
                    const float* scales, const float* bias, uint16_t* y, int64_t ldy, int threads) {
  return quant_gemm<uint16_t, Fp4Pair>(x, ldx, m, k, wp, n, scales, bias, y, ldy, threads);
}

// A mixture-of-experts layer's routed experts (see experts above): x [tokens, d]; chosen / weights
// [tokens, top_k] (expert ids, routing weights); gate_up / down: each expert's packed weight
// (gate_up packed gated, 2 * inter columns over d; down d columns over inter) as addresses;
// biases likewise (float32 [2 * inter] / [d], an array of 0s or null for none); out [tokens, d].
// 2 for an expert id outside [0, count_experts), before anything is written.
int moe_experts_f32(const float* x, int64_t tokens, int64_t d, int64_t top_k, const int64_t* chosen,
                    const float* weights, int64_t count_experts, const int64_t* gate_up, const int64_t* gate_up_bias,
                    const int64_t* down, const int64_t* down_bias, int64_t inter, float* out, int threads) {
#ifdef BATCHGEN_GEMM_F32
  if (inter % 16) return 1;
  return experts<float, float>(x, tokens, d, top_k, chosen, weights, count_experts, gate_up, gate_up_bias, down,
                               down_bias, inter, out, threads);
#else
  (void)x, (void)tokens, (void)d, (void)top_k, (void)chosen, (void)weights, (void)count_experts, (void)gate_up;
  (void)gate_up_bias, (void)down, (void)down_bias, (void)inter, (void)out, (void)threads;
  return 1;
#endif
}

int moe_experts_bf16(const uint16_t* x, int64_t tokens, int64_t d, int64_t top_k, const int64_t* chosen,
                     const float* weights, int64_t count_experts, const int64_t* gate_up, const int64_t* gate_up_bias,
                     const int64_t* down, const int64_t* down_bias, int64_t inter, uint16_t* out, int threads) {
#ifdef BATCHGEN_GEMM_BF16
  if (inter % 16 || d % 2) return 1;
  return experts<uint16_t, uint32_t>(x, tokens, d, top_k, chosen, weights, count_experts, gate_up, gate_up_bias,
                                     down, down_bias, inter, out, threads);
#else
  (void)x, (void)tokens, (void)d, (void)top_k, (void)chosen, (void)weights, (void)count_experts, (void)gate_up;
  (void)gate_up_bias, (void)down, (void)down_bias, (void)inter, (void)out, (void)threads;
  return 1;
#endif
}

}  // extern "C"
