"""The engine with the Triton backend (interpreted on a CPU machine) gives the same greedy tokens
as transformers, and the same beams, on a tiny model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from batchgen.tiny import FAMILY_ARCHS  # noqa: E402
from tests.oracle import hf_greedy  # noqa: E402


def tiny_model(tmp_path, arch: str, seed: int, num_kv_heads: int, num_layers: int) -> str:
    """A 4-head, hidden-32 model: small enough for the Triton interpreter (experts and their size
    are the family's small defaults)."""
    from batchgen.tiny import make_model

    return str(
        make_model(
            tmp_path / "m",
            arch,
            seed=seed,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            num_kv_heads=num_kv_heads,
            num_layers=num_layers,
        )
    )


def triton_llm(path: str, **kwargs) -> LLM:
    """The engine on the Triton backend (interpreted on a CPU machine), float32, blocks of 8."""
    return LLM(path, dtype="float32", device="cpu", attention_backend="triton", block_size=8, **kwargs)


def test_greedy_and_forks_with_triton_backend(tmp_path):
    path = tiny_model(tmp_path, "qwen3", seed=3, num_kv_heads=2, num_layers=2)
    llm = triton_llm(path, num_kv_blocks=32)
    assert type(llm.engine.runner.backend).__name__ == "TritonAttention"
    prompts = [[5], [3, 9, 11, 40, 41, 42, 43, 44, 45], list(range(20, 37))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 4)
    # forks share blocks copy-on-write (the Triton block copy runs), results unchanged
    out = llm.generate([prompts[1]], SamplingParams(n=2, top_k=1, max_tokens=4, ignore_eos=True))[0]
    assert all(c.token_ids == outs[1].outputs[0].token_ids for c in out.outputs)
    assert llm.stats()["cow_copies"] > 0
    torch_llm = LLM(path, dtype="float32", device="cpu", block_size=8)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    assert [c.token_ids for c in llm.generate([prompts[2]], params)[0].outputs] == [
        c.token_ids for c in torch_llm.generate([prompts[2]], params)[0].outputs
    ]


def test_decode_graph_path_pads_buckets_without_touching_other_blocks(tmp_path):
    """The CUDA-graph decode path, run eagerly (``capture=False``) on a CPU: steps of 1..5 decode
    rows are padded to buckets 1 / 2 / 4 / 8 over static buffers and give transformers' tokens;
    padding rows write nothing (the KV cache equals a run without the graph path); a step larger than the biggest bucket falls
    back to the ordinary path."""
    from batchgen.model.graphs import DecodeGraphs, default_buckets

    assert default_buckets(8) == [1, 2, 4, 8] and default_buckets(20) == [1, 2, 4, 8, 16, 20]
    path = tiny_model(tmp_path, "llama", seed=4, num_kv_heads=1, num_layers=2)
    llm = triton_llm(path, num_kv_blocks=40)
    runner = llm.engine.runner
    runner.graphs = graphs = DecodeGraphs(runner, max_batch=4, capture=False)
    assert graphs.buckets == [1, 2, 4]
    prompts = [[5], [3, 9, 11, 40, 41, 42, 43, 44, 45], list(range(20, 37))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 4)
    assert graphs.replays > 0
    # padding rows wrote nothing: the cache equals that of the same run without the graph path
    fresh = [
        triton_llm(path, num_kv_blocks=40)
        for _ in range(2)
    ]
    fresh[0].engine.runner.graphs = DecodeGraphs(fresh[0].engine.runner, max_batch=4, capture=False)
    for x in fresh:
        x.engine.runner.kv_cache.zero_()
        x.generate(prompts, params)
    assert torch.allclose(fresh[0].engine.runner.kv_cache, fresh[1].engine.runner.kv_cache, atol=1e-5)
    # 6 decode rows > the largest bucket (4): the ordinary path, same tokens
    out = llm.generate(prompts[1:], SamplingParams(n=3, top_k=1, max_tokens=3, ignore_eos=True))
    for p, o in zip(prompts[1:], out):
        assert all(c.token_ids == hf_greedy(path, p, 3) for c in o.outputs)


def test_decode_graph_path_skips_steps_with_a_one_token_prefill_chunk(tmp_path):
    """Eight one-token prompts and a long one under a 9-token budget: the first step is nine
    one-token rows, one of them a prefill chunk that does not sample. Such a step must not take
    the decode-graph path (whose logits are one per row)."""
    from batchgen.model.graphs import DecodeGraphs

    path = tiny_model(tmp_path, "llama", seed=5, num_kv_heads=2, num_layers=1)
    llm = triton_llm(path, num_kv_blocks=40, max_num_batched_tokens=9)
    llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, max_batch=16, capture=False)
    prompts = [[5 + i] for i in range(8)] + [list(range(20, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 3)
    assert llm.engine.runner.graphs.replays > 0


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_every_family_with_triton_backend(tmp_path, arch):
    """Each family's attention (soft-capping, sinks, per-layer windows of 12 and RoPE, partial
    rotary, q/k norms) through the Triton kernels: greedy tokens equal transformers', prompts past
    the window, chunked prefill over cached blocks and a copy-on-write fork."""
    path = tiny_model(tmp_path, arch, seed=7, num_kv_heads=2, num_layers=2)
    llm = triton_llm(path, num_kv_blocks=32, max_num_batched_tokens=12)
    prompts = [[5], list(range(20, 37))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 3), f"{arch} prompt of {len(p)}"
    out = llm.generate([prompts[1]], SamplingParams(n=2, top_k=1, max_tokens=3, ignore_eos=True))[0]
    assert all(c.token_ids == outs[1].outputs[0].token_ids for c in out.outputs)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 16
