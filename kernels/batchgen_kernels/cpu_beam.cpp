// Beam search's candidate step on the CPU, fused: for each group of k beams, the best ``keep`` of
// the k x vocab continuations scored ``log_softmax(logits[beam]) + running[beam]`` (the scores
// transformers' beam search ranks), straight from the model's float32 logits. One pass
// per beam row gives its maximum and log-sum-exp; a second scans the row against the group's
// current keep-th best score, 64 logits at a time, so nothing of vocabulary size is written.
//
// The scores are float32 and computed in log_softmax's order, ((x - max) - log(sum)) + running;
// the sum of exponentials is the kernels' vectorized exp (relative error about 2e-7), so a score
// may differ from torch's in the last bits. The result is sorted by score, equal scores by the
// lower flat index (beam * vocab + token). Groups are split over OpenMP threads.
// batchgen/engine/beam.py's torch code (log_softmax, then topk) is the reference
// (tests/engine/test_beam_kernel.py compares the two).

#include "cpu_simd.h"

using namespace batchgen;

namespace {

// The best ``keep`` (score, flat index) pairs seen so far, sorted by score descending; a new pair
// goes after the equal ones (it has the higher index: rows are scanned in index order).
struct Best {
  float* score;
  int64_t* index;
  int64_t keep;
  int64_t count = 0;

  float threshold() const { return count < keep ? -INFINITY : score[keep - 1]; }

  void insert(float s, int64_t i) {
    int64_t j = count < keep ? count++ : keep - 1;
    while (j > 0 && score[j - 1] < s) {
      score[j] = score[j - 1];
      index[j] = index[j - 1];
      --j;
    }
    score[j] = s;
    index[j] = i;
  }
};

void row_stats(const float* x, int64_t vocab, float* max_out, float* log_sum_out) {
  const int64_t full = vocab / 16 * 16;
  const float mx = row_max(x, vocab);
  vn acc[kParts] = {};
  for (int64_t j = 0; j < full; j += 16)
    for (int q = 0; q < kParts; ++q) acc[q] += exp_lanes(load_vn(x + j + q * kWidth) - mx);
  float sum = hsum(joined(acc));
  for (int64_t j = full; j < vocab; ++j) sum += exp_nonpositive(x[j] - mx);
  *max_out = mx;
  *log_sum_out = std::log(sum);
}

// The score is a non-decreasing function of the logit (each float operation is), so a stretch of
// 64 logits whose largest scores no higher than the keep-th best is skipped after one comparison.
void scan_row(const float* x, int64_t vocab, float mx, float log_sum, float running, int64_t base, Best& best) {
  const auto score = [&](float v) { return ((v - mx) - log_sum) + running; };
  const auto visit = [&](int64_t j) {
    const float s = score(x[j]);
    if (best.count < best.keep || s > best.threshold()) best.insert(s, base + j);
  };
  const int64_t full = vocab / 64 * 64;
  for (int64_t j = 0; j < full; j += 64) {
    vn m[kParts];
    for (int q = 0; q < kParts; ++q) m[q] = load_vn(x + j + q * kWidth);
    for (int c = 16; c < 64; c += 16)
      for (int q = 0; q < kParts; ++q) {
        const vn v = load_vn(x + j + c + q * kWidth);
        m[q] = v > m[q] ? v : m[q];
      }
    if (best.count == best.keep && !(score(hmax(joined(m))) > best.threshold())) continue;
    for (int64_t t = j; t < j + 64; ++t) visit(t);
  }
  for (int64_t j = full; j < vocab; ++j) visit(j);
}

int beam_topk(const float* logits, int64_t vocab, const int64_t* rows, const float* running, int64_t groups, int64_t k,
              int64_t keep, float* scores, int64_t* index, int threads) {
  BG_EXPECT(logits && rows && running && scores && index && vocab > 0 && groups >= 0 && k > 0 && threads > 0);
  if (keep < 1 || keep > k * vocab) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < groups; ++g) {
    Best best{scores + g * keep, index + g * keep, keep};
    for (int64_t i = 0; i < k; ++i) {
      const float* x = logits + rows[g * k + i] * vocab;
      float mx, log_sum;
      row_stats(x, vocab, &mx, &log_sum);
      scan_row(x, vocab, mx, log_sum, running[g * k + i], i * vocab, best);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// logits: [*, vocab]; rows, running: [groups * k] (beam i of group g reads logits row
// rows[g * k + i], its running score running[g * k + i]); scores, index: [groups, keep].
// Returns 1 when keep is not in 1..k * vocab.
int beam_topk_f32(const float* logits, int64_t vocab, const int64_t* rows, const float* running, int64_t groups,
                  int64_t k, int64_t keep, float* scores, int64_t* index, int threads) {
  return beam_topk(logits, vocab, rows, running, groups, k, keep, scores, index, threads);
}
}
