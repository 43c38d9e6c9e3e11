"""Every family beyond Llama (Gemma 2 / 3, Phi-3, OLMo 2, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss)
against transformers on the same random weights: greedy tokens, beam search (widths 1 / 4 / 8,
length penalties, early-stopping rules; scores within 1e-4) and sampled log-probabilities (within
2e-3), with prefix caching, chunked prefill, a KV pool small enough to preempt and block sizes 8 /
16 / 32; the Triton backend on smaller models. The sliding-window families (Gemma 2 / 3, gpt-oss:
window 12) get prompts up to 70 tokens. Each family's features are on in these models (see
``batchgen.tiny``): soft-capping, per-layer RoPE, partial rotary, q/k norms, dense and sparse layers
side by side, shared experts, sinks, YaRN."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.tiny import FAMILY_ARCHS, make_model
from tests.api.test_beam import check, hf_beam
from tests.oracle import hf_greedy, hf_logprob, hf_model

MAX_NEW = 10
_rng = random.Random(5)
SHARED = [_rng.randrange(3, 384) for _ in range(33)]
PROMPTS = [
    [5],
    [_rng.randrange(3, 384) for _ in range(11)],  # inside the window
    [_rng.randrange(3, 384) for _ in range(17)],
    [_rng.randrange(3, 384) for _ in range(70)],  # past the window, several chunks
    SHARED + [7, 8],  # a shared prefix: cached blocks
    SHARED + [9],
]

VARIANTS = {
    "default": dict(),  # prefix caching on, block 16
    "preempt-block8": dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16),
    "chunked-block32": dict(block_size=32, max_num_batched_tokens=24),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {arch: str(make_model(root / arch, arch, seed=20 + i)) for i, arch in enumerate(FAMILY_ARCHS)}


def boost_eos(path: Path, factor: float) -> None:
    """Scale EOS's output embedding: EOS then wins often enough to end beams at different steps."""
    file = path / "model.safetensors"
    weights = load_file(file)
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[name][2] *= factor
    save_file(weights, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def beam_family_dirs(tmp_path_factory) -> dict[str, str]:
    """Vocabulary 24, EOS = 2 made likely."""
    root = tmp_path_factory.mktemp("family_beams")
    dirs = {}
    for i, arch in enumerate(FAMILY_ARCHS):
        path = make_model(root / arch, arch, seed=40 + i, vocab_size=24, initializer_range=0.3)
        boost_eos(path, 5.0)
        dirs[arch] = str(path)
    return dirs


_expected: dict[tuple[str, int], list[int]] = {}


def expected(path: str, i: int) -> list[int]:
    if (path, i) not in _expected:
        _expected[(path, i)] = hf_greedy(path, PROMPTS[i], MAX_NEW)
    return _expected[(path, i)]


@torch.no_grad()
def assert_same_greedy(path: str, prompt: list[int], got: list[int], want: list[int], label: str) -> None:
    """Equal tokens, or a divergence at a true near-tie of transformers' logits (gap shown)."""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = hf_model(path)(torch.tensor([prompt + want[:at]])).logits[0, -1]
    gap = float(logits[want[at]] - logits[got[at]])
    assert gap < 1e-4, f"{label}: token {at} is {got[at]}, transformers {want[at]} (logit gap {gap:.2e})"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_greedy_matches_transformers(family_dirs, arch, variant):
    path = family_dirs[arch]
    llm = LLM(path, dtype="float32", device="cpu", debug_checks=True, **VARIANTS[variant])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for i, out in enumerate(outs):
        assert_same_greedy(path, PROMPTS[i], out.outputs[0].token_ids, expected(path, i), f"{arch} prompt {i}")
    stats = llm.stats()
    if variant == "preempt-block8":
        assert stats["num_preemptions"] > 0
    if variant == "default":
        assert stats["prefix_cache_hit_tokens"] >= 32
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_sampled_logprobs_match_transformers(family_dirs, arch):
    """n=4 seeded samples share the prompt's blocks copy-on-write; each sample's cumulative
    log-probability equals transformers' on its tokens, in a roomy pool and under preemption."""
    path = family_dirs[arch]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=8, seed=3, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[3]]
    roomy = LLM(path, dtype="float32", device="cpu", block_size=8).generate(prompts, params)
    tight_llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_kv_blocks=16, max_num_batched_tokens=16)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.stats()["num_preemptions"] > 0
    for prompt, a, b in zip(prompts, roomy, tight):
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "samples should differ"
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids  # seeded: the same draws under pressure
            want = hf_logprob(path, prompt, ca.token_ids)
            assert abs(ca.cumulative_logprob - want) < 2e-3
            assert abs(cb.cumulative_logprob - want) < 2e-3


BEAMS = [(1, 1.0, False), (4, 1.0, True), (4, 0.5, "never"), (8, 2.0, False), (8, -0.5, True)]
# Each family's beam prompts: its own and the next family's, the same whatever tests ran before.
BEAM_PROMPTS = [[_rng.randrange(3, 24) for _ in range(19)] for _ in FAMILY_ARCHS]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_beam_matches_transformers(beam_family_dirs, arch):
    path = beam_family_dirs[arch]
    i = FAMILY_ARCHS.index(arch)
    prompts = [[1, 5, 6, 7], BEAM_PROMPTS[i], BEAM_PROMPTS[(i + 1) % len(FAMILY_ARCHS)]]
    roomy = LLM(path, dtype="float32", device="cpu", debug_checks=True, block_size=8)
    tight = LLM(
        path, dtype="float32", device="cpu", debug_checks=True, block_size=8, num_kv_blocks=18, max_num_batched_tokens=12
    )
    ended_early = 0
    for k, lp, es in BEAMS:
        params = BeamSearchParams(
            beam_width=k, num_return_sequences=k, max_tokens=8, length_penalty=lp, early_stopping=es
        )
        for llm in (roomy, tight):
            for prompt, out in zip(prompts, llm.generate(prompts, params)):
                check(out, *hf_beam(path, prompt, k, k, lp, es), f"{arch} k={k} lp={lp} es={es} p={len(prompt)}")
                ended_early += sum(len(c.token_ids) < 8 for c in out.outputs)
    assert ended_early > 0, "EOS should end some hypotheses early"
    assert tight.stats()["num_preemptions"] > 0
