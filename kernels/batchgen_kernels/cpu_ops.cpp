// The decoder layer's elementwise steps on the CPU, one pass each where torch takes several
// operators (and as many temporaries): RMSNorm, the SwiGLU unit and rotary embeddings, W8A8's
// per-token rounding of a projection's input; and the store of each token's keys and values into
// its KV-cache slot.
//
// Each keeps torch's rounding: in bfloat16 every intermediate that torch rounds to bf16 is
// rounded here at the same point (the normalized row before the weight, silu(gate) before the
// product, each product of the rotation before their sum), so results equal the torch code's up
// to the order of a sum (RMSNorm's mean of squares) and the exponential's last bits.
// batchgen/model/layers.py's torch code is the reference (tests/model/test_cpu_ops.py).

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_simd.h"

using namespace batchgen;

namespace {

inline float round_bf16_1(float x) {
  uint16_t h;
  store(&h, x);
  return load(&h);
}
template <typename T>
inline float rounded(float x) {  // x as a T would hold it
  return sizeof(T) == 2 ? round_bf16_1(x) : x;
}

// The sum of x[i]^2 in float32, over 4 x 16 lanes (four independent chains of additions)
template <typename T>
inline float sum_squares(const T* x, int64_t dim) {
  const int64_t full = dim / 64 * 64, sixteens = dim / 16 * 16;
  v16 a0 = v16{}, a1 = v16{}, a2 = v16{}, a3 = v16{};
  for (int64_t i = 0; i < full; i += 64) {
    const v16 v0 = load16(x + i), v1 = load16(x + i + 16), v2 = load16(x + i + 32), v3 = load16(x + i + 48);
    a0 += v0 * v0;
    a1 += v1 * v1;
    a2 += v2 * v2;
    a3 += v3 * v3;
  }
  for (int64_t i = full; i < sixteens; i += 16) {
    const v16 v = load16(x + i);
    a0 += v * v;
  }
  float ss = hsum((a0 + a1) + (a2 + a3));
  for (int64_t i = sixteens; i < dim; ++i) ss += load(x + i) * load(x + i);
  return ss;
}

// o = w * rounded(x * inv): the normalized row rounded to T before the weight's product
template <typename T>
inline void scale_row(const T* x, const T* w, float inv, int64_t dim, T* o) {
  const int64_t full = dim / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    v16 y = load16(x + i) * inv;
    if constexpr (sizeof(T) == 2) y = round_bf16(y);
    store16(o + i, load16(w + i) * y);
  }
  for (int64_t i = full; i < dim; ++i) store(o + i, load(w + i) * rounded<T>(load(x + i) * inv));
}

// y = x * rsqrt(mean(x^2) + eps) in float32, rounded to T, times the weight (float32 product,
// rounded to T): transformers' LlamaRMSNorm.
template <typename T>
void rms_norm(const T* x, const T* w, int64_t rows, int64_t dim, float eps, T* out, int threads) {
  BG_EXPECT(x && w && out && rows >= 0 && dim > 0 && threads > 0);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const float inv = 1.0f / std::sqrt(sum_squares(xr, dim) / static_cast<float>(dim) + eps);
    scale_row(xr, w, inv, dim, out + r * dim);
  }
}

// sum = residual + x (rounded to T, as torch's addition), then out = rms_norm(sum): the residual
// stream's addition and the next norm in one pass
template <typename T>
void add_rms_norm(const T* x, const T* residual, const T* w, int64_t rows, int64_t dim, float eps, T* sum, T* out,
                  int threads) {
  BG_EXPECT(x && residual && w && sum && out && rows >= 0 && dim > 0 && threads > 0);
  const int64_t full = dim / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* rr = residual + r * dim;
    T* sr = sum + r * dim;
    for (int64_t i = 0; i < full; i += 16) store16(sr + i, load16(rr + i) + load16(xr + i));
    for (int64_t i = full; i < dim; ++i) store(sr + i, load(rr + i) + load(xr + i));
    const float inv = 1.0f / std::sqrt(sum_squares(static_cast<const T*>(sr), dim) / static_cast<float>(dim) + eps);
    scale_row(static_cast<const T*>(sr), w, inv, dim, out + r * dim);
  }
}

// out = silu(gate) * up, gate and up the halves of each row of gate_up [rows, 2 * inter]
template <typename T>
void silu_mul(const T* gate_up, int64_t rows, int64_t inter, T* out, int threads) {
  BG_EXPECT(gate_up && out && rows >= 0 && inter > 0 && threads > 0);
  const int64_t full = inter / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < full; i += 16) {
      v16 s = silu16(load16(g + i));
      if constexpr (sizeof(T) == 2) s = round_bf16(s);
      store16(o + i, s * load16(u + i));
    }
    for (int64_t i = full; i < inter; ++i) store(o + i, rounded<T>(silu(load(g + i))) * load(u + i));
  }
}

// Each row of x [rows, dim] rounded to its int8 grid and back (W8A8's dynamic per-token activation
// quantization): s = max(max|x|, 1e-8) / 127, out = nearest-even(x / s) * s in float32, stored as T;
// the same operations, in the same order, as batchgen/model/quant.py's fake_quantize_tokens.
template <typename T>
void round_tokens_int8(const T* x, int64_t rows, int64_t dim, T* out, int threads) {
  BG_EXPECT(x && out && rows >= 0 && dim > 0 && threads > 0);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(load(xr + i)));
    const float s = std::max(amax, 1e-8f) / 127.0f;
    T* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const float q = std::min(std::max(std::nearbyint(load(xr + i) / s), -128.0f), 127.0f);
      store(o + i, q * s);
    }
  }
}

// out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t] (each product rounded to T, then
// the sum); x rows may be strided (a view into the fused qkv output): token stride ``x_stride``,
// heads contiguous at head_dim apart. out: [tokens, heads, dim] contiguous.
template <typename T>
void rotary(const T* x, int64_t x_stride, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
            T* out, int threads) {
  BG_EXPECT(x && cos && sin && out && tokens >= 0 && heads > 0 && dim > 0 && dim % 2 == 0 &&
            x_stride >= heads * dim && threads > 0);
  const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * heads * dim > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + t * x_stride + h * dim;
      T* o = out + (t * heads + h) * dim;
      const int64_t full = half / 16 * 16;
      for (int64_t i = 0; i < full; i += 16) {
        const v16 a = load16(xh + i), b = load16(xh + half + i);
        v16 p1 = a * load16(c + i), p2 = b * load16(s + i);
        v16 p3 = b * load16(c + half + i), p4 = a * load16(s + half + i);
        if constexpr (sizeof(T) == 2) {
          p1 = round_bf16(p1);
          p2 = round_bf16(p2);
          p3 = round_bf16(p3);
          p4 = round_bf16(p4);
        }
        store16(o + i, p1 - p2);
        store16(o + half + i, p3 + p4);
      }
      for (int64_t i = full; i < half; ++i) {
        const float a = load(xh + i), b = load(xh + half + i);
        store(o + i, rounded<T>(a * load(c + i)) + rounded<T>(-b * load(s + i)));
        store(o + half + i, rounded<T>(b * load(c + half + i)) + rounded<T>(a * load(s + half + i)));
      }
    }
  }
}

}  // namespace

extern "C" {

// k_cache[h, slots[t]] = k[t, h] and the same for v, for ``tokens`` tokens of ``kv_heads`` heads of
// ``bytes`` bytes each; k and v rows may be strided (views into the fused qkv output): token
// strides ``k_stride`` / ``v_stride`` bytes, heads contiguous. Caches: [kv_heads, slots_per_head]
// slots of ``bytes``. Returns 1, having written nothing, where a slot is outside [0, slots_per_head).
int kv_write(const char* k, int64_t k_stride, const char* v, int64_t v_stride, char* k_cache, char* v_cache,
             const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t bytes, int64_t slots_per_head) {
  BG_EXPECT(k && v && k_cache && v_cache && slots && tokens >= 0 && kv_heads > 0 && bytes > 0);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= slots_per_head) return 1;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (h * slots_per_head + slots[t]) * bytes;
      std::memcpy(k_cache + at, k + t * k_stride + h * bytes, bytes);
      std::memcpy(v_cache + at, v + t * v_stride + h * bytes, bytes);
    }
  }
  return 0;
}

// The paged cache as ``planes`` planes (layer, K or V, kv head) of ``blocks`` blocks of ``bytes``
// bytes each. copy_blocks: block src[i] into dst[i] in every plane (no dst repeats or is also a
// src: the copies are independent). zero_blocks: blocks ids[i] set to zero bytes in every plane.
// Return 1, having touched nothing, where a block is outside [0, blocks).
int copy_blocks(char* cache, int64_t planes, int64_t blocks, int64_t bytes, const int64_t* src, const int64_t* dst,
                int64_t n, int threads) {
  BG_EXPECT(cache && src && dst && planes > 0 && blocks > 0 && bytes > 0 && n >= 0 && threads > 0);
  for (int64_t i = 0; i < n; ++i)
    if (src[i] < 0 || src[i] >= blocks || dst[i] < 0 || dst[i] >= blocks) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < planes * n; ++it) {
    char* plane = cache + (it / n) * blocks * bytes;
    std::memcpy(plane + dst[it % n] * bytes, plane + src[it % n] * bytes, bytes);
  }
  return 0;
}

int zero_blocks(char* cache, int64_t planes, int64_t blocks, int64_t bytes, const int64_t* ids, int64_t n,
                int threads) {
  BG_EXPECT(cache && ids && planes > 0 && blocks > 0 && bytes > 0 && n >= 0 && threads > 0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= blocks) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < planes * n; ++it)
    std::memset(cache + ((it / n) * blocks + ids[it % n]) * bytes, 0, bytes);
  return 0;
}

void rms_norm_f32(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* out, int threads) {
  rms_norm<float>(x, w, rows, dim, eps, out, threads);
}
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, int64_t rows, int64_t dim, float eps, uint16_t* out,
                   int threads) {
  rms_norm<uint16_t>(x, w, rows, dim, eps, out, threads);
}
void add_rms_norm_f32(const float* x, const float* residual, const float* w, int64_t rows, int64_t dim, float eps,
                      float* sum, float* out, int threads) {
  add_rms_norm<float>(x, residual, w, rows, dim, eps, sum, out, threads);
}
void add_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, int64_t rows, int64_t dim,
                       float eps, uint16_t* sum, uint16_t* out, int threads) {
  add_rms_norm<uint16_t>(x, residual, w, rows, dim, eps, sum, out, threads);
}
void silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out, int threads) {
  silu_mul<float>(gate_up, rows, inter, out, threads);
}
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out, int threads) {
  silu_mul<uint16_t>(gate_up, rows, inter, out, threads);
}
void round_tokens_int8_f32(const float* x, int64_t rows, int64_t dim, float* out, int threads) {
  round_tokens_int8<float>(x, rows, dim, out, threads);
}
void round_tokens_int8_bf16(const uint16_t* x, int64_t rows, int64_t dim, uint16_t* out, int threads) {
  round_tokens_int8<uint16_t>(x, rows, dim, out, threads);
}
void rotary_f32(const float* x, int64_t x_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                int64_t dim, float* out, int threads) {
  rotary<float>(x, x_stride, cos, sin, tokens, heads, dim, out, threads);
}
void rotary_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, int64_t tokens,
                 int64_t heads, int64_t dim, uint16_t* out, int threads) {
  rotary<uint16_t>(x, x_stride, cos, sin, tokens, heads, dim, out, threads);
}
}
