// Paged decode attention on the CPU: one query token per row, its keys and values read in place
// from the head-major paged caches ([kv_heads, num_blocks, block_size, head_dim]) through the
// row's block table, with an online softmax (no gathered copy of the context, no score matrix).
//
// Work item: one (row, kv head) pair; its ``heads / kv_heads`` query heads share each key block
// while it is in L1. Items are split over OpenMP threads (torch's own libgomp: same soname, so
// one thread pool in the process). Accumulation is in float32 for every cache dtype. Before
// that, consecutive rows whose tables start with the same blocks run those blocks together
// (attend_shared: one work item per pack of rows and kv head; for bfloat16 on a CPU with AMX,
// amx_attend on tiles, cpu_amx.h), and each row's item goes on from the pack's softmax state.
//
// Built at first use by kernels/batchgen_kernels/cpu.py; the torch backend is the reference it is tested
// against (tests/kernels/test_cpu_attention.py).

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "cpu_intrin.h"
#endif

namespace {

using namespace batchgen;

constexpr int kMaxGroup = 32;  // query heads per kv head
constexpr int kMaxDim = 256;   // head_dim
constexpr int kMaxBlock = 256;  // block_size

// The general loop, for any shape within the limits above: one key at a time. ``init`` (or null):
// the state of each of the group's heads over the row's first ``from`` keys (attend_shared's,
// stride dim + 2), which the loop goes on from.
template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t group,
            int64_t dim, int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale, int64_t window,
            float softcap, const float* sinks, int64_t from, const float* init, T* out) {
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
    if (init) {
      const float* st = init + h * (dim + 2);
      m[h] = st[0];
      l[h] = st[1];
      for (int64_t i = 0; i < dim; ++i) acc[h][i] = st[2 + i];
    }
  }
  const int64_t start = std::max(window > 0 && ctx > window ? ctx - window : 0, from);
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

// The online softmax's step to a new tile of scores for one query head (``top``: the lane-wise
// maximum of the tile's score vectors): where the running maximum ``m`` moves, the running sums
// and the accumulators are rescaled to it. Returns the maximum the tile's weights are taken against.
template <int N>
inline float rescale_to_tile(v16 top, float& m, v16& lsum, v16 (&acc)[N]) {
  const float tile_max = hmax(top);
  const float mx = tile_max > m ? tile_max : m;
  if (mx != m) {
    const float corr = m == -INFINITY ? 0.0f : exp_nonpositive(m - mx);
    lsum *= corr;
    for (int c = 0; c < N; ++c) acc[c] *= corr;
    m = mx;
  }
  return mx;
}

// Where a tile of up to four 16-key chunks starting at key position ``tile`` lies: each chunk's
// offset in the caches (a chunk never crosses a block) and the range [k0, k1) of its 16 keys that
// the row attends to (from ``start``, the window's first key, to ``ctx``).
constexpr int kTileChunks = 4;  // 64 keys per tile

struct Tile {
  int chunks;
  int64_t base[kTileChunks];
  int k0[kTileChunks], k1[kTileChunks];
};
inline Tile tile_at(int64_t tile, int64_t start, int64_t ctx, const int64_t* table, int64_t head_base,
                    int64_t block_size, int64_t dim) {
  Tile t;
  t.chunks = ctx - tile >= 16 * kTileChunks ? kTileChunks : static_cast<int>((ctx - tile + 15) / 16);
  for (int ch = 0; ch < t.chunks; ++ch) {
    const int64_t pos = tile + 16 * ch;  // key positions pos .. pos + 15
    t.base[ch] = head_base + (table[pos / block_size] * block_size + pos % block_size) * dim;
    t.k0[ch] = start > pos ? static_cast<int>(start - pos) : 0;
    t.k1[ch] = ctx - pos < 16 ? static_cast<int>(ctx - pos) : 16;
  }
  return t;
}

// The fast path, for head_dim 64 or 128, at most 8 query heads per kv head and block sizes that
// are multiples of 16: 16 keys at a time (a chunk never crosses a block). Per chunk and query head:
// 16 partial-sum vectors reduced together into one vector of 16 scores, lanes outside the row's
// keys set to -inf. The online softmax steps over tiles of 64 keys (four chunks): one maximum and
// one rescale of the accumulators per tile, the running sum kept as a vector and summed once at
// the end (per chunk, that serial chain of reductions and exponentials bounded the kernel). Then
// each value vector is loaded once for all the group's heads, whose accumulators stay in registers.
//
// ``init`` (or null): the state of each of the group's heads over the row's first ``from`` keys
// (attend_shared's, stride head_dim + 2), which the loop goes on from.
template <typename T, int G, int N>  // N: head_dim / 16
void attend_vec(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
                int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale, int64_t window, float softcap,
                const float* sinks, int64_t from, const float* init, T* out) {
  constexpr int D = 16 * N;
  constexpr int C = kTileChunks;
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 minus_inf = v16{} - INFINITY;
  v16 qf[G][N] = {}, acc[G][N] = {}, lsum[G] = {};
  alignas(64) v16 sc[G][C];  // a tile's scores, then its softmax weights
  float m[G] = {};
  const float q_scale = softcap > 0 ? 1.0f : scale;
  for (int h = 0; h < G; ++h) {
    for (int c = 0; c < N; ++c) {
      for (int i = 0; i < 16; ++i) qf[h][c][i] = load(q + h * D + c * 16 + i) * q_scale;
      acc[h][c] = v16{};
    }
    m[h] = sinks ? sinks[h] : -INFINITY;
    lsum[h] = v16{};
    lsum[h][0] = sinks ? 1.0f : 0.0f;  // a sink: one more logit whose value vector is zero
    if (init) {
      const float* st = init + h * (D + 2);
      m[h] = st[0];
      lsum[h][0] = st[1];
      for (int c = 0; c < N; ++c) acc[h][c] = load16(st + 2 + c * 16);
    }
  }
  const int64_t start = std::max(window > 0 && ctx > window ? ctx - window : 0, from);
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  for (int64_t tile = start / 16 * 16; tile < ctx; tile += 16 * C) {
    const Tile at = tile_at(tile, start, ctx, table, head_base, block_size, D);
    const int chunks = at.chunks;
    for (int ch = 0; ch < chunks; ++ch) {
      const T* kb = k_cache + at.base[ch];
      const auto outside = (iota < at.k0[ch]) | (iota >= at.k1[ch]);
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
        v16 x = reduce16(t);
        if (softcap > 0)
          for (int i = 0; i < 16; ++i) x[i] = std::tanh(x[i] * scale / softcap) * softcap;
        sc[h][ch] = outside ? minus_inf : x;
      }
    }
    for (int h = 0; h < G; ++h) {
      v16 top = sc[h][0];
      for (int ch = 1; ch < chunks; ++ch) top = sc[h][ch] > top ? sc[h][ch] : top;
      const float mx = rescale_to_tile(top, m[h], lsum[h], acc[h]);
      for (int ch = 0; ch < chunks; ++ch) {
        sc[h][ch] = exp16(sc[h][ch] - mx);  // 0 outside the row's keys
        lsum[h] += sc[h][ch];
      }
    }
    for (int ch = 0; ch < chunks; ++ch)
      for (int k = at.k0[ch]; k < at.k1[ch]; ++k) {
        v16 vk[N];
        for (int c = 0; c < N; ++c) vk[c] = load16(v_cache + at.base[ch] + k * D + c * 16);
        for (int h = 0; h < G; ++h)
          for (int c = 0; c < N; ++c) acc[h][c] += sc[h][ch][k] * vk[c];
      }
  }
  for (int h = 0; h < G; ++h) {
    const float l = hsum(lsum[h]);
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int c = 0; c < N; ++c)
      for (int i = 0; i < 16; ++i) store(out + h * D + c * 16 + i, acc[h][c][i] * inv);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BATCHGEN_BF16_DOT 1

// The fast path for bfloat16 caches on CPUs with AVX-512 BF16: both products on the bf16 dot
// instruction (pairs of bf16 products summed into float32 lanes), no widening of keys or values.
// Scores: query (bf16, as it comes) x key pairs along head_dim. Weighted sum: the softmax weights
// rounded to bf16 (as torch's flash attention does for reduced dtypes) x value pairs along the keys,
// two keys' values interleaved by 16-bit unpacks; the accumulators then hold each 32-dim piece in
// the unpack order, put back in place at the end. Softmax statistics stay float32; the online
// softmax steps over 64-key tiles as in attend_vec.
template <int G, int N>  // N: head_dim / 16 (even)
void attend_bf16_dot(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                     int64_t ctx, int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale,
                     int64_t window, float softcap, const float* sinks, int64_t from, const float* init,
                     uint16_t* out) {
  constexpr int D = 16 * N, P = N / 2;  // P: 32-element pieces of a head
  constexpr int C = kTileChunks;
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 minus_inf = v16{} - INFINITY;
  __m512bh qb[G][P];
  v16 acc[G][N] = {};  // acc[h][2c + s], lane i: dim 32c + 8 * (i / 4) + 4s + i % 4
  v16 lsum[G] = {};  // running softmax denominators, by lane
  alignas(64) uint32_t pw[G][C][8];  // a tile's weights as bf16, in pairs of keys
  float m[G] = {};
  const float q_scale = softcap > 0 ? 1.0f : scale;
  for (int h = 0; h < G; ++h) {
    for (int c = 0; c < P; ++c) qb[h][c] = (__m512bh)_mm512_loadu_si512(q + h * D + c * 32);
    for (int c = 0; c < N; ++c) acc[h][c] = v16{};
    m[h] = sinks ? sinks[h] : -INFINITY;
    lsum[h] = v16{};
    lsum[h][0] = sinks ? 1.0f : 0.0f;
    if (init) {  // into the accumulators' unpack order
      const float* st = init + h * (D + 2);
      m[h] = st[0];
      lsum[h][0] = st[1];
      for (int c = 0; c < P; ++c)
        for (int s = 0; s < 2; ++s)
          for (int i = 0; i < 16; ++i) acc[h][2 * c + s][i] = st[2 + 32 * c + 8 * (i / 4) + 4 * s + i % 4];
    }
  }
  const int64_t start = std::max(window > 0 && ctx > window ? ctx - window : 0, from);
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t tile = start / 16 * 16; tile < ctx; tile += 16 * C) {
    const Tile at = tile_at(tile, start, ctx, table, head_base, block_size, D);
    const int chunks = at.chunks;
    for (int h = 0; h < G; ++h) {
      v16 sc[C];
      v16 top = minus_inf;
      for (int ch = 0; ch < chunks; ++ch) {
        v16 t[16];
        for (int k = 0; k < 16; ++k) {
          __m512 s = _mm512_setzero_ps();
          for (int c = 0; c < P; ++c)
            s = _mm512_dpbf16_ps(s, qb[h][c], (__m512bh)_mm512_loadu_si512(k_cache + at.base[ch] + k * D + c * 32));
          t[k] = (v16)s;
        }
        v16 x = reduce16(t) * q_scale;
        if (softcap > 0)
          for (int i = 0; i < 16; ++i) x[i] = std::tanh(x[i] * scale / softcap) * softcap;
        sc[ch] = (iota < at.k0[ch]) | (iota >= at.k1[ch]) ? minus_inf : x;
        top = sc[ch] > top ? sc[ch] : top;
      }
      const float mx = rescale_to_tile(top, m[h], lsum[h], acc[h]);
      for (int ch = 0; ch < chunks; ++ch) {
        const v16 e = exp16(sc[ch] - mx);  // 0 outside the row's keys
        lsum[h] += e;
        const __m256bh eb = _mm512_cvtneps_pbh((__m512)e);
        std::memcpy(pw[h][ch], &eb, sizeof eb);
      }
    }
    // keys k, k + 1 together; a key outside the row's range has weight 0 and its value slot may
    // hold anything (never written), so it is read as zeros
    for (int ch = 0; ch < chunks; ++ch) {
      for (int k = at.k0[ch] & ~1; k < at.k1[ch]; k += 2) {
        const uint16_t* v0 = v_cache + at.base[ch] + k * D;
        for (int c = 0; c < P; ++c) {
          const __m512i x = k >= at.k0[ch] ? _mm512_loadu_si512(v0 + c * 32) : zero;
          const __m512i y = k + 1 < at.k1[ch] ? _mm512_loadu_si512(v0 + D + c * 32) : zero;
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
          const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
          for (int h = 0; h < G; ++h) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[h][ch][k / 2]));
            acc[h][2 * c] = (v16)_mm512_dpbf16_ps((__m512)acc[h][2 * c], lo, w);
            acc[h][2 * c + 1] = (v16)_mm512_dpbf16_ps((__m512)acc[h][2 * c + 1], hi, w);
          }
        }
      }
    }
  }
  for (int h = 0; h < G; ++h) {
    const float l = hsum(lsum[h]);
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int c = 0; c < P; ++c)
      for (int s = 0; s < 2; ++s)
        for (int i = 0; i < 16; ++i)
          store(out + h * D + 32 * c + 8 * (i / 4) + 4 * s + i % 4, acc[h][2 * c + s][i] * inv);
  }
}
#endif

// Rows whose block tables start with the same blocks (the n samples of one prompt, the beams of one
// search, prompts with a cached prefix) attend to those keys together: one pass over the shared
// blocks for the query heads of up to 16 / group rows, one query head per vector lane. The scores
// of 16 keys are 16 lane vectors, each the sum over head_dim of a query vector (head_dim-major,
// laid out once per call) times a broadcast key element, with no reduction across lanes; the
// weighted sum likewise (accumulators head_dim-major, a broadcast value element times the lane
// vector of weights). Each shared key and value is read once for all the rows, not once per row,
// and the products are FMAs with no shuffles. The online softmax runs per lane, one step per 16
// keys. bfloat16 keys and values are widened once per 16 keys, the products are in float32.
//
// state: per (row, query head) of the pack, [running max, running sum, head_dim accumulators], the
// start the per-row pass (attend_vec, attend_bf16_dot) goes on from over the row's other keys.
constexpr int kLanes = 16;

// Calls f(lane, head, r) for each lane of a pack: row r of the pack, query head ``head``
// (lane r * group + g holds head kv_head * group + g of row r).
template <typename F>
inline void for_lanes(int64_t rows, int64_t group, int64_t kv_head, F f) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) f(r * group + g, kv_head * group + g, r);
}

// The lanes' online-softmax state into ``state`` (per row and head of the pack, stride dim + 2):
// running maximum, running sum, then element i of the accumulators at acc[at(i)].
template <typename Lanes, typename At>  // Lanes: v16 or float[kLanes]
inline void write_state(const Lanes& m, const Lanes& l, const float (*acc)[kLanes], int64_t dim, int64_t rows, int64_t group,
                        int64_t heads, int64_t kv_head, float* state, At at) {
  for_lanes(rows, group, kv_head, [&](int64_t lane, int64_t head, int64_t r) {
    float* st = state + (r * heads + head) * (dim + 2);
    st[0] = m[lane];
    st[1] = l[lane];
    for (int64_t i = 0; i < dim; ++i) st[2 + i] = acc[at(i)][lane];
  });
}

template <typename T, int N>  // N: head_dim / 16
void attend_shared(const T* q, int64_t heads, const T* k_cache, const T* v_cache, const int64_t* table, int64_t keys,
                   int64_t rows, int64_t group, int64_t num_blocks, int64_t block_size, int64_t kv_head, float scale,
                   const float* sinks, float* state) {
  constexpr int D = 16 * N;
  alignas(64) float qt[D][kLanes];   // qt[i][lane]: element i of the lane's query (scaled); 0 in unused lanes
  alignas(64) float acc[D][kLanes];  // the same layout for the weighted sums
  alignas(64) float kw[sizeof(T) == 2 ? 16 * D : 1], vw[sizeof(T) == 2 ? 16 * D : 1];
  alignas(64) float m[kLanes], l[kLanes];  // each lane's running maximum and sum
  for (int lane = 0; lane < kLanes; ++lane) m[lane] = -INFINITY, l[lane] = 0.0f;
  for (int i = 0; i < D; ++i)
    for (int lane = 0; lane < kLanes; ++lane) qt[i][lane] = acc[i][lane] = 0.0f;
  for_lanes(rows, group, kv_head, [&](int64_t lane, int64_t head, int64_t r) {
    const T* qh = q + (r * heads + head) * D;
    for (int i = 0; i < D; ++i) qt[i][lane] = load(qh + i) * scale;
    if (sinks) {  // a sink: one more logit whose value vector is zero
      m[lane] = sinks[head];
      l[lane] = 1.0f;
    }
  });
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  for (int64_t pos = 0; pos < keys; pos += 16) {
    const int64_t base = head_base + (table[pos / block_size] * block_size + pos % block_size) * D;
    const float* kf = reinterpret_cast<const float*>(k_cache + base);
    const float* vf = reinterpret_cast<const float*>(v_cache + base);
    if constexpr (sizeof(T) == 2) {
      for (int i = 0; i < 16 * D; i += 16) {
        store16(kw + i, load16(k_cache + base + i));
        store16(vw + i, load16(v_cache + base + i));
      }
      kf = kw;
      vf = vw;
    }
    // the 16 lanes as kParts native vectors (cpu_simd.h), each lane's arithmetic the same
    for (int part = 0; part < kParts; ++part) {
      const int o = part * kWidth;
      vn s[16];
      for (int k = 0; k < 16; ++k) s[k] = vn{};
      for (int i = 0; i < D; ++i) {
        const vn qi = load_vn(qt[i] + o);
        for (int k = 0; k < 16; ++k) s[k] += qi * kf[k * D + i];
      }
      vn top = s[0];
      for (int k = 1; k < 16; ++k) top = s[k] > top ? s[k] : top;
      const vn mp = load_vn(m + o);
      const vn mx = top > mp ? top : mp;
      const vn corr = exp_lanes(mp - mx);  // 0 where m is -inf (no key yet), 1 where the maximum stays
      vn lp = load_vn(l + o) * corr;
      for (int k = 0; k < 16; ++k) {
        s[k] = exp_lanes(s[k] - mx);
        lp += s[k];
      }
      store_vn(m + o, mx);
      store_vn(l + o, lp);
      for (int i0 = 0; i0 < D; i0 += 8) {  // 8 independent accumulator chains
        vn a[8];
        for (int i = 0; i < 8; ++i) a[i] = load_vn(acc[i0 + i] + o) * corr;
        for (int k = 0; k < 16; ++k)
          for (int i = 0; i < 8; ++i) a[i] += s[k] * vf[k * D + i0 + i];
        for (int i = 0; i < 8; ++i) store_vn(acc[i0 + i] + o, a[i]);
      }
    }
  }
  write_state(m, l, acc, D, rows, group, heads, kv_head, state, [](int64_t i) { return i; });
}

#ifdef BATCHGEN_BF16_DOT
// attend_shared on the bf16 dot instruction, with the numerics of attend_bf16_dot: scores from
// bf16 query x key pairs along head_dim (each lane's query pairs as they come, each key pair
// broadcast), the weighted sum from the weights rounded to bf16 in pairs of keys x the values of
// the same two keys, interleaved once per 16 keys by 16-bit unpacks (the accumulators then hold
// head_dim in the unpack order, put back in place in the state).
template <int N>  // N: head_dim / 16 (even)
void attend_shared_bf16_dot(const uint16_t* q, int64_t heads, const uint16_t* k_cache, const uint16_t* v_cache,
                            const int64_t* table, int64_t keys, int64_t rows, int64_t group, int64_t num_blocks,
                            int64_t block_size, int64_t kv_head, float scale, const float* sinks, float* state) {
  constexpr int D = 16 * N, P = N / 2;
  alignas(64) uint32_t qp[D / 2][kLanes];  // qp[j][lane]: the lane's query elements 2j, 2j + 1
  alignas(64) float acc[D][kLanes];        // acc[e][lane]: element e in the unpack order
  alignas(64) uint32_t vp[8][D];           // vp[j][e]: values of keys 2j, 2j + 1 at element e (unpack order)
  v16 m = v16{} - INFINITY, l = v16{};
  for (int i = 0; i < D; ++i)
    for (int lane = 0; lane < kLanes; ++lane) acc[i][lane] = 0.0f;
  for (int j = 0; j < D / 2; ++j)
    for (int lane = 0; lane < kLanes; ++lane) qp[j][lane] = 0;
  for_lanes(rows, group, kv_head, [&](int64_t lane, int64_t head, int64_t r) {
    const uint16_t* qh = q + (r * heads + head) * D;
    for (int j = 0; j < D / 2; ++j) std::memcpy(&qp[j][lane], qh + 2 * j, 4);
    if (sinks) {
      m[lane] = sinks[head];
      l[lane] = 1.0f;
    }
  });
  const int64_t head_base = kv_head * num_blocks * block_size * D;
  for (int64_t pos = 0; pos < keys; pos += 16) {
    const int64_t base = head_base + (table[pos / block_size] * block_size + pos % block_size) * D;
    const uint16_t* kb = k_cache + base;
    const uint16_t* vb = v_cache + base;
    for (int j = 0; j < 8; ++j)
      for (int c = 0; c < P; ++c) {
        const __m512i x = _mm512_loadu_si512(vb + 2 * j * D + c * 32);
        const __m512i y = _mm512_loadu_si512(vb + (2 * j + 1) * D + c * 32);
        _mm512_store_si512(&vp[j][32 * c], _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(&vp[j][32 * c + 16], _mm512_unpackhi_epi16(x, y));
      }
    __m512 s[16];
    for (int k = 0; k < 16; ++k) s[k] = _mm512_setzero_ps();
    for (int j = 0; j < D / 2; ++j) {
      const __m512bh qj = (__m512bh)_mm512_load_si512(qp[j]);
      for (int k = 0; k < 16; ++k) {
        uint32_t pair;
        std::memcpy(&pair, kb + k * D + 2 * j, 4);
        s[k] = _mm512_dpbf16_ps(s[k], qj, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
      }
    }
    v16 e[16];
    v16 top = v16{} - INFINITY;
    for (int k = 0; k < 16; ++k) {
      e[k] = (v16)s[k] * scale;
      top = e[k] > top ? e[k] : top;
    }
    const v16 mx = top > m ? top : m;
    const v16 corr = exp16(m - mx);
    l *= corr;
    __m512bh w[8];  // lane: the weights of keys 2j (low half) and 2j + 1 as bf16
    for (int k = 0; k < 16; ++k) {
      e[k] = exp16(e[k] - mx);
      l += e[k];
    }
    for (int j = 0; j < 8; ++j) {
      const v16 lo = round_bf16(e[2 * j]), hi = round_bf16(e[2 * j + 1]);
      const u32x16 word = ((u32x16)hi & 0xffff0000u) | ((u32x16)lo >> 16);
      w[j] = (__m512bh)word;
    }
    m = mx;
    for (int i0 = 0; i0 < D; i0 += 8) {
      __m512 a[8];
      for (int i = 0; i < 8; ++i) a[i] = (__m512)(load16(acc[i0 + i]) * corr);
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 8; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], w[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[j][i0 + i])));
      for (int i = 0; i < 8; ++i) _mm512_store_ps(acc[i0 + i], a[i]);
    }
  }
  // dim 32c + 8 (i / 4) + 4s + i % 4 (i < 16) is at 32c + 16s + i in the unpack order
  write_state(m, l, acc, D, rows, group, heads, kv_head, state, [](int64_t d) {
    const int64_t c = d / 32, x = d % 32;
    return 32 * c + 16 * ((x / 4) % 2) + 4 * (x / 8) + x % 4;
  });
}
#endif

// A pack of consecutive rows that start with the same ``keys`` keys (whole blocks)
struct Pack {
  int64_t row, rows, keys;
};
constexpr int64_t kMinSharedKeys = 32;

// Consecutive rows whose tables agree on their first whole blocks, at most ``per`` rows a pack:
// a pack grows while the next row shares at least kMinSharedKeys keys with its first row and at
// least half of what the pack shares so far. Packs of fewer than ``min_rows`` (at least 2) rows
// are left to the per-row pass.
std::vector<Pack> find_packs(const int64_t* tables, int64_t width, const int64_t* ctx, int64_t rows,
                             int64_t block_size, int64_t per, int64_t min_rows) {
  std::vector<Pack> packs;
  for (int64_t r = 0; r < rows;) {
    int64_t common = ctx[r] / block_size, e = r + 1;
    for (; e < rows && e - r < per; ++e) {
      const int64_t* a = tables + r * width;
      const int64_t* b = tables + e * width;
      const int64_t limit = std::min(common, ctx[e] / block_size);
      int64_t c = 0;
      while (c < limit && a[c] == b[c]) ++c;
      if (c * block_size < kMinSharedKeys || (e - r >= 2 && 2 * c < common)) break;
      common = c;
    }
    if (e - r >= min_rows) packs.push_back({r, e - r, common * block_size});
    r = e;
  }
  return packs;
}

// Calls f(std::integral_constant<int, N>{}), N = dim / 16, for the head sizes the vector paths
// take (64 and 128); false for the others.
template <typename F>
inline bool by_dim(int64_t dim, F f) {
  switch (dim) {
    case 64:
      f(std::integral_constant<int, 4>{});
      return true;
    case 128:
      f(std::integral_constant<int, 8>{});
      return true;
    default:
      return false;
  }
}

// Dot: bfloat16 products on the bf16 dot instruction where it was compiled in
// amx: on AMX tiles where they were compiled in and the process may use them
template <typename T, bool Dot>
bool shared_dim(int64_t dim, const T* q, int64_t heads, const T* k, const T* v, const int64_t* table, int64_t keys,
                int64_t rows, int64_t group, int64_t num_blocks, int64_t block_size, int64_t kvh, float scale,
                const float* sinks, float* state, [[maybe_unused]] bool amx) {
#if defined(BATCHGEN_AMX) && defined(BATCHGEN_BF16_DOT)
  if constexpr (Dot && sizeof(T) == 2)
    if (amx)
      return by_dim(dim, [&](auto n) {
        amx_attend<decltype(n)::value>(q, heads, k, v, table, keys, rows, group, num_blocks, block_size, kvh, scale,
                                       sinks, nullptr, state, nullptr, false);
      });
#endif
#ifdef BATCHGEN_BF16_DOT
  if constexpr (Dot && sizeof(T) == 2)
    return by_dim(dim, [&](auto n) {
      attend_shared_bf16_dot<decltype(n)::value>(q, heads, k, v, table, keys, rows, group, num_blocks, block_size,
                                                 kvh, scale, sinks, state);
    });
#endif
  return by_dim(dim, [&](auto n) {
    attend_shared<T, decltype(n)::value>(q, heads, k, v, table, keys, rows, group, num_blocks, block_size, kvh, scale,
                                         sinks, state);
  });
}

template <typename T, int G, bool Dot>
bool dispatch_dim(int64_t dim, const T* q, const T* k, const T* v, const int64_t* table, int64_t ctx,
                  int64_t num_blocks, int64_t block_size, int64_t kvh, float scale, int64_t window, float softcap,
                  const float* sinks, int64_t from, const float* init, T* out) {
#ifdef BATCHGEN_BF16_DOT
  if constexpr (Dot && sizeof(T) == 2)
    return by_dim(dim, [&](auto n) {
      attend_bf16_dot<G, decltype(n)::value>(q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap,
                                             sinks, from, init, out);
    });
#endif
  return by_dim(dim, [&](auto n) {
    attend_vec<T, G, decltype(n)::value>(q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap,
                                         sinks, from, init, out);
  });
}

// Whether the per-row vector pass runs at all: with AVX-512 registers. Without them its 16-lane
// tiles and shuffles are lowered to far slower code than the general loop's 8-lane one (2.5x on
// AVX2; see cpu_simd.h), so rows go to the general loop (shared packs still run, 8 lanes at a time).
#if defined(__AVX512F__)
constexpr bool kVectorPass = true;
#else
constexpr bool kVectorPass = false;
#endif

// The shapes of the vector passes (attend_fast where kVectorPass, and attend_shared): head_dim 64
// or 128, at most 8 query heads per kv head, blocks of a multiple of 16 keys.
inline bool vector_path(int64_t group, int64_t dim, int64_t block_size) {
  return block_size % 16 == 0 && group <= 8 && (dim == 64 || dim == 128);
}

template <typename T, bool Dot>
bool attend_fast(int64_t group, int64_t dim, const T* q, const T* k, const T* v, const int64_t* table, int64_t ctx,
                 int64_t num_blocks, int64_t block_size, int64_t kvh, float scale, int64_t window, float softcap,
                 const float* sinks, int64_t from, const float* init, T* out) {
  if (!vector_path(group, dim, block_size) || !kVectorPass) return false;
#define BATCHGEN_GROUP(g)                                                                                         \
  case g:                                                                                                         \
    return dispatch_dim<T, g, Dot>(dim, q, k, v, table, ctx, num_blocks, block_size, kvh, scale, window, softcap, \
                                   sinks, from, init, out);
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

// The fewest rows of a pack that attend_shared takes under share 1 (on AMX tiles: 2, see decode).
// Its cost per key is that of all 16 lanes whatever the pack fills; the per-row pass costs about 1/12 of it per lane (query
// head of a row), and reads the rows' shared blocks from cache after the first (consecutive rows
// run on one thread), so the shared pass pays only where it fills more than 12 of its 16 lanes
// (scripts/decode_attention.py compares the two; docs/kernels.md has the figures). At least 2 for
// the groups the vector path takes (up to 8).
inline int64_t min_pack_rows(int64_t group) { return (kLanes * 3 / 4) / group + 1; }

// share: 0 for one row at a time; 1 to run rows that share their first blocks together
// (attend_shared) where a pack fills more than 3/4 of its lanes (every pack on AMX tiles); 2 for
// every pack (tests)
template <typename T, bool Dot = true>
int decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_width,
           const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
           int64_t block_size, float scale, int64_t window, float softcap, const float* sinks, T* out,
           int threads, int share, bool amx = false) {
  BG_EXPECT(q && k_cache && v_cache && tables && ctx && out && rows >= 0 && heads > 0 && kv_heads > 0 &&
            heads % kv_heads == 0 && dim > 0 && num_blocks > 0 && block_size > 0 && table_width >= 0 &&
            threads > 0);
  const int64_t group = heads / kv_heads;
  if (group > kMaxGroup || dim > kMaxDim || block_size > kMaxBlock || heads % kv_heads) return 1;
  // packs only where the per-row pass is the vector one, with no window or soft-capping
  std::vector<Pack> packs;
  // on AMX tiles the shared pass costs a fraction of the per-row one's lanes: every pack takes it
  const bool tiles = amx && Dot && sizeof(T) == 2;
  if (share && vector_path(group, dim, block_size) && window <= 0 && softcap <= 0)
    packs = find_packs(tables, table_width, ctx, rows, block_size, kLanes / group,
                       share == 1 && !tiles ? min_pack_rows(group) : 2);
  thread_local std::vector<float> state;
  thread_local std::vector<int64_t> done;  // keys of each row the pack pass took
  if (!packs.empty()) {
    state.resize(static_cast<size_t>(rows * heads * (dim + 2)));
    done.assign(static_cast<size_t>(rows), 0);
    for (const Pack& p : packs)
      for (int64_t r = p.row; r < p.row + p.rows; ++r) done[r] = p.keys;
    const int64_t items = static_cast<int64_t>(packs.size()) * kv_heads;
    float* st = state.data();
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t it = 0; it < items; ++it) {
      const Pack& p = packs[it / kv_heads];
      const int64_t kvh = it % kv_heads;
      shared_dim<T, Dot>(dim, q + p.row * heads * dim, heads, k_cache, v_cache, tables + p.row * table_width, p.keys,
                    p.rows, group, num_blocks, block_size, kvh, scale, sinks, st + p.row * heads * (dim + 2), amx);
    }
  }
  const float* st = packs.empty() ? nullptr : state.data();
  const int64_t* from = packs.empty() ? nullptr : done.data();
  const int64_t items = rows * kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t row = it / kv_heads, kvh = it % kv_heads;
    const int64_t off = (row * heads + kvh * group) * dim;
    const float* sk = sinks ? sinks + kvh * group : nullptr;
    const int64_t* table = tables + row * table_width;
    const int64_t first = from ? from[row] : 0;
    const float* init = first ? st + (row * heads + kvh * group) * (dim + 2) : nullptr;
    if (!attend_fast<T, Dot>(group, dim, q + off, k_cache, v_cache, table, ctx[row], num_blocks, block_size, kvh,
                             scale, window, softcap, sk, first, init, out + off))
      attend<T>(q + off, k_cache, v_cache, table, ctx[row], group, dim, num_blocks, block_size, kvh, scale,
                window, softcap, sk, first, init, out + off);
  }
  return 0;
}

}  // namespace

extern "C" {

// 1 where paged_decode_bf16's shared pass runs on AMX tiles (compiled in, and granted to the
// process), else 0
int amx_tiles() {
#if defined(BATCHGEN_AMX) && defined(BATCHGEN_BF16_DOT)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// q, out: [rows, heads, dim]; caches: [kv_heads, num_blocks, block_size, dim]; tables: [rows,
// table_width]; ctx: [rows] (keys each row attends to, its own included). window 0: none;
// softcap 0: none; sinks: [heads] float32 or null. Returns 0, or 1 for shapes it does not take.
int paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* tables, int64_t width,
                     const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
                     const float* sinks, float* out, int threads, int share) {
  return decode<float>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
                       window, softcap, sinks, out, threads, share);
}

int paged_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables, int64_t width,
                      const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t num_blocks, int64_t block_size, float scale, int64_t window, float softcap,
                      const float* sinks, uint16_t* out, int threads, int share) {
  return decode<uint16_t>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
                          window, softcap, sinks, out, threads, share, amx_tiles());
}

// paged_decode_bf16 without AMX tiles (the shared pass on the bf16 dot instruction), to test both
int paged_decode_bf16_dot(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables,
                          int64_t width, const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                          float softcap, const float* sinks, uint16_t* out, int threads, int share) {
  return decode<uint16_t>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
                          window, softcap, sinks, out, threads, share, false);
}

// paged_decode_bf16 with bf16 values widened to float32 and multiplied there: the path of CPUs
// without AVX-512 BF16, kept callable where the dot path is compiled in, to test both.
int paged_decode_bf16_widened(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables,
                              int64_t width, const int64_t* ctx, int64_t rows, int64_t heads, int64_t kv_heads,
                              int64_t dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                              float softcap, const float* sinks, uint16_t* out, int threads, int share) {
  return decode<uint16_t, false>(q, k, v, tables, width, ctx, rows, heads, kv_heads, dim, num_blocks, block_size,
                                 scale, window, softcap, sinks, out, threads, share);
}

// 1 where paged_decode_bf16 runs on the bf16 dot instruction, else 0
int bf16_dot_products() {
#ifdef BATCHGEN_BF16_DOT
  return 1;
#else
  return 0;
#endif
}
}
