// The sampler's full-vocabulary passes on the CPU, fused: one pass over a row's logits gives the
// tempered probabilities (unnormalized: exp((x - max) / T), the most likely token 1), their sums
// over consecutive blocks of ``block`` tokens (for the inverse-CDF draw) and the raw logits'
// log-sum-exp (for the chosen token's log-probability); a second kernel gives, per row, the mass of
// the tokens more likely than a threshold (the nucleus test of top-p by rejection). Rows that are
// all greedy take a third: the argmax and the log-sum-exp alone, no probabilities written.
//
// Rows are split over OpenMP threads. batchgen/engine/sampler.py's torch code is the reference
// (tests/engine/test_sampler.py compares the two).

#include "cpu_simd.h"

using namespace batchgen;

extern "C" {

// adjusted, raw, probs: [rows, vocab]; inv_temp: [rows]; block_sums: [rows, ceil(vocab / block)];
// raw_lse: [rows]. ``adjusted`` are the logits the draw uses (blocked tokens, penalties), ``raw``
// the model's (the same pointer when they are). block: a multiple of 16. Returns 1 otherwise.
int tempered_softmax(const float* adjusted, const float* raw, int64_t rows, int64_t vocab, const float* inv_temp,
                     int64_t block, float* probs, double* block_sums, float* raw_lse, int threads) {
  if (block % 16) return 1;
  const int64_t nblocks = (vocab + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = adjusted + r * vocab;
    const float* y = raw + r * vocab;
    float* p = probs + r * vocab;
    const float t = inv_temp[r];
    const float mx = row_max(x, vocab);
    const bool same = x == y && t == 1.0f;  // the raw distribution is the tempered one
    const float my = x == y ? mx : row_max(y, vocab);
    double raw_sum = 0.0;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t j0 = b * block, j1 = j0 + block < vocab ? j0 + block : vocab;
      const int64_t full = j0 + (j1 - j0) / 16 * 16;
      v16 acc = v16{}, acc_raw = v16{};
      for (int64_t j = j0; j < full; j += 16) {
        const v16 e = exp16((load16(x + j) - mx) * t);
        std::memcpy(p + j, &e, sizeof e);
        acc += e;
        if (!same) acc_raw += exp16(load16(y + j) - my);
      }
      float sum = hsum(acc), sum_raw = same ? sum : hsum(acc_raw);
      for (int64_t j = full; j < j1; ++j) {
        p[j] = exp_nonpositive((x[j] - mx) * t);
        sum += p[j];
        sum_raw += same ? p[j] : exp_nonpositive(y[j] - my);
      }
      block_sums[r * nblocks + b] = sum;
      raw_sum += sum_raw;
    }
    raw_lse[r] = my + static_cast<float>(std::log(raw_sum));
  }
  return 0;
}

// Greedy rows: per row, the first position of the largest ``adjusted`` logit (as torch.argmax; NaN
// is never the largest here) and the log-sum-exp of ``raw`` (the same pointer when they are).
void greedy_pick(const float* adjusted, const float* raw, int64_t rows, int64_t vocab, int64_t* token,
                 float* raw_lse, int threads) {
  const int64_t full = vocab / 16 * 16;
  static const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = adjusted + r * vocab;
    const float* y = raw + r * vocab;
    // each lane's largest value and its first position, then the lanes' first largest
    v16 best = v16{} - INFINITY;
    i32x16 at = iota;
    for (int64_t j = 0; j < full; j += 16) {
      const v16 v = load16(x + j);
      const i32x16 gt = v > best;
      best = gt ? v : best;
      at = gt ? iota + static_cast<int32_t>(j) : at;
    }
    float mx = -INFINITY;
    int64_t arg = 0;
    for (int l = 0; l < 16; ++l)
      if (best[l] > mx || (best[l] == mx && at[l] < arg)) mx = best[l], arg = at[l];
    for (int64_t j = full; j < vocab; ++j)
      if (x[j] > mx) mx = x[j], arg = j;
    token[r] = arg;
    const float my = x == y ? mx : row_max(y, vocab);
    double sum = 0.0;
    for (int64_t j0 = 0; j0 < full; j0 += 2048) {  // float lanes for a stretch, then into a double
      const int64_t j1 = j0 + 2048 < full ? j0 + 2048 : full;
      v16 acc = v16{};
      for (int64_t j = j0; j < j1; j += 16) acc += exp16(load16(y + j) - my);
      sum += hsum(acc);
    }
    for (int64_t j = full; j < vocab; ++j) sum += exp_nonpositive(y[j] - my);
    raw_lse[r] = my + static_cast<float>(std::log(sum));
  }
}

// For each of ``n`` rows (``row_index`` into probs [*, vocab]): the sum of its probabilities
// strictly greater than ``threshold[i]``.
void mass_above(const float* probs, int64_t vocab, const int64_t* row_index, int64_t n, const float* threshold,
                double* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float* p = probs + row_index[i] * vocab;
    const float th = threshold[i];
    const v16 thv = v16{} + th;
    const int64_t full = vocab / 16 * 16;
    double total = 0.0;
    for (int64_t j0 = 0; j0 < full; j0 += 2048) {  // float lanes for a stretch, then into a double
      const int64_t j1 = j0 + 2048 < full ? j0 + 2048 : full;
      v16 acc = v16{};
      for (int64_t j = j0; j < j1; j += 16) {
        const v16 v = load16(p + j);
        acc += v > thv ? v : v16{};
      }
      total += hsum(acc);
    }
    for (int64_t j = full; j < vocab; ++j) total += p[j] > th ? p[j] : 0.0f;
    out[i] = total;
  }
}
}
