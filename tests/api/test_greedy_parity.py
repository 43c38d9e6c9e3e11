"""Greedy tokens equal a transformers forward-pass greedy decode, for every architecture, with
prefix caching on and off, a KV pool small enough to preempt, a tiny token budget (chunked
prefill), block sizes 8 / 16 / 32, both linear backends, both CPU attention backends, and swap
preemption."""

from __future__ import annotations

import random

import pytest

from batchgen import LLM, SamplingParams
from tests.oracle import hf_greedy

MAX_NEW = 10
_rng = random.Random(0)
SHARED = [_rng.randrange(3, 384) for _ in range(33)]
PROMPTS = [
    [5],  # one token
    [_rng.randrange(3, 384) for _ in range(15)],
    [_rng.randrange(3, 384) for _ in range(16)],
    [_rng.randrange(3, 384) for _ in range(17)],
    [_rng.randrange(3, 384) for _ in range(70)],  # longer than a prefill chunk below
    SHARED + [7, 8],
    SHARED + [9],
]

VARIANTS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "preempt": dict(num_kv_blocks=12, block_size=8),
    "tiny-budget": dict(max_num_batched_tokens=8),
    "block8": dict(block_size=8),
    "block32": dict(block_size=32, max_num_batched_tokens=24),
    "linear-torch": dict(linear_backend="torch"),  # F.linear instead of oneDNN's packed GEMM
    # the torch attention backend (decode rows in shared-prefix groups) instead of the CPU kernel
    "attention-torch": dict(attention_backend="torch"),
    "swap": dict(num_kv_blocks=12, block_size=8, preemption_mode="swap", swap_space_gb=0.01),
    # a one-block host pool: most preemptions fall back to recompute
    "swap-host-full": dict(num_kv_blocks=12, block_size=8, preemption_mode="swap", swap_space_gb=1e-9),
}

_expected: dict[tuple[str, int], list[int]] = {}


def expected(path: str, i: int) -> list[int]:
    key = (path, i)
    if key not in _expected:
        _expected[key] = hf_greedy(path, PROMPTS[i], MAX_NEW)
    return _expected[key]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(model_dirs, arch, variant):
    path = model_dirs[arch]
    llm = LLM(path, dtype="float32", device="cpu", debug_checks=True, **VARIANTS[variant])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected(path, i), f"prompt {i} ({len(PROMPTS[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    if variant == "preempt":
        assert stats["num_preemptions"] > 0
    if variant == "swap":
        assert stats["num_swap_outs"] > 0 and stats["swapped_blocks"] > 0
    if variant == "swap-host-full":
        assert stats["num_preemptions"] > stats["num_swap_outs"]
    # Everything is free again once all requests are done.
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks
    assert not llm.engine.bm.swapped and not llm.engine.scheduler.swapped
    llm.engine.bm.check_invariants()


def test_prefix_cache_hits_across_calls_and_results_unchanged(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu", block_size=16, debug_checks=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([PROMPTS[5]], params)[0]
    second = llm.generate([PROMPTS[6]], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32
    assert second.outputs[0].token_ids == expected(llama_dir, 6)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 32

    off = LLM(llama_dir, dtype="float32", device="cpu", block_size=16, enable_prefix_caching=False)
    off.generate([PROMPTS[5]], params)
    assert off.generate([PROMPTS[6]], params)[0].num_cached_tokens == 0


def test_text_prompts_and_eos_stop(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    tok = llm.tokenizer
    text = "the quick brown fox"
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0]
    ids = tok(text)["input_ids"]
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, ids, MAX_NEW)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_garbage_in_unwritten_kv_slots_never_leaks(model_dirs, arch):
    """The KV pool is allocated uninitialized; whatever an unwritten slot holds (NaN here), masked
    attention must not see it (new blocks are zeroed; the runner's null block pads block tables)."""
    path = model_dirs[arch]
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_kv_blocks=40)
    llm.engine.runner.kv_cache.fill_(float("nan"))
    llm.engine.runner.zero_blocks([llm.engine.runner.null_block])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected(path, i), f"prompt {i}"
    # n > 1 exercises grouped attention over forked (shared) blocks
    out = llm.generate([PROMPTS[4]], SamplingParams(n=3, top_k=1, max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert all(c.token_ids == expected(path, 4) for c in out.outputs)
