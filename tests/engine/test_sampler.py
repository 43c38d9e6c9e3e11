"""The sampler on synthetic logits: top-p by rejection gives exactly the renormalized nucleus,
top-k / min-p truncate, and a row's draw depends only on its seed and position; each on the torch
code and on the compiled CPU kernels (``fused``), and the kernels against the torch code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.engine.sampler import SampleRow, fused_kernels, sample, uniform, uniforms
from batchgen.params import SamplingParams
from batchgen_kernels import cpu

# Only a machine without any C++ compiler runs the torch code alone (a failed build fails below).
FUSED = [False, True] if cpu.compiler() is not None else [False]


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_the_kernels_build_where_there_is_a_compiler():
    cpu.load()  # KernelUnavailable carries the compiler's error
    assert fused_kernels() is not None


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_the_kernels_build_from_parallel_objects_and_a_failed_source_is_named(tmp_path, monkeypatch):
    """The library is one object per source, compiled at once, then linked (here from the two
    quickest sources): the result exports each source's kernels; a source that does not compile
    fails the build with its compiler error, and no object file or partial library is left."""
    import ctypes

    compiler = cpu.compiler()
    assert compiler is not None
    quick = [src for src in cpu.SOURCES if src.stem in ("cpu_beam", "cpu_sampling")]
    monkeypatch.setattr(cpu, "SOURCES", quick)
    out = tmp_path / "lib.so"
    cpu.compile_library(compiler, cpu.FLAGS, out)
    lib = ctypes.CDLL(str(out))
    assert hasattr(lib, "beam_topk_f32") and hasattr(lib, "tempered_softmax")
    broken = tmp_path / "broken.cpp"
    broken.write_text("int f() { return not_declared; }\n")
    monkeypatch.setattr(cpu, "SOURCES", [*quick, broken])
    with pytest.raises(cpu.KernelUnavailable, match="not_declared"):
        cpu.compile_library(compiler, cpu.FLAGS, tmp_path / "other.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.cpp", "lib.so"]


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, fused: bool) -> torch.Tensor:
    rows = [SampleRow(params, seed, 0, [], 0, []) for seed in range(n)]
    return torch.tensor(sample(logits_row.expand(n, -1).contiguous(), rows, fused=fused).tokens)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[order[keep]]
    return out / out.sum()


@pytest.mark.parametrize("fused", FUSED)
def test_top_p_by_rejection_is_the_renormalized_nucleus(fused):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=gen) * 1.5
    for top_p, temp in ((0.5, 1.0), (0.9, 0.7)):
        expected = nucleus(torch.softmax(logits / temp, -1), top_p)
        n = 6000
        tokens = draw(logits, SamplingParams(temperature=temp, top_p=top_p), n, fused)
        freq = torch.bincount(tokens, minlength=40).float() / n
        assert (freq[expected == 0] == 0).all(), "a token outside the nucleus was drawn"
        tol = 4 * (expected * (1 - expected) / n).sqrt() + 2e-3
        assert ((freq - expected).abs() <= tol).all()


@pytest.mark.parametrize("fused", FUSED)
def test_top_k_min_p_and_greedy(fused):
    logits = torch.tensor([3.0, 2.9, 2.8, -1.0, -2.0, 0.5])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2), 300, fused).tolist()) == {0, 1}
    got = set(draw(logits, SamplingParams(temperature=1.0, min_p=0.5), 300, fused).tolist())
    assert got == {0, 1, 2}  # p(5) / p(0) is about 0.08 < 0.5
    assert set(draw(logits, SamplingParams(temperature=0), 5, fused).tolist()) == {0}


@pytest.mark.parametrize("fused", FUSED)
def test_a_row_depends_only_on_its_seed_and_step(fused):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=gen)
    p = SamplingParams(temperature=1.0, top_p=0.8)
    rows = [SampleRow(p, 100 + i, 3, [], 0, []) for i in range(8)]
    full = sample(logits, rows, fused=fused).tokens
    alone = [sample(logits[i : i + 1], [rows[i]], fused=fused).tokens[0] for i in range(8)]
    assert full == alone
    moved = [SampleRow(p, 100 + i, 4, [], 0, []) for i in range(8)]
    assert sample(logits, moved, fused=fused).tokens != full


def test_vectorized_uniforms_equal_the_scalar_hash():
    seeds = [0, 1, 12345, 2**63 + 7, 2**64 - 1]
    steps = [0, 1, 8, 8 * 63 + 3, 10**6]
    assert uniforms(seeds, steps).tolist() == [uniform(s, c) for s, c in zip(seeds, steps)]


@pytest.mark.parametrize("fused", FUSED)
def test_logprob_of_a_token_whose_probability_underflows(fused):
    """A high temperature samples tokens whose raw probability is below float32's range; their
    reported log-probability is still the exact raw one, never -inf."""
    logits = torch.tensor([0.0, -200.0, -150.0, -120.0])
    rows = [SampleRow(SamplingParams(temperature=1000.0), seed, 0, [], 0, []) for seed in range(64)]
    result = sample(logits.expand(64, -1).contiguous(), rows, fused=fused)
    exact = torch.log_softmax(logits.double(), -1)
    assert set(result.tokens) > {0}, "the test needs draws of the unlikely tokens"
    for tok, lp in zip(result.tokens, result.logprobs):
        assert abs(lp - float(exact[tok])) < 1e-3


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_fused_passes_equal_the_torch_ones():
    """tempered_softmax and mass_above against torch on a vocabulary that is not a multiple of 16,
    with blocked (-inf) tokens and penalized logits that differ from the raw ones."""
    from batchgen_kernels.cpu_sampling import mass_above, tempered_softmax

    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(6, 1000 + 7, generator=gen) * 4
    adjusted = raw.clone()
    adjusted[:, 3] = float("-inf")
    adjusted[2] -= 2 * (torch.arange(1007) % 5 == 0)
    inv_temp = torch.tensor([1.0, 1.25, 0.5, 3.0, 1.0, 10.0])
    for x in (raw, adjusted):
        probs, sums, lse = tempered_softmax(x, raw, inv_temp, 128)
        expected = torch.softmax(x.double() * inv_temp.double()[:, None], -1)
        assert torch.allclose(probs.double() / probs.double().sum(-1, keepdim=True), expected, rtol=1e-5, atol=1e-12)
        assert probs.amax(-1).tolist() == [1.0] * 6  # unnormalized: the most likely token is 1
        full = torch.nn.functional.pad(probs.double(), (0, 8 * 128 + 128 - 1007)).view(6, -1, 128).sum(-1)
        assert torch.allclose(sums, full[:, : sums.shape[1]], rtol=1e-5)
        assert sums.shape[1] == 8
        assert torch.allclose(lse.double(), torch.logsumexp(raw.double(), -1), atol=1e-5)
    rows = torch.tensor([4, 0, 4])
    threshold = probs[rows, torch.tensor([10, 20, 999])]
    expected = [float(torch.where(probs[r] > t, probs[r].double(), 0.0).sum()) for r, t in zip(rows, threshold)]
    assert torch.allclose(mass_above(probs, rows, threshold), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_greedy_pick_is_argmax_and_logsumexp():
    """The all-greedy pass against torch.argmax (first of equal maxima, whichever lanes and tail
    they fall in) and logsumexp of the raw logits, on a vocabulary that is not a multiple of 16."""
    from batchgen_kernels.cpu_sampling import greedy_pick

    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(9, 1000 + 7, generator=gen) * 4
    adjusted = raw.clone()
    adjusted[0, raw[0].argmax()] = float("-inf")  # blocked: the next best wins
    adjusted[1, [37, 21, 500]] = 100.0  # ties in different lanes: the first position
    adjusted[2, [1003, 1005]] = 100.0  # in the tail past the last 16-block
    adjusted[3, [16, 32, 1006]] = 100.0  # the same lane, and the tail
    adjusted[4] = float("-inf")  # nothing left: position 0, as argmax
    adjusted[5, [1006, 999]] = 100.0
    adjusted[6, 0] = 100.0
    adjusted[7] = 0.0
    for x in (raw, adjusted):
        token, lse = greedy_pick(x, raw)
        assert token.tolist() == x.argmax(-1).tolist()
        assert torch.allclose(lse.double(), torch.logsumexp(raw.double(), -1), atol=1e-5)


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_fused_sampler_draws_what_the_torch_one_draws():
    """Same uniforms, probabilities equal to float32 rounding: the same tokens (a draw landing
    within 1e-6 of a CDF step could differ; none does here) and log-probabilities, over mixed
    greedy / plain / top-p / top-k / min-p rows with logprobs and a blocked token."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(64, 5000, generator=gen) * 2
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=20, logprobs=3),
        SamplingParams(temperature=0.9, min_p=0.05, top_p=0.95),
    ]
    rows = [SampleRow(kinds[i % len(kinds)], 1000 + i, i, [], 0, [7] if i % 3 == 0 else []) for i in range(64)]
    a, b = sample(logits, rows, fused=True), sample(logits, rows, fused=False)
    assert a.tokens == b.tokens
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    for ea, eb in zip(a.top_logprobs, b.top_logprobs, strict=True):
        assert (ea is None) == (eb is None)
        if ea is not None:
            assert ea.rank == eb.rank and ea.ids.tolist() == eb.ids.tolist()
            assert np.allclose(ea.logprobs, eb.logprobs, atol=1e-4)


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
def test_one_pass_sampler_draws_what_the_torch_one_draws():
    """Rows without top-k and min-p take the one-pass kernel (``sample_rows``: no probabilities
    written): the same tokens and log-probabilities as the torch code over greedy, plain and top-p
    rows, temperatures above and below 1, blocked tokens, a vocabulary that is not a multiple of 16,
    and top-p rows whose nucleus is so small that every rejection round fails (settled by sorting,
    as the torch code does)."""
    from batchgen_kernels.cpu_sampling import sample_rows

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(96, 5003, generator=gen) * 2
    logits[::7] *= 0.05  # nearly flat rows: a nucleus of 1-2% rejects almost every draw
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.6, top_p=0.5, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.02),
        SamplingParams(temperature=1.0, top_p=0.95),
    ]
    rows = [SampleRow(kinds[i % len(kinds)], 77 + 13 * i, i % 9, [], 0, [5] if i % 4 == 0 else []) for i in range(96)]
    a, b = sample(logits, rows, fused=True), sample(logits, rows, fused=False)
    assert a.tokens == b.tokens
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert all(a.tokens[i] != 5 for i in range(0, 96, 4))  # blocked
    for ea, eb in zip(a.top_logprobs, b.top_logprobs, strict=True):
        assert (ea is None) == (eb is None)
        if ea is not None:
            assert ea.rank == eb.rank and ea.ids.tolist() == eb.ids.tolist()
    # the sort path was taken: some rows were rejected in every round
    inv_temp = torch.tensor([1.0 / r.params.temperature if r.params.temperature else 0.0 for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows])
    _, _, rejected = sample_rows(
        logits, logits, inv_temp, top_p, [r.seed for r in rows], [r.step * 8 for r in rows], 4, 128
    )
    assert 0 < int(rejected.sum()) < 96
    assert all(rows[i].params.top_p < 1 for i in torch.nonzero(rejected).flatten().tolist())


@pytest.mark.skipif(len(FUSED) == 1, reason="no C++ compiler")
@pytest.mark.parametrize("greedy", [True, False])
def test_the_grammar_mask_in_the_one_call_kernels_draws_what_the_torch_code_draws(greedy):
    """Structured outputs' mask handed to ``sample_rows`` / ``greedy_pick`` (applied to a scratch
    row in cache) against the torch code on the logits masked in memory: the same tokens and raw
    log-probabilities, every constrained pick allowed by its row's bits, the logits untouched; over
    greedy, plain and top-p rows, rows with one allowed token, and top-p rows that every rejection
    round fails (settled on the sort path from a masked copy)."""
    from batchgen.engine.sampler import GrammarMask
    from batchgen_kernels.reference import token_mask_ref

    gen = torch.Generator().manual_seed(5)
    vocab = 5003
    logits = torch.randn(48, vocab, generator=gen) * 2
    logits[::5] *= 0.05  # nearly flat: a small nucleus rejects almost every draw
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (48, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits &= torch.randint(-(2**31), 2**31 - 1, (48, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[1::6] = -1  # all allowed
    for r in range(2, 48, 6):  # one token allowed, the row's least likely
        bits[r] = 0
        t = int(logits[r].argmin())
        bits[r, t // 32] = torch.tensor([1 << (t % 32)], dtype=torch.int64).to(torch.int32)
    constrained = [i for i in range(48) if i % 4 != 3]
    kinds = [SamplingParams(temperature=0)] if greedy else [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.8, top_p=0.02, logprobs=2),
    ]
    rows = [SampleRow(kinds[i % len(kinds)], 31 + 7 * i, i % 5, [], 0, []) for i in range(48)]
    before = logits.clone()
    grammar = GrammarMask(bits, constrained, lambda x, m, r: token_mask_ref(x, m, r), vocab)
    a = sample(logits, rows, fused=True, grammar=grammar)
    assert torch.equal(logits, before)  # masked in the kernel's scratch, not in place
    b = sample(logits, rows, fused=False, grammar=grammar)
    assert a.tokens == b.tokens
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    for i in constrained:
        assert (int(bits[i, a.tokens[i] // 32]) >> (a.tokens[i] % 32)) & 1, i
    for r in range(2, 48, 6):
        assert a.tokens[r] == int(logits[r].argmin())
    unmasked = sample(logits, rows, fused=True)
    assert any(unmasked.tokens[i] != a.tokens[i] for i in constrained)  # the mask changed picks
