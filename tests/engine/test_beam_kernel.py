"""The compiled beam candidate step (``kernels/batchgen_kernels/cpu_beam.cpp``) against the torch code it replaces
(``log_softmax``, the running scores added, ``topk`` over each group's k x vocab scores), and beam
search in the engine with the kernel on and off.

Scores may differ in the last bits (the kernel's sum of exponentials is its own, and torch's
``log_softmax`` rounds differently by CPU), so they are compared within 1e-5: a few float32 ulps of
the terms a score sums (log-sum-exps near 18 at a 32,000 vocabulary, running scores of similar
size; one ulp there is 1.9e-6, and a score near 0 by cancellation keeps that absolute error). The
chosen indices must be the same. The reference ranks equal scores by the
lower index (a stable sort), the order the kernel documents; ``torch.topk``'s own order among equal
values is unspecified. Logits rounded to bfloat16 make such ties common."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, BeamSearchParams
from batchgen.engine import beam
from batchgen_kernels import cpu, cpu_beam
from tests.api.test_beam import PROMPTS, hf_beam

if cpu.compiler() is None:
    pytest.skip("no C++ compiler: beam search keeps the torch code", allow_module_level=True)


def reference(logits, rows, running, k, keep):
    log_probs = torch.log_softmax(logits[rows], dim=-1)
    acc = (log_probs + running[:, None]).view(len(rows) // k, -1)
    scores, index = torch.sort(acc, dim=-1, descending=True, stable=True)
    return scores[:, :keep], index[:, :keep]


@pytest.mark.parametrize(
    "groups, k, keep, vocab",
    [(1, 1, 2, 5), (3, 2, 4, 37), (16, 4, 8, 1000), (5, 4, 12, 32000), (2, 8, 16, 129), (1, 2, 6, 3)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_matches_log_softmax_then_topk(groups, k, keep, vocab, ties):
    gen = torch.Generator().manual_seed(groups * vocab + k)
    logits = 4 * torch.randn(groups * k + 3, vocab, generator=gen)
    if ties:  # bfloat16 values: many equal logits in a row
        logits = logits.bfloat16().float()
    rows = torch.randperm(groups * k + 3, generator=gen)[: groups * k]
    rows[0] = rows[-1]  # a row read by two beams (the first step reads the prompt's row k times)
    running = 3 * torch.randn(groups * k, generator=gen)
    got_scores, got_index = cpu_beam.beam_topk(logits, rows, running, k, keep)
    want_scores, want_index = reference(logits, rows, running, k, keep)
    assert torch.equal(got_index, want_index)
    torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=1e-5)


def test_minus_inf_logits_and_the_first_step_scores():
    """-inf logits (a masked token) rank last; beams at the start's -1e9 rank after beam 0."""
    logits = torch.randn(1, 50)
    logits[0, 10:] = float("-inf")
    running = torch.tensor([0.0, -1e9, -1e9])
    scores, index = cpu_beam.beam_topk(logits, torch.zeros(3, dtype=torch.int64), running, 3, 12)
    want_scores, want_index = reference(logits, torch.zeros(3, dtype=torch.int64), running, 3, 12)
    assert torch.equal(index, want_index)
    assert sorted(index[0, :10].tolist()) == list(range(10))
    assert (index[0, 10:] == torch.tensor([50, 51])).all()  # beam 1's best two at -1e9
    torch.testing.assert_close(scores, want_scores)


def test_rejects_a_keep_beyond_the_candidates():
    with pytest.raises(ValueError, match="keep 7"):
        cpu_beam.beam_topk(torch.zeros(2, 3), torch.tensor([0, 1]), torch.zeros(2), 2, 7)


def test_takes_only_cpu_float32_matrices():
    assert cpu_beam.takes(torch.zeros(2, 3))
    assert not cpu_beam.takes(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not cpu_beam.takes(torch.zeros(3))


def test_engine_with_and_without_the_kernel(beam_model_dirs, monkeypatch):
    """Same hypotheses and scores either way, and both those of transformers."""
    path = beam_model_dirs["llama"]
    params = [
        BeamSearchParams(beam_width=4, num_return_sequences=4, max_tokens=8, length_penalty=0.5),
        BeamSearchParams(beam_width=3, num_return_sequences=2, max_tokens=8, early_stopping=True),
        BeamSearchParams(beam_width=4, num_return_sequences=2, max_tokens=8, early_stopping="never"),
    ]
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(beam, "FUSED_CPU_TOPK", fused)
        llm = LLM(path, dtype="float32", device="cpu", block_size=8)
        runs.append(llm.generate(PROMPTS, params))
    for a, b in zip(*runs, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.score for c in a.outputs] == pytest.approx([c.score for c in b.outputs], abs=1e-5)
    seqs, scores = hf_beam(path, PROMPTS[0], 4, 4, 0.5, False)
    assert [c.token_ids for c in runs[0][0].outputs] == seqs
    assert [c.score for c in runs[0][0].outputs] == pytest.approx(scores, abs=1e-4)
