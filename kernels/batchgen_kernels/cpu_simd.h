// SIMD helpers shared by the CPU kernels: float32 / bfloat16 loads and stores, 16-float vectors
// (GCC vector extensions: AVX-512 registers where the compiler targets them), a vectorizable exp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "cpu_intrin.h"
#endif

// The entry points' preconditions (pointers set, sizes in range), checked in debug builds
// (BATCHGEN_KERNEL_DEBUG=1 builds with -DBATCHGEN_DEBUG): a failure prints the condition and aborts.
// The Python wrappers check the tensors themselves before every call (cpu_args.py).
#ifdef BATCHGEN_DEBUG
#define BG_EXPECT(cond) ((cond) ? (void)0 : batchgen::precondition_failed(#cond, __func__, __FILE__, __LINE__))
#else
#define BG_EXPECT(cond) ((void)0)
#endif

namespace batchgen {

[[noreturn]] inline void precondition_failed(const char* cond, const char* fn, const char* file, int line) {
  std::fprintf(stderr, "batchgen kernel %s: precondition failed: %s (%s:%d)\n", fn, cond, file, line);
  std::abort();
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch's conversion
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 (scores minus their running maximum), vectorizable: Cephes' expf polynomial
// after range reduction by powers of two; relative error about 2e-7. Below -87 it returns 0.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.0f;
  x = tiny ? -87.0f : x;
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float r2 = r * r;
  float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
             1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const uint16_t* p) {
  u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
  return (v16)wide;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The CPU's conversion instruction: round to nearest even as torch's, NaN stays NaN; a float32
// denormal (below 1.2e-38, never an activation or a softmax weight here) becomes zero.
inline v16 round_bf16(v16 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
inline void store16(uint16_t* p, v16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)x));
}
#else
// x rounded to the nearest bfloat16 (ties to even), as a float; NaN stays NaN
inline v16 round_bf16(v16 x) {
  u32x16 bits = (u32x16)x;
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const v16 r = (v16)bits;
  return x != x ? x : r;
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
inline void store16(uint16_t* p, v16 x) {
  const v16 r = round_bf16(x);
  const u16x16 h = __builtin_convertvector((u32x16)r >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}
#endif

// Horizontal sum and maximum by halving shuffles (four steps, not fifteen dependent scalar ones).
inline v16 fold(v16 x, int step) {
  static const i32x16 swap8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  static const i32x16 swap4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  static const i32x16 swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  static const i32x16 swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  return __builtin_shuffle(x, step == 8 ? swap8 : step == 4 ? swap4 : step == 2 ? swap2 : swap1);
}
inline float hsum(v16 x) {
  x += fold(x, 8);
  x += fold(x, 4);
  x += fold(x, 2);
  x += fold(x, 1);
  return x[0];
}
inline float hmax(v16 x) {
  v16 y = fold(x, 8);
  x = y > x ? y : x;
  y = fold(x, 4);
  x = y > x ? y : x;
  y = fold(x, 2);
  x = y > x ? y : x;
  y = fold(x, 1);
  x = y > x ? y : x;
  return x[0];
}

// exp_nonpositive on 16 lanes (rounding to the nearest integer by the 1.5 * 2^23 trick)
inline v16 exp16(v16 x) {
  const v16 lowest = v16{} - 87.0f;
  const auto tiny = x < lowest;
  x = tiny ? lowest : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
           1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  const v16 y = p * (v16)e;
  return tiny ? v16{} : y;
}

// silu(a) = a / (1 + exp(-a)), with the exponential of a non-positive argument only
inline float silu(float a) {
  const float e = exp_nonpositive(a >= 0 ? -a : a);
  return (a >= 0 ? a : a * e) / (1.0f + e);
}
inline v16 silu16(v16 a) {
  const auto neg = a < 0;
  const v16 e = exp16(neg ? a : -a);
  return (neg ? a * e : a) / (1.0f + e);
}

// The largest of x[0..n)
inline float row_max(const float* x, int64_t n) {
  const int64_t full = n / 16 * 16;
  v16 m = v16{} - INFINITY;
  for (int64_t j = 0; j < full; j += 16) {
    const v16 v = load16(x + j);
    m = v > m ? v : m;
  }
  float r = hmax(m);
  for (int64_t j = full; j < n; ++j) r = x[j] > r ? x[j] : r;
  return r;
}

}  // namespace batchgen
