// Causal prefill attention on the CPU: a chunk of n queries (the last n of ctx positions) over its
// paged context, flash-style (tiles of keys, an online softmax, no score matrix), with keys and
// values read once per call from the paged caches into tile layouts that make both products small
// register-blocked GEMMs. bfloat16 caches run on AVX-512 BF16's dot instruction:
//
//   scores  = query rows x keys: 16 keys in the lanes of a vector, pairs of head dims inside each
//             lane (keys transposed: [16-key chunk][dim pair][key]), the query's dim pair broadcast;
//   weighted sum = weights x values: 16 head dims in the lanes, pairs of keys inside each lane
//             (values interleaved by key pairs: [key pair][dim][2]), the weight pair broadcast.
//
// float32 caches take the same tiles with one head dim (one key) per step and FMA products: keys
// transposed [16-key chunk][dim][key], values as they are.
//
// Without AMX, torch's CPU flash kernel runs at about the same speed in bfloat16 as in float32 (its
// own blocked GEMMs); this one runs at the dot instruction's rate in bf16. With AMX torch's kernel
// runs bf16 on AMX tiles, several times faster than this one: there bf16 chunks run on AMX tiles too
// (prefill_bf16_amx, below, on cpu_amx.h's routine) while a kv head's keys and values fit in L2,
// and on torch's kernel past that (CpuAttention._prefill).
// Softmax statistics and accumulation are float32; in bf16 the weights are rounded to bf16 before
// the weighted sum, as torch's flash attention does for reduced dtypes and as the decode kernel
// (cpu_attention.cpp) does.
//
// Work item: one kv head and a block of query positions, whose rows (positions x the group's
// query heads) share every key tile while it is in L1; 4 rows at a time (2 at head_dim 128) keep
// their scores and accumulators in registers. Items are split over OpenMP threads, the longest
// (latest positions) first. Without AVX-512 (AVX-512 BF16 for bf16) the entry points return 1 and
// the caller keeps torch's kernel; tests/kernels/test_cpu_prefill.py checks both against a float64
// reference.

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_simd.h"

#if defined(__AVX512F__)
#include "cpu_intrin.h"
#define BATCHGEN_PREFILL_F32 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BATCHGEN_PREFILL_DOT 1
#endif
#endif

#include <type_traits>

namespace {

using namespace batchgen;

#ifdef BATCHGEN_PREFILL_F32

constexpr int kTile = 32;       // keys per tile (two 16-key chunks)
constexpr int kItemRows = 64;   // query rows per work item, at most
constexpr int kMaxGroup = 16;   // query heads per kv head

// One tile's online-softmax step for one row: its scaled scores x0 (keys t0 .. t0 + 15) and x1
// (t0 + 16 .. t0 + 31), keys past ``last`` (an index in the tile) masked, become the tile's weights
// exp(x - new max); the running maximum m and sum l are updated. Returns the factor that rescales
// the row's earlier sums.
inline float softmax_tile(v16& x0, v16& x1, int last, float& m, float& l) {
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 minus_inf = v16{} - INFINITY;
  if (last < kTile - 1) {
    x0 = iota > last ? minus_inf : x0;
    x1 = iota + 16 > last ? minus_inf : x1;
  }
  const float tile_max = hmax(x0 > x1 ? x0 : x1);
  const float mx = tile_max > m ? tile_max : m;
  const float corr = m == -INFINITY ? 0.0f : exp_nonpositive(m - mx);
  m = mx;
  x0 = exp16(x0 - mx);
  x1 = exp16(x1 - mx);
  l = l * corr + hsum(x0 + x1);
  return corr;
}

// float32: keys transposed, kt [padded / 16][D][16] (dim d of 16 keys in one vector), values as
// they are, vf [padded][D]. Positions from ctx on stay zeros, as in the bf16 layouts below.
template <int D>
void pack_f32(const float* k_cache, const float* v_cache, const int64_t* table, int64_t lo, int64_t hi, int64_t ctx,
              int64_t head_base, int64_t block_size, float* kt, float* vf) {
  for (int64_t pos = lo; pos < std::min(hi, ctx); ++pos) {
    float* kdst = kt + (pos / 16) * D * 16 + pos % 16;
    const int64_t at = head_base + (table[pos / block_size] * block_size + pos % block_size) * D;
    const float* k = k_cache + at;
    for (int d = 0; d < D; ++d) kdst[d * 16] = k[d];
    std::memcpy(vf + pos * D, v_cache + at, D * sizeof(float));
  }
}

// The float32 form of tile_rows (below): FMA products, one head dim (one key) per step where the
// bf16 dot instruction takes two; the weights stay float32.
template <int N, int R>
inline void tile_rows_f32(const float* const* qrow, const int64_t* pos, int nr, const float* kt_tile,
                          const float* v_tile, int64_t t0, float scale, float* m, float* l, float (*acc)[16 * N]) {
  constexpr int D = 16 * N;
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  const float* qr[R];
  for (int r = 0; r < R; ++r) qr[r] = qrow[r < nr ? r : nr - 1];
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt_tile + d * 16);
    const __m512 k1 = _mm512_loadu_ps(kt_tile + D * 16 + d * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qb = _mm512_set1_ps(qr[r][d]);
      s[r][0] = _mm512_fmadd_ps(k0, qb, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(k1, qb, s[r][1]);
    }
  }
  alignas(64) float w[R][kTile];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    if (r >= nr) {
      corr[r] = 1.0f;
      for (int j = 0; j < kTile; ++j) w[r][j] = 0.0f;
      continue;
    }
    v16 e0 = (v16)s[r][0] * scale, e1 = (v16)s[r][1] * scale;
    corr[r] = softmax_tile(e0, e1, static_cast<int>(pos[r] - t0), m[r], l[r]);
    store16(w[r], e0);
    store16(w[r] + 16, e1);
  }
  __m512 a[R][N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c)
      a[r][c] = r < nr ? _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), _mm512_set1_ps(corr[r])) : _mm512_setzero_ps();
  for (int j = 0; j < kTile; ++j) {
    __m512 wb[R];
    for (int r = 0; r < R; ++r) wb[r] = _mm512_set1_ps(w[r][j]);
    for (int c = 0; c < N; ++c) {
      const __m512 vv = _mm512_loadu_ps(v_tile + j * D + c * 16);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(vv, wb[r], a[r][c]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}

#endif

#ifdef BATCHGEN_PREFILL_DOT

// Keys and values of one kv head at positions [lo, hi) from the paged cache into the tile layouts
// of that head: kt [padded / 16][D / 2][16] (dim pairs of 16 keys), vi [padded / 2][D][2] (key
// pairs). Positions from ctx on are left as they are: zeros (a zero value times a zero weight
// stays zero, where whatever a cache slot holds, NaN say, might not).
template <int D>
void pack(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t lo, int64_t hi,
          int64_t ctx, int64_t head_base, int64_t block_size, uint32_t* kt, uint16_t* vi) {
  for (int64_t pos = lo; pos < hi; ++pos) {
    uint32_t* kdst = kt + (pos / 16) * (D / 2) * 16 + pos % 16;
    uint16_t* vdst = vi + (pos / 2) * D * 2 + pos % 2;
    if (pos >= ctx) continue;  // stays zero (the buffers start zeroed)
    const int64_t at = head_base + (table[pos / block_size] * block_size + pos % block_size) * D;
    const uint32_t* k = reinterpret_cast<const uint32_t*>(k_cache + at);
    const uint16_t* v = v_cache + at;
    for (int c = 0; c < D / 2; ++c) kdst[c * 16] = k[c];
    for (int i = 0; i < D; ++i) vdst[2 * i] = v[i];
  }
}

// ``nr`` (at most R) rows of an item against the tile of keys [t0, t0 + 32): scores, the online
// softmax step, the weighted sum into ``acc``. ``pos``: each row's position (it sees keys 0 ..
// pos), none before t0 (the caller skips those rows).
template <int N, int R>  // N: head_dim / 16
inline void tile_rows(const uint16_t* const* qrow, const int64_t* pos, int nr, const uint32_t* kt_tile,
                      const uint16_t* vi_tile, int64_t t0, float scale, float* m, float* l, float (*acc)[16 * N]) {
  constexpr int D = 16 * N;
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  const uint32_t* q32[R];
  for (int r = 0; r < R; ++r) q32[r] = reinterpret_cast<const uint32_t*>(qrow[r < nr ? r : nr - 1]);
  for (int c = 0; c < D / 2; ++c) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt_tile + c * 16);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt_tile + (D / 2) * 16 + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q32[r][c]));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qb);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qb);
    }
  }
  alignas(64) uint32_t w[R][16];  // the tile's weights as bf16, in pairs of keys
  float corr[R];
  for (int r = 0; r < R; ++r) {
    if (r >= nr) {
      corr[r] = 1.0f;
      for (int j = 0; j < 16; ++j) w[r][j] = 0;
      continue;
    }
    v16 e0 = (v16)s[r][0] * scale, e1 = (v16)s[r][1] * scale;  // pos[r] - t0: the last visible key
    corr[r] = softmax_tile(e0, e1, static_cast<int>(pos[r] - t0), m[r], l[r]);
    const __m512bh pairs = _mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);  // key 2j, 2j + 1 in lane j
    _mm512_store_si512(w[r], (__m512i)pairs);
  }
  __m512 a[R][N];  // rows from nr on are padding: zeros, never stored
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < N; ++c)
      a[r][c] = r < nr ? _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), _mm512_set1_ps(corr[r])) : _mm512_setzero_ps();
  for (int j = 0; j < kTile / 2; ++j) {
    __m512bh wb[R];
    for (int r = 0; r < R; ++r) wb[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r][j]));
    for (int c = 0; c < N; ++c) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vi_tile + j * D * 2 + c * 32);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], vv, wb[r]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}

#endif

#ifdef BATCHGEN_PREFILL_F32

// T: float (FMA products) or uint16_t (bfloat16, the dot instruction)
template <int N, typename T>
void prefill(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t n, int64_t ctx,
             int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, float scale, T* out,
             int threads) {
  constexpr bool f32 = std::is_same_v<T, float>;
  using KT = std::conditional_t<f32, float, uint32_t>;
  constexpr int D = 16 * N;
  constexpr int64_t kt_per_key = f32 ? D : D / 2;  // kt elements per key
  constexpr int R = N >= 8 ? 2 : 4;  // rows per register block: R x N accumulators
  const int64_t group = heads / kv_heads;
  const int64_t past = ctx - n;
  const int64_t padded = (ctx + kTile - 1) / kTile * kTile;
  std::vector<KT> kt_all(static_cast<size_t>(kv_heads * padded * kt_per_key));  // zeros
  std::vector<T> vi_all(static_cast<size_t>(kv_heads * padded * D));
  const int64_t tiles = padded / kTile;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < kv_heads * tiles; ++it) {
    const int64_t h = it / tiles, lo = it % tiles * kTile;
    const int64_t base = h * num_blocks * block_size * D;
    KT* kt = kt_all.data() + h * padded * kt_per_key;
    T* vi = vi_all.data() + h * padded * D;
    if constexpr (f32)
      pack_f32<D>(k_cache, v_cache, table, lo, lo + kTile, ctx, base, block_size, kt, vi);
#ifdef BATCHGEN_PREFILL_DOT
    else
      pack<D>(k_cache, v_cache, table, lo, lo + kTile, ctx, base, block_size, kt, vi);
#endif
  }
  const int64_t span = std::max<int64_t>(1, kItemRows / group);  // query positions per item
  const int64_t blocks = (n + span - 1) / span;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < kv_heads * blocks; ++it) {
    const int64_t h = it % kv_heads, b = blocks - 1 - it / kv_heads;  // the longest first
    const int64_t p0 = b * span, p1 = std::min(n, p0 + span);
    const int rows = static_cast<int>((p1 - p0) * group);
    const KT* kt = kt_all.data() + h * padded * kt_per_key;
    const T* vi = vi_all.data() + h * padded * D;
    float m[kItemRows], l[kItemRows];
    alignas(64) float acc[kItemRows][D];
    const T* qrow[kItemRows];
    int64_t pos[kItemRows];
    for (int r = 0; r < rows; ++r) {  // row r: position p0 + r / group, query head h * group + r % group
      const int64_t p = p0 + r / group;
      qrow[r] = q + (p * heads + h * group + r % group) * D;
      pos[r] = past + p;
      m[r] = -INFINITY;
      l[r] = 0.0f;
      for (int i = 0; i < D; ++i) acc[r][i] = 0.0f;
    }
    const int64_t end = past + p1;  // keys [0, end) are seen by some row of the item
    for (int64_t t0 = 0; t0 < end; t0 += kTile) {
      const KT* kt_tile = kt + t0 * kt_per_key;  // kt_per_key x 16 per 16-key chunk
      const T* vi_tile = vi + t0 * D;
      for (int r = 0; r < rows; r += R) {
        const int nr = std::min(R, rows - r);
        if (pos[r + nr - 1] < t0) continue;  // rows are in position order: none of these sees the tile
        int skip = 0;
        while (pos[r + skip] < t0) ++skip;  // rows before the tile's first key
        if constexpr (f32)
          tile_rows_f32<N, R>(qrow + r + skip, pos + r + skip, nr - skip, kt_tile, vi_tile, t0, scale, m + r + skip,
                              l + r + skip, acc + r + skip);
#ifdef BATCHGEN_PREFILL_DOT
        else
          tile_rows<N, R>(qrow + r + skip, pos + r + skip, nr - skip, kt_tile, vi_tile, t0, scale, m + r + skip,
                          l + r + skip, acc + r + skip);
#endif
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
      T* o = out + (qrow[r] - q);
      for (int c = 0; c < N; ++c) store16(o + 16 * c, load16(acc[r] + 16 * c) * inv);
    }
  }
}

#endif

// Causal attention of a prefill chunk: q, out [n, heads, dim], the queries of positions ctx - n ..
// ctx - 1, over the kv head's keys 0 .. own position, read through ``table`` from the caches
// [kv_heads, num_blocks, block_size, dim]. Returns 0, or 1 where it does not run (no AVX-512
// (BF16 for bf16) compiled in, head_dim other than 64 / 128, more than 16 query heads per kv head).
template <typename T>
int prefill_entry(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t n, int64_t ctx,
                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size, float scale,
                  T* out, int threads) {
  BG_EXPECT(q && k_cache && v_cache && table && out && n > 0 && ctx >= n && heads > 0 && kv_heads > 0 &&
            heads % kv_heads == 0 && dim > 0 && num_blocks > 0 && block_size > 0 && threads > 0);
#ifdef BATCHGEN_PREFILL_F32
#ifndef BATCHGEN_PREFILL_DOT
  if constexpr (!std::is_same_v<T, float>) return 1;
#endif
  if (heads % kv_heads || heads / kv_heads > kMaxGroup || n < 1 || n > ctx) return 1;
  switch (dim) {
    case 64:
      prefill<4, T>(q, k_cache, v_cache, table, n, ctx, heads, kv_heads, num_blocks, block_size, scale, out, threads);
      return 0;
    case 128:
      prefill<8, T>(q, k_cache, v_cache, table, n, ctx, heads, kv_heads, num_blocks, block_size, scale, out, threads);
      return 0;
    default:
      return 1;
  }
#else
  (void)q, (void)k_cache, (void)v_cache, (void)table, (void)n, (void)ctx, (void)heads, (void)kv_heads, (void)dim;
  (void)num_blocks, (void)block_size, (void)scale, (void)out, (void)threads;
  return 1;
#endif
}

}  // namespace

extern "C" {

int prefill_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                 int64_t n, int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
                 int64_t block_size, float scale, uint16_t* out, int threads) {
  return prefill_entry(q, k_cache, v_cache, table, n, ctx, heads, kv_heads, dim, num_blocks, block_size, scale, out,
                       threads);
}

// bfloat16 chunks on AMX tiles (amx_attend), every chunk of a layer in one call: chunk c is the
// ns[c] query positions from row starts[c] of q and out ([tokens, heads, dim]), the last of its
// ctxs[c] positions, over the block table in row c of ``tables`` (``table_width`` wide). One work
// item per kv head and block of 16 / group positions of a chunk (their query heads are the tile's
// lanes, each position seeing the keys up to its own), the items with the most keys first. Every
// item reads its keys and values again (from cache after the first), so this is for short chunks:
// the engine keeps torch's flash kernel, on AMX tiles too, for long ones. Returns 1 where it does
// not run (no AMX, head_dim other than 64 / 128, more than 16 query heads per kv head, blocks of
// other than a multiple of 16 keys, a chunk longer than its context).
int prefill_bf16_amx_chunks(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            const int64_t* tables, int64_t table_width, const int64_t* starts, const int64_t* ns,
                            const int64_t* ctxs, int64_t chunks, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t num_blocks, int64_t block_size, float scale, uint16_t* out, int threads) {
#ifdef BATCHGEN_AMX
  const int64_t group = heads / kv_heads;
  if (!amx_permitted() || heads % kv_heads || group > kAmxLanes || block_size % 16 || (dim != 64 && dim != 128))
    return 1;
  const int64_t per = kAmxLanes / group;  // positions per item
  struct Item {
    int64_t chunk, p0, keys;
  };
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; ++c) {
    if (ns[c] < 1 || ns[c] > ctxs[c]) return 1;
    for (int64_t p0 = 0; p0 < ns[c]; p0 += per)
      items.push_back({c, p0, ctxs[c] - ns[c] + std::min(p0 + per, ns[c])});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const int64_t total = static_cast<int64_t>(items.size()) * kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t it = 0; it < total; ++it) {
    const Item& item = items[it / kv_heads];
    const int64_t c = item.chunk, kvh = it % kv_heads, p0 = item.p0;
    const int64_t rows = std::min(per, ns[c] - p0);
    int64_t limits[kAmxLanes];
    for (int64_t r = 0; r < rows; ++r) limits[r] = ctxs[c] - ns[c] + p0 + r + 1;
    const int64_t row0 = (starts[c] + p0) * heads * dim;
    const int64_t* table = tables + c * table_width;
    if (dim == 64)
      amx_attend<4>(q + row0, heads, k_cache, v_cache, table, item.keys, rows, group, num_blocks, block_size, kvh,
                    scale, nullptr, limits, nullptr, out + row0, true);
    else
      amx_attend<8>(q + row0, heads, k_cache, v_cache, table, item.keys, rows, group, num_blocks, block_size, kvh,
                    scale, nullptr, limits, nullptr, out + row0, true);
  }
  return 0;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)table_width, (void)starts, (void)ns, (void)ctxs;
  (void)chunks, (void)heads, (void)kv_heads, (void)dim, (void)num_blocks, (void)block_size, (void)scale, (void)out;
  (void)threads;
  return 1;
#endif
}

// One chunk on AMX tiles: prefill_bf16_amx_chunks with one chunk of q's n positions
int prefill_bf16_amx(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                     int64_t n, int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks,
                     int64_t block_size, float scale, uint16_t* out, int threads) {
  const int64_t start = 0;
  return prefill_bf16_amx_chunks(q, k_cache, v_cache, table, 0, &start, &n, &ctx, 1, heads, kv_heads, dim,
                                 num_blocks, block_size, scale, out, threads);
}

int prefill_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, int64_t n,
                int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_blocks, int64_t block_size,
                float scale, float* out, int threads) {
  return prefill_entry(q, k_cache, v_cache, table, n, ctx, heads, kv_heads, dim, num_blocks, block_size, scale, out,
                       threads);
}
}
