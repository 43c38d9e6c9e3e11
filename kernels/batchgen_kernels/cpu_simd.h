// SIMD helpers shared by the CPU kernels: float32 / bfloat16 loads and stores, 16-float vectors
// (GCC vector extensions: AVX-512 registers where the compiler targets them), a vectorizable exp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

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
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// Without 512-bit registers (AVX2, or no x86 at all), GCC 12 lowers a 16-lane comparison or select
// to one lane at a time, and keeps a 16-lane vector that a loop carries in memory. There the
// lane-wise code runs on 8-lane halves (``lanewise``), and the row loops on ``vn``, 8 lanes (an
// AVX2 register; 16 with AVX-512): ``kParts`` of them to a 16-lane step, each with its own sums,
// so the lanes add in the order of a 16-lane vector and the results are the same bits.
#if defined(__AVX512F__)
typedef v16 vn;
typedef i32x16 in_t;
constexpr int kParts = 1;
template <class Fn, class... V>
inline auto lanewise(Fn fn, V... v) {
  return fn(v...);
}
#else
typedef v8 vn;
typedef i32x8 in_t;
constexpr int kParts = 2;
#if defined(__has_builtin) && !defined(BATCHGEN_NO_SHUFFLEVECTOR)
#if __has_builtin(__builtin_shufflevector)
#define BATCHGEN_SHUFFLEVECTOR
#endif
#endif
#ifdef BATCHGEN_SHUFFLEVECTOR
template <class V>
inline auto low_half(V x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
}
template <class V>
inline auto high_half(V x) {
  return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
template <class H>
inline auto join_halves(H a, H b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else  // compilers before GCC 12 (or -DBATCHGEN_NO_SHUFFLEVECTOR): through memory
template <class V>
inline auto low_half(V x) {
  typedef std::remove_reference_t<decltype(x[0])> E;
  typedef E H __attribute__((vector_size(sizeof(V) / 2)));
  H h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}
template <class V>
inline auto high_half(V x) {
  typedef std::remove_reference_t<decltype(x[0])> E;
  typedef E H __attribute__((vector_size(sizeof(V) / 2)));
  H h;
  std::memcpy(&h, reinterpret_cast<const char*>(&x) + sizeof h, sizeof h);
  return h;
}
template <class H>
inline auto join_halves(H a, H b) {
  typedef std::remove_reference_t<decltype(a[0])> E;
  typedef E V __attribute__((vector_size(2 * sizeof(H))));
  V v;
  std::memcpy(&v, &a, sizeof a);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof a, &b, sizeof b);
  return v;
}
#endif
// fn(v...) lane by lane: on the low halves, then on the high ones
template <class Fn, class... V>
inline auto lanewise(Fn fn, V... v) {
  return join_halves(fn(low_half(v)...), fn(high_half(v)...));
}
#endif
constexpr int kWidth = 16 / kParts;  // the lanes of a vn

// Loads and stores through the vector type itself (aligned(4): any float address). A memcpy here
// would go by 16-byte pieces with GCC's generic tuning, through the stack, and the 32-byte load
// after two 16-byte stores misses store forwarding: about 4x slower row loops on AVX2.
inline vn load_vn(const float* p) { return *reinterpret_cast<const vn*>(p); }
inline void store_vn(float* p, vn x) { *reinterpret_cast<vn*>(p) = x; }
// the 16 lanes whose parts are ``parts``, lowest first
inline v16 joined(const vn (&parts)[kParts]) {
  v16 v;
  std::memcpy(&v, parts, sizeof v);
  return v;
}

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
// x rounded to the nearest bfloat16 (ties to even), as a float; NaN stays NaN. Lane-wise on
// AVX2's halves: a 16-lane select there goes one lane at a time.
inline v16 round_bf16(v16 x) {
  return lanewise(
      [](auto v) {
        typedef decltype(v) V;
        typedef uint32_t U __attribute__((vector_size(sizeof(V))));
        U bits = (U)v;
        bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
        const V r = (V)bits;
        return v != v ? v : r;
      },
      x);
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
inline void store16(uint16_t* p, v16 x) {
  const v16 r = round_bf16(x);
  *reinterpret_cast<u16x16*>(p) = __builtin_convertvector((u32x16)r >> 16, u16x16);
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
#if !defined(__AVX512F__)
  v8 h = low_half(x), y = high_half(x);  // 8-lane comparisons (see lanewise)
  h = y > h ? y : h;
  static const i32x8 swap4 = {4, 5, 6, 7, 0, 1, 2, 3}, swap2 = {2, 3, 0, 1, 6, 7, 4, 5},
                     swap1 = {1, 0, 3, 2, 5, 4, 7, 6};
  y = __builtin_shuffle(h, swap4);
  h = y > h ? y : h;
  y = __builtin_shuffle(h, swap2);
  h = y > h ? y : h;
  y = __builtin_shuffle(h, swap1);
  h = y > h ? y : h;
  return h[0];
#else
  v16 y = fold(x, 8);
  x = y > x ? y : x;
  y = fold(x, 4);
  x = y > x ? y : x;
  y = fold(x, 2);
  x = y > x ? y : x;
  y = fold(x, 1);
  x = y > x ? y : x;
  return x[0];
#endif
}

// exp_nonpositive lane by lane, on a float vector of any width (rounding to the nearest integer by
// the 1.5 * 2^23 trick)
template <class F>
inline F exp_lanes(F x) {
  using I = decltype(x < x);  // the int vector of F's width
  const F lowest = F{} - 87.0f;
  const I tiny = x < lowest;
  x = tiny ? lowest : x;
  const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
         1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  const F y = p * (F)e;
  return tiny ? F{} : y;
}
inline v16 exp16(v16 x) {
  return lanewise([](auto h) { return exp_lanes(h); }, x);
}

// silu(a) = a / (1 + exp(-a)), with the exponential of a non-positive argument only
inline float silu(float a) {
  const float e = exp_nonpositive(a >= 0 ? -a : a);
  return (a >= 0 ? a : a * e) / (1.0f + e);
}
template <class F>
inline F silu_lanes(F a) {
  const auto neg = a < 0;
  const F e = exp_lanes(neg ? a : -a);
  return (neg ? a * e : a) / (1.0f + e);
}
inline v16 silu16(v16 a) {
  return lanewise([](auto h) { return silu_lanes(h); }, a);
}

// The largest of x[0..n)
inline float row_max(const float* x, int64_t n) {
  const int64_t full = n / 16 * 16;
  vn m[kParts];
  for (int q = 0; q < kParts; ++q) m[q] = vn{} - INFINITY;
  for (int64_t j = 0; j < full; j += 16)
    for (int q = 0; q < kParts; ++q) {
      const vn v = load_vn(x + j + q * kWidth);
      m[q] = v > m[q] ? v : m[q];
    }
  float r = hmax(joined(m));
  for (int64_t j = full; j < n; ++j) r = x[j] > r ? x[j] : r;
  return r;
}

}  // namespace batchgen
