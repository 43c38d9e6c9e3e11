"""The LoRA kernels (punica-style segmented shrink and expand, ``batchgen_kernels.lora``) against
their torch references under Triton's interpreter, and the engine on them (the Triton backend)
against transformers + peft, a mixed batch of two adapters and base rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")

from batchgen import LLM, LoRARequest, SamplingParams  # noqa: E402
from batchgen_kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref  # noqa: E402
from scripts.fixtures.models import make_adapter  # noqa: E402
from tests.api.test_lora import oracle_greedy  # noqa: E402
from tests.kernels.test_triton_engine import tiny_model  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_shrink_and_expand_equal_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(45, 72, generator=gen).to(dtype)
    a = torch.randn(3, 48, 72, generator=gen).to(dtype)  # 3 slots, rank 48 (3 parts of 16), in 72
    b = torch.randn(3, 100, 48, generator=gen).to(dtype)
    # segments out of order, one empty, one longer than a row tile; rows 0-4 and 41-44 in none
    seg = torch.tensor([[5, 23, 30, 40], [18, 7, 11, 0], [2, 0, 1, 1]], dtype=torch.int32)
    t = lora_shrink(x, a, seg, 18)
    want_t = lora_shrink_ref(x, a, seg)
    assert torch.allclose(t, want_t, rtol=1e-4, atol=1e-3)
    y = torch.randn(45, 100, generator=gen).to(dtype)
    want_y, before = y.clone(), y.clone()
    lora_expand(t, b, y, seg, 18)
    lora_expand_ref(t, b, want_y, seg)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.float(), want_y.float(), rtol=tol, atol=tol)
    assert torch.equal(y[:5], before[:5]) and torch.equal(y[41:], before[41:])  # base rows untouched
    assert not torch.equal(y[5:23], before[5:23])


def test_bad_arguments_are_named():
    x, a = torch.zeros(4, 8), torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(x, a, torch.zeros(3, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, torch.zeros(2, 4, 8), torch.zeros(3, 1, dtype=torch.int64), 4)


def test_engine_on_the_triton_kernels_equals_peft(tmp_path):
    path = tiny_model(tmp_path, "llama", seed=3, num_kv_heads=2, num_layers=2)
    first = str(make_adapter(tmp_path / "a", path, rank=8, alpha=16, seed=1, scale=0.2))
    second = str(make_adapter(tmp_path / "b", path, rank=4, alpha=8, seed=2, scale=0.2, targets=["q_proj", "v_proj"]))
    llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton", block_size=8,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.engine.runner.lora.stacks is not None  # the slot-stacked weights of the kernels
    prompts = [[5, 6, 7], [3, 9, 11, 40, 41, 42, 43, 44, 45], [5, 6, 7], [20, 21]]
    loras = [LoRARequest("a", 1, first), None, LoRARequest("b", 2, second), LoRARequest("a", 1, first)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        want = oracle_greedy(path, None if lora is None else lora.lora_path, prompt, 4)
        assert out.outputs[0].token_ids == want, lora
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
