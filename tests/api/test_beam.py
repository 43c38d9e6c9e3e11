"""Beam search equals transformers ``generate(num_beams=..., do_sample=False)``: sequences equal,
scores within 1e-4, over widths, return counts, length penalties and early-stopping rules, for every
architecture, in mixed batches with sampling requests, and under preemption."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from tests.oracle import hf_model

MAX_NEW = 8
_rng = random.Random(2)
PROMPTS = [[1, 5, 6, 7], [_rng.randrange(3, 24) for _ in range(19)], [9]]


def hf_beam(path, prompt, k, nr, lp, es, max_new=MAX_NEW, min_new=0):
    model = hf_model(path)
    kwargs = dict(
        num_beams=k,
        num_return_sequences=nr,
        max_new_tokens=max_new,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=0,
    )
    if k > 1:
        kwargs.update(length_penalty=lp, early_stopping=es)
    if min_new:
        kwargs["min_new_tokens"] = min_new
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), **kwargs)
    seqs = []
    for row in g.sequences[:, len(prompt) :].tolist():
        # transformers pads finished hypotheses with pad or EOS (pad_token_id=0 is falsy there: EOS)
        while row and row[-1] == 2 and row.count(2) > 1 and row[-2] == 2:
            row.pop()
        seqs.append(row)
    scores = g.sequences_scores.tolist() if k > 1 else [None] * nr
    return seqs, scores


def check(out, ref_seqs, ref_scores, label):
    assert len(out.outputs) == len(ref_seqs), label
    for j, (c, seq, score) in enumerate(zip(out.outputs, ref_seqs, ref_scores)):
        assert c.token_ids == seq, f"{label} hypothesis {j}"
        if score is not None:
            assert abs(c.score - score) < 1e-4, f"{label} hypothesis {j} score {c.score} vs {score}"
        assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")


WIDTHS = [1, 2, 4, 8]
PENALTIES = [-0.5, 0.5, 1.0, 2.0]
EARLY = [True, False, "never"]


# "auto" is the compiled CPU attention where it builds; the torch backend (beams attended as
# shared-prefix decode groups) on one architecture
@pytest.mark.parametrize(
    "arch, backend", [("llama", "auto"), ("mistral", "auto"), ("qwen2", "auto"), ("qwen3", "auto"), ("qwen2", "torch")]
)
def test_beam_matches_transformers(beam_model_dirs, arch, backend):
    path = beam_model_dirs[arch]
    llm = LLM(path, dtype="float32", device="cpu", debug_checks=True, block_size=8, attention_backend=backend)
    combos = list(itertools.product(WIDTHS, PENALTIES, EARLY))
    if arch != "llama":  # the full matrix on one architecture, a spread on the others
        combos = combos[arch_offset(arch) :: 3]
    ended_early = 0
    for k, lp, es in combos:
        for nr in sorted({max(1, k // 2), k}):
            params = BeamSearchParams(
                beam_width=k,
                num_return_sequences=nr,
                max_tokens=MAX_NEW,
                length_penalty=lp,
                early_stopping=es,
            )
            outs = llm.generate(PROMPTS, params)
            for prompt, out in zip(PROMPTS, outs):
                seqs, scores = hf_beam(path, prompt, k, nr, lp, es)
                check(out, seqs, scores, f"k={k} nr={nr} lp={lp} es={es} prompt={len(prompt)}")
                ended_early += sum(len(c.token_ids) < MAX_NEW for c in out.outputs)
    assert ended_early > 0, "EOS should end some hypotheses early"
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


def arch_offset(arch: str) -> int:
    return {"mistral": 0, "qwen2": 1, "qwen3": 2}[arch]


def test_beam_min_tokens_and_mixed_batch_with_sampling(beam_model_dirs):
    path = beam_model_dirs["llama"]
    llm = LLM(path, dtype="float32", device="cpu", debug_checks=True, block_size=8)
    sample = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=11)
    alone = llm.generate([PROMPTS[1]], sample)[0]
    beams = [
        BeamSearchParams(
            beam_width=4,
            num_return_sequences=2,
            max_tokens=MAX_NEW,
            early_stopping="never",
            length_penalty=0.5,
            min_tokens=3,
        ),
        BeamSearchParams(beam_width=2, max_tokens=MAX_NEW),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    params = [beams[0], sample, beams[1], beams[0]]
    outs = llm.generate(prompts, params)
    check(outs[0], *hf_beam(path, PROMPTS[0], 4, 2, 0.5, "never", min_new=3), "mixed k=4")
    check(outs[2], *hf_beam(path, PROMPTS[2], 2, 2, 1.0, False), "mixed k=2")
    check(outs[3], *hf_beam(path, PROMPTS[1], 4, 2, 0.5, "never", min_new=3), "mixed k=4 second")
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in alone.outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_under_preemption(beam_model_dirs, mode):
    path = beam_model_dirs["qwen3"]
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        debug_checks=True,
        block_size=8,
        num_kv_blocks=20,
        enable_prefix_caching=False,
        preemption_mode=mode,
        swap_space_gb=0.01,
    )
    prompts = [[_rng.randrange(3, 24) for _ in range(n)] for n in (9, 17, 23, 30)]
    params = BeamSearchParams(beam_width=4, max_tokens=12, early_stopping="never")
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    if mode == "swap":  # the beams' shared blocks went to the host and came back shared
        assert llm.stats()["num_swap_outs"] > 0
    for prompt, out in zip(prompts, outs):
        check(out, *hf_beam(path, prompt, 4, 4, 1.0, "never", max_new=12), f"preempted prompt {len(prompt)}")
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


def test_beams_share_blocks_copy_on_write(beam_model_dirs):
    path = beam_model_dirs["llama"]
    llm = LLM(path, dtype="float32", device="cpu", block_size=8)
    llm.generate(
        [[_rng.randrange(3, 24) for _ in range(60)]],
        BeamSearchParams(beam_width=4, max_tokens=16, early_stopping="never", ignore_eos=True),
    )
    s = llm.stats()
    assert s["cow_copies"] > 0
    assert s["peak_physical_kv_slots"] <= 0.5 * s["peak_logical_kv_tokens"]


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=2, num_return_sequences=3), "num_return_sequences"),
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_beam_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**bad)
