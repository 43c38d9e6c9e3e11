"""``LLM.score_continuations`` against transformers: each continuation's total log-probability
(within 1e-4), its tokens' values and top alternatives, on every family, with prefix caching,
chunked prefill and preemption; the prompt computed once per prompt however many continuations it
has (the continuations fork copy-on-write); and clear errors for bad continuations."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, ScoreParams
from batchgen.scoring import continuation_ids
from batchgen.tiny import ARCHS, FAMILY_ARCHS, make_model
from tests.oracle import hf_model

_rng = random.Random(3)
SHARED = [_rng.randrange(3, 384) for _ in range(20)]
PROMPTS = [
    [7],
    [_rng.randrange(3, 384) for _ in range(9)],
    SHARED + [5],  # a shared prefix: cached blocks
    SHARED + [6, 8],
    [_rng.randrange(3, 384) for _ in range(37)],
]
CONTINUATIONS = [[[_rng.randrange(3, 384) for _ in range(n)] for n in (1, 4, 19)] for _ in PROMPTS]

VARIANTS = {
    "default": dict(),
    "preempt-block8": dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16),
    "chunked-block32": dict(block_size=32, max_num_batched_tokens=24),
}


@torch.no_grad()
def hf_token_logprobs(path: str, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log-softmax rows of one transformers forward pass over prompt + continuation, at the
    positions that predict the continuation's tokens: [len(continuation), vocab]."""
    logits = hf_model(path)(torch.tensor([prompt + continuation])).logits[0].float()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(continuation)], dim=-1)


@pytest.fixture(scope="module")
def all_dirs(model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("score_families")
    extra = {arch: str(make_model(root / arch, arch, seed=40 + i)) for i, arch in enumerate(FAMILY_ARCHS)}
    return {**{a: model_dirs[a] for a in ARCHS}, **extra}


def check_scores(path: str, outs, prompts, continuations, top_k: int | None = None) -> None:
    for prompt, conts, out in zip(prompts, continuations, outs, strict=True):
        assert out.error is None and out.prompt_token_ids == prompt
        assert [c.token_ids for c in out.continuations] == conts
        for cont, got in zip(conts, out.continuations, strict=True):
            want = hf_token_logprobs(path, prompt, cont)
            per_token = want.gather(1, torch.tensor(cont)[:, None]).squeeze(1)
            assert got.num_tokens == len(cont)
            assert abs(got.logprob - float(per_token.sum())) < 1e-4, (path, prompt, cont)
            if top_k is None:
                continue
            lp = got.logprobs
            assert len(lp) == len(cont)
            assert torch.allclose(torch.from_numpy(lp.logprobs), per_token, atol=1e-4)
            vals, ids = want.topk(top_k, dim=-1)
            assert torch.allclose(torch.from_numpy(lp.top_logprobs).float(), vals, atol=1e-4)
            if top_k:
                assert (torch.from_numpy(lp.top_ids).long() == ids).float().mean() > 0.95  # ties may swap
            ranks = (want > per_token[:, None]).sum(-1) + 1
            assert lp.ranks.tolist() == ranks.tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scores_equal_transformers_on_every_family(all_dirs, variant):
    for arch, path in all_dirs.items():
        llm = LLM(path, dtype="float32", device="cpu", **VARIANTS[variant])
        outs = llm.score_continuations(PROMPTS, CONTINUATIONS)
        check_scores(path, outs, PROMPTS, CONTINUATIONS)
        stats = llm.stats()
        assert stats["scored_continuations"] == sum(len(c) for c in CONTINUATIONS), arch
        if variant == "default":
            assert stats["prefix_cache_hit_tokens"] > 0, arch


def test_token_logprobs_and_top_k_equal_transformers(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    outs = llm.score_continuations(PROMPTS, CONTINUATIONS, logprobs=3)
    check_scores(llama_dir, outs, PROMPTS, CONTINUATIONS, top_k=3)
    entry = outs[1].continuations[1].logprobs[0]  # vLLM's dict: the token and its top 3
    token = CONTINUATIONS[1][1][0]
    assert token in entry and entry[token].rank >= 1 and entry[token].decoded_token is not None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_scoring_is_exact(llama_dir, mode):
    """A pool that holds about one prompt's continuations at a time: groups are preempted mid-way
    through their continuations (recompute, or swap to host blocks) and still score exactly."""
    prompts = [[_rng.randrange(3, 384) for _ in range(30)] for _ in range(6)]
    conts = [[[_rng.randrange(3, 384) for _ in range(n)] for n in (12, 25, 30, 7)] for _ in prompts]
    llm = LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=26, block_size=8,
              max_num_batched_tokens=128, preemption_mode=mode, swap_space=0.01)
    outs = llm.score_continuations(prompts, conts, logprobs=0)
    check_scores(llama_dir, outs, prompts, conts, top_k=0)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0


def test_the_prompt_is_computed_once_per_prompt(llama_dir):
    """Eight continuations of a 100-token prompt: 100 prompt tokens computed, not 800; the
    continuations share the prompt's blocks and copy only its last, partial one."""
    prompt = [_rng.randrange(3, 384) for _ in range(100)]
    conts = [[_rng.randrange(3, 384) for _ in range(16 + i)] for i in range(8)]
    llm = LLM(llama_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    out = llm.score_continuations(prompt, conts)[0]
    check_scores(llama_dir, [out], [prompt], [conts])
    stats = llm.stats()
    assert stats["score_prompt_tokens_computed"] == len(prompt)
    assert stats["score_continuation_tokens_computed"] == sum(len(c) - 1 for c in conts)
    assert 0 < stats["cow_copies"] <= len(conts) - 1  # the partial block 6 (tokens 96..99), once per writer but the last


def test_text_continuations_split_like_the_whole_text(llama_dir):
    """A text continuation gets the tokens of prompt + continuation tokenized together, past the
    prompt's; a list of texts is scored against one prompt; token ids are taken as given."""
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    prompt, conts = "the cat sat on", [" the mat", " a hat", " the"]
    out = llm.score_continuations(prompt, conts)[0]
    prompt_ids = tok(prompt)["input_ids"]
    assert out.prompt_token_ids == prompt_ids
    for text, got in zip(conts, out.continuations, strict=True):
        whole = tok(prompt + text)["input_ids"]
        assert got.token_ids == whole[len(prompt_ids):] and got.text.strip() == text.strip()
    by_ids = llm.score_continuations([prompt_ids], [[c.token_ids for c in out.continuations]])[0]
    assert [c.logprob for c in by_ids.continuations] == pytest.approx([c.logprob for c in out.continuations], abs=1e-6)
    assert continuation_ids(tok, None, [5, 6], [9, 10]) == [9, 10]


def test_bad_continuations_are_refused_naming_the_problem(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="prompt 1: continuation is empty"):
        llm.score_continuations(["a b", "c d"], [["x"], [""]])
    with pytest.raises(ValueError, match="continuation 0 .* exceed the model's context"):
        llm.score_continuations([[5] * 40], [[[6] * 30]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.score_continuations([[5, 6]], [[[10**6]]])
    with pytest.raises(ValueError, match="continuations for 1 prompts, and 2 prompts"):
        llm.score_continuations(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="continuations must be non-empty|non-empty list"):
        ScoreParams(continuations=[])
