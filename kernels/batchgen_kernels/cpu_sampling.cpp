// The sampler's full-vocabulary passes on the CPU, fused: one pass over a row's logits gives the
// tempered probabilities (unnormalized: exp((x - max) / T), the most likely token 1), their sums
// over consecutive blocks of ``block`` tokens (for the inverse-CDF draw) and the raw logits'
// log-sum-exp (for the chosen token's log-probability); a second kernel gives, per row, the mass of
// the tokens more likely than a threshold (the nucleus test of top-p by rejection). Rows that are
// all greedy take a third: the argmax and the log-sum-exp alone, no probabilities written.
//
// ``sample_rows`` does all of it for rows that need neither top-k nor min-p: per row, the tempered
// probabilities go to a per-thread scratch row that stays in cache (not to memory: on the CPU those
// writes and the rereads cost more than the exponentials), and the draw, top-p by rejection and the
// chosen token's log-probability follow from it in the same call.
//
// ``token_mask`` applies structured outputs' grammar mask (xgrammar's bitmask) to the constrained
// rows before any of that, in place. ``sample_rows`` and ``greedy_pick`` can take the mask
// themselves instead: each constrained row is copied to a per-thread scratch row and masked there,
// in cache, so the logits are neither cloned nor masked in memory first.
//
// Rows are split over OpenMP threads. batchgen/engine/sampler.py's torch code is the reference
// (tests/engine/test_sampler.py compares the two; tests/kernels/test_token_mask.py the mask with
// reference.token_mask_ref and xgrammar's kernel).

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

using namespace batchgen;

namespace {

// One row's tempered probabilities exp((x - max) * t) into p (unnormalized), their sums over
// consecutive ``block``-token slices into block_sums; returns the log-sum-exp of the raw logits y
// (x itself where the pointers are equal).
float tempered_row(const float* x, const float* y, int64_t vocab, float t, int64_t block, float* p,
                   double* block_sums) {
  const int64_t nblocks = (vocab + block - 1) / block;
  const float mx = row_max(x, vocab);
  const bool same = x == y && t == 1.0f;  // the raw distribution is the tempered one
  const float my = x == y ? mx : row_max(y, vocab);
  double raw_sum = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t j0 = b * block, j1 = j0 + block < vocab ? j0 + block : vocab;
    const int64_t full = j0 + (j1 - j0) / 16 * 16;
    vn acc[kParts] = {}, acc_raw[kParts] = {};
    for (int64_t j = j0; j < full; j += 16)
      for (int q = 0; q < kParts; ++q) {
        const int64_t at = j + q * kWidth;
        const vn e = exp_lanes((load_vn(x + at) - mx) * t);
        store_vn(p + at, e);
        acc[q] += e;
        if (!same) acc_raw[q] += exp_lanes(load_vn(y + at) - my);
      }
    float sum = hsum(joined(acc)), sum_raw = same ? sum : hsum(joined(acc_raw));
    for (int64_t j = full; j < j1; ++j) {
      p[j] = exp_nonpositive((x[j] - mx) * t);
      sum += p[j];
      sum_raw += same ? p[j] : exp_nonpositive(y[j] - my);
    }
    block_sums[b] = sum;
    raw_sum += sum_raw;
  }
  return my + static_cast<float>(std::log(raw_sum));
}

// The sum of p[0..vocab) over the values strictly greater than th: float lanes for a stretch of
// 2048, then into a double.
double mass_above_row(const float* p, int64_t vocab, float th) {
  const vn thv = vn{} + th;
  const int64_t full = vocab / 16 * 16;
  double total = 0.0;
  for (int64_t j0 = 0; j0 < full; j0 += 2048) {
    const int64_t j1 = j0 + 2048 < full ? j0 + 2048 : full;
    vn acc[kParts] = {};
    for (int64_t j = j0; j < j1; j += 16)
      for (int q = 0; q < kParts; ++q) {
        const vn v = load_vn(p + j + q * kWidth);
        acc[q] += v > thv ? v : vn{};
      }
    total += hsum(joined(acc));
  }
  for (int64_t j = full; j < vocab; ++j) total += p[j] > th ? p[j] : 0.0f;
  return total;
}

// The first position of the largest of x[0..vocab) (as torch.argmax; NaN is never the largest here)
int64_t argmax_row(const float* x, int64_t vocab, float* largest) {
  const int64_t full = vocab / 16 * 16;
  // each lane's largest value and its first position, then the lanes' first largest
  vn best[kParts];
  in_t at[kParts], iota[kParts];
  for (int q = 0; q < kParts; ++q) {
    best[q] = vn{} - INFINITY;
    for (int l = 0; l < kWidth; ++l) iota[q][l] = q * kWidth + l;
    at[q] = iota[q];
  }
  for (int64_t j = 0; j < full; j += 16)
    for (int q = 0; q < kParts; ++q) {
      const vn v = load_vn(x + j + q * kWidth);
      const in_t gt = v > best[q];
      best[q] = gt ? v : best[q];
      at[q] = gt ? iota[q] + static_cast<int32_t>(j) : at[q];
    }
  float mx = -INFINITY;
  int64_t arg = 0;
  for (int q = 0; q < kParts; ++q)
    for (int l = 0; l < kWidth; ++l)
      if (best[q][l] > mx || (best[q][l] == mx && at[q][l] < arg)) mx = best[q][l], arg = at[q][l];
  for (int64_t j = full; j < vocab; ++j)
    if (x[j] > mx) mx = x[j], arg = j;
  *largest = mx;
  return arg;
}

// log(sum(exp(y - my))) + my over y[0..vocab), my its largest value
float log_sum_exp_row(const float* y, int64_t vocab, float my) {
  const int64_t full = vocab / 16 * 16;
  double sum = 0.0;
  for (int64_t j0 = 0; j0 < full; j0 += 2048) {  // float lanes for a stretch, then into a double
    const int64_t j1 = j0 + 2048 < full ? j0 + 2048 : full;
    vn acc[kParts] = {};
    for (int64_t j = j0; j < j1; j += 16)
      for (int q = 0; q < kParts; ++q) acc[q] += exp_lanes(load_vn(y + j + q * kWidth) - my);
    sum += hsum(joined(acc));
  }
  for (int64_t j = full; j < vocab; ++j) sum += exp_nonpositive(y[j] - my);
  return my + static_cast<float>(std::log(sum));
}

// batchgen.engine.sampler.uniform: a uniform number in [0, 1) from (seed, counter) alone
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline double uniform(uint64_t seed, uint64_t counter) {
  return static_cast<double>(splitmix64(splitmix64(seed) ^ counter) >> 11) / 9007199254740992.0;
}

// batchgen.engine.sampler._draw for one row: the inverse-CDF draw at ``target`` (in [0, total)),
// the block from the cumulative block sums, the token from a cumulative sum inside it.
int64_t draw_row(const float* p, int64_t vocab, int64_t block, const double* cdf, int64_t nblocks, double target) {
  int64_t b = std::lower_bound(cdf, cdf + nblocks, target) - cdf;
  b = b < nblocks - 1 ? b : nblocks - 1;
  const double rest = target - (b > 0 ? cdf[b - 1] : 0.0);
  double run = 0.0;
  int64_t j = 0;
  for (; j < block; ++j) {
    const int64_t col = b * block + j;
    run += col < vocab ? static_cast<double>(p[col]) : 0.0;
    if (run >= rest) break;
  }
  const int64_t idx = b * block + (j < block ? j : block - 1);
  return idx < vocab - 1 ? idx : vocab - 1;
}

// One row's grammar mask: tokens [0, vocab) whose bit (bit j % 32 of word j / 32) is 0 become -inf.
// A word or byte with every bit set (allowed tokens: most of a row inside a JSON string) is skipped;
// otherwise a byte's bits select 8 lanes at once (8-lane vectors on every target: see lanewise in
// cpu_simd.h).
void token_mask_row(float* x, int64_t vocab, const int32_t* bits) {
  const i32x8 lane = {1, 2, 4, 8, 16, 32, 64, 128};
  const i32x8 ninf = i32x8{} + static_cast<int32_t>(0xff800000u);  // -inf's bits
  const int64_t full = vocab / 32;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t word = static_cast<uint32_t>(bits[w]);
    if (word == 0xffffffffu) continue;
    for (int q = 0; q < 4; ++q) {
      const int32_t byte = static_cast<int32_t>((word >> (8 * q)) & 0xffu);
      if (byte == 0xff) continue;
      float* p = x + w * 32 + 8 * q;
      i32x8 v;
      std::memcpy(&v, p, sizeof v);
      const i32x8 keep = ((i32x8{} + byte) & lane) != 0;
      v = (v & keep) | (ninf & ~keep);
      std::memcpy(p, &v, sizeof v);
    }
  }
  for (int64_t j = full * 32; j < vocab; ++j)
    if (!((static_cast<uint32_t>(bits[j / 32]) >> (j % 32)) & 1u)) x[j] = -INFINITY;
}

// Structured outputs' mask as sample_rows and greedy_pick take it.
struct RowMask {
  const int32_t* bits;     // [rows, words], or null: no row is masked
  int64_t words, vocab;
  const uint8_t* masked;   // [rows]: 1 where the row follows a grammar
  const int32_t* row(int64_t r) const { return bits && masked[r] ? bits + r * words : nullptr; }
};

// The logits row r's pick uses: ``x`` itself, or where ``mask`` gives the row's bits, x copied to
// ``scratch`` with the tokens below ``mask.vocab`` that the bits do not allow at -inf.
inline const float* masked_row(const float* x, int64_t vocab, const RowMask& mask, int64_t r, float* scratch) {
  const int32_t* bits = mask.row(r);
  if (!bits) return x;
  std::memcpy(scratch, x, vocab * sizeof(float));
  token_mask_row(scratch, mask.vocab, bits);
  return scratch;
}

}  // namespace

extern "C" {

// Structured outputs' mask: for each of ``n`` rows (``row_index`` into logits [*, row_stride],
// float32), the tokens below ``vocab`` that ``bitmask`` ([*, words] int32, xgrammar's layout: bit
// j % 32 of word j / 32 set where token j is allowed; the same row numbers) does not allow become
// -inf, in place.
void token_mask(float* logits, int64_t row_stride, int64_t vocab, const int32_t* bitmask, int64_t words,
                const int64_t* row_index, int64_t n, int threads) {
  BG_EXPECT(logits && bitmask && row_index && vocab > 0 && row_stride >= vocab && words * 32 >= vocab && n >= 0 &&
            threads > 0);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i)
    token_mask_row(logits + row_index[i] * row_stride, vocab, bitmask + row_index[i] * words);
}

// adjusted, raw, probs: [rows, vocab]; inv_temp: [rows]; block_sums: [rows, ceil(vocab / block)];
// raw_lse: [rows]. ``adjusted`` are the logits the draw uses (blocked tokens, penalties), ``raw``
// the model's (the same pointer when they are). block: a multiple of 16. Returns 1 otherwise.
int tempered_softmax(const float* adjusted, const float* raw, int64_t rows, int64_t vocab, const float* inv_temp,
                     int64_t block, float* probs, double* block_sums, float* raw_lse, int threads) {
  BG_EXPECT(adjusted && raw && inv_temp && probs && block_sums && raw_lse && rows >= 0 && vocab > 0 && block > 0 &&
            threads > 0);
  if (block % 16) return 1;
  const int64_t nblocks = (vocab + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r)
    raw_lse[r] = tempered_row(adjusted + r * vocab, raw + r * vocab, vocab, inv_temp[r], block, probs + r * vocab,
                              block_sums + r * nblocks);
  return 0;
}

// Greedy rows: per row, the first position of the largest ``adjusted`` logit (as torch.argmax; NaN
// is never the largest here) and the log-sum-exp of ``raw`` (the same pointer when they are).
// bitmask (or null), words, mask_vocab, masked: the grammar's mask, as sample_rows takes it.
void greedy_pick(const float* adjusted, const float* raw, int64_t rows, int64_t vocab, const int32_t* bitmask,
                 int64_t words, int64_t mask_vocab, const uint8_t* masked, int64_t* token, float* raw_lse,
                 int threads) {
  BG_EXPECT(adjusted && raw && token && rows >= 0 && vocab > 0 && threads > 0);
  BG_EXPECT(!bitmask || (masked && mask_vocab > 0 && mask_vocab <= vocab && words * 32 >= mask_vocab));
  const RowMask mask{bitmask, words, mask_vocab, masked};
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(bitmask ? vocab : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* y = raw + r * vocab;
      const float* x = masked_row(adjusted + r * vocab, vocab, mask, r, scratch.data());
      float mx;
      token[r] = argmax_row(x, vocab, &mx);
      raw_lse[r] = log_sum_exp_row(y, vocab, x == y ? mx : row_max(y, vocab));
    }
  }
}

// For each of ``n`` rows (``row_index`` into probs [*, vocab]): the sum of its probabilities
// strictly greater than ``threshold[i]``.
void mass_above(const float* probs, int64_t vocab, const int64_t* row_index, int64_t n, const float* threshold,
                double* out, int threads) {
  BG_EXPECT(probs && row_index && threshold && vocab > 0 && n >= 0 && threads > 0);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) out[i] = mass_above_row(probs + row_index[i] * vocab, vocab, threshold[i]);
}

// One token per row, in one call: ``inv_temp[r]`` 0 marks a greedy row (the argmax of ``adjusted``),
// the others draw from exp((adjusted - max) * inv_temp) by inverse CDF with
// uniform(seeds[r], counters[r] + attempt), accepted at once where ``top_p[r]`` >= 1, else where the
// mass of the tokens strictly more likely than the draw is below top_p of the total (top-p by
// rejection, up to ``rounds`` attempts; ``rejected[r]`` 1 where none was accepted, and the caller
// settles that row by sorting). logprob: the raw log-probability of the token (raw[token] minus the
// log-sum-exp of ``raw``). block: a multiple of 16 (returns 1 otherwise). The arithmetic is that of
// tempered_softmax, mass_above and batchgen.engine.sampler._draw, so the tokens are theirs.
// bitmask: null, or structured outputs' mask ([rows, words] int32, xgrammar's layout), applied to
// the tokens below ``mask_vocab`` of the rows where ``masked[r]`` is 1, as token_mask would apply it
// to ``adjusted`` first.
int sample_rows(const float* adjusted, const float* raw, int64_t rows, int64_t vocab, const float* inv_temp,
                const float* top_p, const uint64_t* seeds, const int64_t* counters, int64_t rounds, int64_t block,
                const int32_t* bitmask, int64_t words, int64_t mask_vocab, const uint8_t* masked, int64_t* token,
                float* logprob, uint8_t* rejected, int threads) {
  BG_EXPECT(adjusted && raw && inv_temp && top_p && token && logprob && rejected && rows >= 0 && vocab > 0 &&
            block > 0 && threads > 0);
  BG_EXPECT(!bitmask || (masked && mask_vocab > 0 && mask_vocab <= vocab && words * 32 >= mask_vocab));
  if (block % 16) return 1;
  const int64_t nblocks = (vocab + block - 1) / block;
  const RowMask mask{bitmask, words, mask_vocab, masked};
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(vocab + 16), scratch(bitmask ? vocab : 0);
    std::vector<double> cdf(nblocks);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* y = raw + r * vocab;
      const float* x = masked_row(adjusted + r * vocab, vocab, mask, r, scratch.data());
      rejected[r] = 0;
      if (inv_temp[r] == 0.0f) {
        float mx;
        token[r] = argmax_row(x, vocab, &mx);
        logprob[r] = y[token[r]] - log_sum_exp_row(y, vocab, x == y ? mx : row_max(y, vocab));
        continue;
      }
      const float lse = tempered_row(x, y, vocab, inv_temp[r], block, p.data(), cdf.data());
      for (int64_t b = 1; b < nblocks; ++b) cdf[b] += cdf[b - 1];
      const double total = cdf[nblocks - 1];
      int64_t tok = 0;
      bool ok = false;
      for (int64_t a = 0; a < rounds && !ok; ++a) {
        tok = draw_row(p.data(), vocab, block, cdf.data(), nblocks, uniform(seeds[r], counters[r] + a) * total);
        ok = top_p[r] >= 1.0f || mass_above_row(p.data(), vocab, p[tok]) < static_cast<double>(top_p[r]) * total;
      }
      token[r] = tok;
      rejected[r] = ok ? 0 : 1;
      logprob[r] = y[tok] - lse;
    }
  }
  return 0;
}
}
