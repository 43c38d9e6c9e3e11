"""The sampler on synthetic logits: top-p by rejection gives exactly the renormalized nucleus,
top-k / min-p truncate, and a row's draw depends only on its seed and position."""

from __future__ import annotations

import torch

from batchgen.engine.sampler import SampleRow, sample, uniform, uniforms
from batchgen.params import SamplingParams


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, step: int = 0) -> torch.Tensor:
    rows = [SampleRow(params, seed, step, [], 0, []) for seed in range(n)]
    return torch.tensor(sample(logits_row.expand(n, -1).contiguous(), rows).tokens)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[order[keep]]
    return out / out.sum()


def test_top_p_by_rejection_is_the_renormalized_nucleus():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=gen) * 1.5
    for top_p, temp in ((0.5, 1.0), (0.9, 0.7)):
        expected = nucleus(torch.softmax(logits / temp, -1), top_p)
        n = 6000
        tokens = draw(logits, SamplingParams(temperature=temp, top_p=top_p), n)
        freq = torch.bincount(tokens, minlength=40).float() / n
        assert (freq[expected == 0] == 0).all(), "a token outside the nucleus was drawn"
        tol = 4 * (expected * (1 - expected) / n).sqrt() + 2e-3
        assert ((freq - expected).abs() <= tol).all()


def test_top_k_min_p_and_greedy():
    logits = torch.tensor([3.0, 2.9, 2.8, -1.0, -2.0, 0.5])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2), 300).tolist()) == {0, 1}
    got = set(draw(logits, SamplingParams(temperature=1.0, min_p=0.5), 300).tolist())
    assert got == {0, 1, 2}  # p(5) / p(0) is about 0.08 < 0.5
    assert set(draw(logits, SamplingParams(temperature=0), 5).tolist()) == {0}


def test_a_row_depends_only_on_its_seed_and_step():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=gen)
    p = SamplingParams(temperature=1.0, top_p=0.8)
    rows = [SampleRow(p, 100 + i, 3, [], 0, []) for i in range(8)]
    full = sample(logits, rows).tokens
    alone = [sample(logits[i : i + 1], [rows[i]]).tokens[0] for i in range(8)]
    assert full == alone
    moved = [SampleRow(p, 100 + i, 4, [], 0, []) for i in range(8)]
    assert sample(logits, moved).tokens != full


def test_vectorized_uniforms_equal_the_scalar_hash():
    seeds = [0, 1, 12345, 2**63 + 7, 2**64 - 1]
    steps = [0, 1, 8, 8 * 63 + 3, 10**6]
    assert uniforms(seeds, steps).tolist() == [uniform(s, c) for s, c in zip(seeds, steps)]


def test_logprob_of_a_token_whose_probability_underflows():
    """A high temperature samples tokens whose raw probability is below float32's range; their
    reported log-probability is still the exact raw one, never -inf."""
    logits = torch.tensor([0.0, -200.0, -150.0, -120.0])
    rows = [SampleRow(SamplingParams(temperature=1000.0), seed, 0, [], 0, []) for seed in range(64)]
    result = sample(logits.expand(64, -1).contiguous(), rows)
    exact = torch.log_softmax(logits.double(), -1)
    assert set(result.tokens) > {0}, "the test needs draws of the unlikely tokens"
    for tok, lp in zip(result.tokens, result.logprobs):
        assert abs(lp - float(exact[tok])) < 1e-3
