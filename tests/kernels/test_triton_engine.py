"""The engine with the Triton backend (interpreted on a CPU machine) gives the same greedy tokens
as transformers, and the same beams, on a tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from batchgen import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from tests.oracle import hf_greedy  # noqa: E402


def test_greedy_and_forks_with_triton_backend(tmp_path):
    from batchgen.tiny import make_model

    path = str(
        make_model(
            tmp_path / "m",
            "qwen3",
            seed=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            num_kv_heads=2,
            num_layers=2,
        )
    )
    llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=32)
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
