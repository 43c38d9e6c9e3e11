// Paged decode attention on the CPU: one query token per row, its keys and values read in place
// from the head-major paged caches ([kv_heads, num_blocks, block_size, head_dim]) through the
// row's block table, with an online softmax (no gathered copy of the context, no score matrix).
//
// Work item: one (row, kv head) pair; its ``heads / kv_heads`` query heads share each key block
// while it is in L1. Items are split over OpenMP threads (torch's own libgomp: same soname, so
// one thread pool in the process). Accumulation is in float32 for every cache dtype.
//
// Built at first use by kernels/cpu.py; the torch backend is the reference it is tested
// against (tests/kernels/test_cpu_attention.py).

#include "cpu_simd.h"

namespace {

using namespace batchgen;

constexpr int kMaxGroup = 32;  // query heads per kv head
constexpr int kMaxDim = 256;   // head_dim
constexpr int kMaxBlock = 256;  // block_size

// The general loop, for any shape within the limits above: one key at a time.
template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t group,
            int64_t dim, int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale, int64_t window,
            float softcap, const float* sinks, T* out) {
  alignas(64) float qf[kMaxGroup][kMaxDim];
  alignas(64) float acc[kMaxGroup][kMaxDim];
  alignas(64) float s[kMaxBlock];
  float m[kMaxGroup], l[kMaxGroup];
  const float q_scale = softcap > 0 ? 1.0f : scale;  // with soft-capping the scale goes into tanh
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t i = 0; i < dim; ++i) qf[h][i] = load(q + h * dim + i) * q_scale;
    for (int64_t i = 0; i < dim; ++i) acc[h][i] = 0.0f;
    // a sink is one more logit whose value vector is zero: it starts the running max and sum
    m[h] = sinks ? sinks[h] : -INFINITY;
    l[h] = sinks ? 1.0f : 0.0f;
  }
  const int64_t start = window > 0 && ctx > window ? ctx - window : 0;
  const int64_t head_base = kv_head * num_blocks * block_size * dim;
  for (int64_t b = start / block_size; b * block_size < ctx; ++b) {
    const int64_t base = head_base + table[b] * block_size * dim;
    const int64_t j0 = start > b * block_size ? start - b * block_size : 0;
    const int64_t j1 = ctx - b * block_size < block_size ? ctx - b * block_size : block_size;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qf[h];
      float mx = m[h];
      for (int64_t j = j0; j < j1; ++j) {
        const T* kj = kb + j * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += qh[i] * load(kj + i);
        if (softcap > 0) dot = std::tanh(dot * scale / softcap) * softcap;
        s[j] = dot;
        mx = dot > mx ? dot : mx;
      }
      const float corr = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = j0; j < j1; ++j) {
        s[j] = exp_nonpositive(s[j] - mx);
        sum += s[j];
      }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
      float* ah = acc[h];
      if (corr != 1.0f) {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) ah[i] *= corr;
      }
      for (int64_t j = j0; j < j1; ++j) {
        const T* vj = vb + j * dim;
        const float p = s[j];
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) ah[i] += p * load(vj + i);
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    for (int64_t i = 0; i < dim; ++i) store(out + h * dim + i, acc[h][i] * inv);
  }
}

// Sums of each of 16 vectors, as one vector (lane k: the sum of t[k]), by four rounds of pairwise
// half-swaps: 15 two-source shuffle pairs and adds instead of 16 horizontal sums.
inline v16 reduce16(const v16* t) {
  const i32x16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 hi1 = lo1 + 8;
  const i32x16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i32x16 hi2 = lo2 + 4;
  const i32x16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i32x16 hi3 = lo3 + 2;
  const i32x16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i32x16 hi4 = lo4 + 1;
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo1) + __builtin_shuffle(t[2 * i], t[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo3) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi3);
  return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

// The fast path, for head_dim 64 or 128, at most 8 query heads per kv head and block sizes that
// are multiples of 16: 16 keys at a time (a chunk never crosses a block). Per chunk and query head: 16 partial-sum vectors reduced together into one vector of 16
// scores, lanes outside the row's keys set to -inf, an online-softmax update on the vector; then
// each value vector is loaded once for all the group's heads, whose accumulators stay in registers.
template <typename T, int G, int N>  // N: head_dim / 16
void attend_vec(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
                int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale, int64_t window, float softcap,
                const float* sinks, T* out) {
  constexpr int D = 16 * N;
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 minus_inf = v16{} - INFINITY;
  v16 qf[G][N], acc[G][N];
  alignas(64) float p[G][16];
  float m[G], l[G];
  const float q_scale = softcap > 0 ? 1.0f : scale;
  for (int h = 0; h < G; ++h) {
    for (int c = 0; c < N; ++c) {
      for (int i = 0; i < 16; ++i) qf[h][c][i] = load(q + h * D + c * 16 + i) * q_scale;
      acc[h][c] = v16{};
    }
    m[h] = sinks ? sinks[h] : -INFINITY;
    l[h] = sinks ? 1.0f : 0.0f;
  }
  const int64_t start = window > 0 && ctx > window ? ctx - window : 0;
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  for (int64_t pos = start / 16 * 16; pos < ctx; pos += 16) {  // key positions pos .. pos + 15
    const int64_t b = pos / block_size;
    const int64_t base = head_base + (table[b] * block_size + pos % block_size) * D;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    const int k0 = start > pos ? static_cast<int>(start - pos) : 0;
    const int k1 = ctx - pos < 16 ? static_cast<int>(ctx - pos) : 16;
    const auto outside = (iota < k0) | (iota >= k1);
    // bfloat16 keys are widened once per chunk, not once per query head
    alignas(64) float widened[sizeof(T) == 2 ? 16 * D : 1];
    const float* keys = reinterpret_cast<const float*>(kb);
    if constexpr (sizeof(T) == 2) {
      for (int k = 0; k < 16; ++k)
        for (int c = 0; c < N; ++c) {
          const v16 x = load16(kb + k * D + c * 16);
          std::memcpy(widened + k * D + c * 16, &x, sizeof x);
        }
      keys = widened;
    }
    for (int h = 0; h < G; ++h) {
      v16 t[16];
      for (int k = 0; k < 16; ++k) {
        const float* kk = keys + k * D;
        t[k] = qf[h][0] * load16(kk);
        for (int c = 1; c < N; ++c) t[k] += qf[h][c] * load16(kk + c * 16);
      }
      v16 sc = reduce16(t);
      if (softcap > 0)
        for (int i = 0; i < 16; ++i) sc[i] = std::tanh(sc[i] * scale / softcap) * softcap;
      sc = outside ? minus_inf : sc;
      const float chunk_max = hmax(sc);
      const float mx = chunk_max > m[h] ? chunk_max : m[h];
      const float corr = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - mx);
      const v16 e = exp16(sc - mx);
      l[h] = l[h] * corr + hsum(e);
      m[h] = mx;
      std::memcpy(p[h], &e, sizeof e);
      for (int c = 0; c < N; ++c) acc[h][c] *= corr;
    }
    for (int k = k0; k < k1; ++k) {
      v16 vk[N];
      for (int c = 0; c < N; ++c) vk[c] = load16(vb + k * D + c * 16);
      for (int h = 0; h < G; ++h)
        for (int c = 0; c < N; ++c) acc[h][c] += p[h][k] * vk[c];
    }
  }
  for (int h = 0; h < G; ++h) {
    const float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    for (int c = 0; c < N; ++c)
      for (int i = 0; i < 16; ++i) store(out + h * D + c * 16 + i, acc[h][c][i] * inv);
  }
}

template <typename T, int G>
bool dispatch_dim(int64_t dim, const T* q, const T* k, const T* v, const int64_t* table, int64_t ctx,
                  int64_t num_blocks, int64_t block_size, int64_t kvh, float scale, int64_t window, float softcap,
                  const float* sinks, T* out) {
  switch (dim) {
    case 64:
      attend_vec<T, G, 4>(q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap, sinks, out);
      return true;
    case 128:
      attend_vec<T, G, 8>(q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap, sinks, out);
      return true;
    default:
      return false;
  }
}

template <typename T>
bool attend_fast(int64_t group, int64_t dim, const T* q, const T* k, const T* v, const int64_t* table, int64_t ctx,
                 int64_t num_blocks, int64_t block_size, int64_t kvh, float scale, int64_t window, float softcap,
                 const float* sinks, T* out) {
  if (block_size % 16) return false;
#define BATCHGEN_GROUP(g) \
  case g:                 \
    return dispatch_dim<T, g>(dim, q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap, sinks, out);
  switch (group) {
    BATCHGEN_GROUP(1)
    BATCHGEN_GROUP(2)
    BATCHGEN_GROUP(3)
    BATCHGEN_GROUP(4)
    BATCHGEN_GROUP(5)
    BATCHGEN_GROUP(6)
    BATCHGEN_GROUP(7)
    BATCHGEN_GROUP(8)
    default:
      return false;
  }
#undef BATCHGEN_GROUP
}

template <typename T>
int decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_width,
           const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
           int64_t block_size, float scale, int64_t window, float softcap, const float* sinks, T* out,
           int threads) {
  const int64_t group = heads / kv_heads;
  if (group > kMaxGroup || dim > kMaxDim || block_size > kMaxBlock || heads % kv_heads) return 1;
  const int64_t items = rows * kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t row = it / kv_heads, kvh = it % kv_heads;
    const int64_t off = (row * heads + kvh * group) * dim;
    const float* sk = sinks ? sinks + kvh * group : nullptr;
    const int64_t* table = tables + row * table_width;
    if (!attend_fast<T>(group, dim, q + off, k_cache, v_cache, table, ctx[row], num_blocks, block_size, kvh, scale,
                        window, softcap, sk, out + off))
      attend<T>(q + off, k_cache, v_cache, table, ctx[row], group, dim, num_blocks, block_size, kvh, scale,
                   window, softcap, sk, out + off);
  }
  return 0;
}

}  // namespace

extern "C" {

// q, out: [rows, heads, dim]; caches: [kv_heads, num_blocks, block_size, dim]; tables: [rows,
// table_width]; ctx: [rows] (keys each row attends to, its own included). window 0: none;
// softcap 0: none; sinks: [heads] float32 or null. Returns 0, or 1 for shapes it does not take.
int paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* tables, int64_t width,
                     const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
                     const float* sinks, float* out, int threads) {
  return decode<float>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
                       window, softcap, sinks, out, threads);
}

int paged_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables, int64_t width,
                      const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
                      const float* sinks, uint16_t* out, int threads) {
  return decode<uint16_t>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
                          window, softcap, sinks, out, threads);
}
}
