"""Linear layers: oneDNN's packed GEMM equals ``F.linear``; the engine uses it on the CPU unless
told otherwise, and the setting is validated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM
from batchgen.config import EngineConfig
from batchgen.model.linear import Linear, packing_wanted
from batchgen.model.malloc import keep_freed_memory

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_f_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    layer = Linear(w, b, pack=True)
    assert layer.packed is not None
    x = torch.randn(rows, 80, generator=gen)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = layer(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()
    # a non-contiguous input (a slice of a wider activation) gives the same result
    wide = torch.randn(rows, 160, generator=gen)
    assert torch.allclose(layer(wide[:, ::2]), F.linear(wide[:, ::2], w, b), atol=1e-4)


@needs_onednn
def test_packed_linear_bfloat16():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=gen).bfloat16()
    x = torch.randn(5, 48, generator=gen).bfloat16()
    layer = Linear(w, pack=True)
    want = F.linear(x.float(), w.float())
    assert layer(x).dtype == torch.bfloat16
    assert ((layer(x).float() - want).abs().max() / want.abs().max()) < 2e-2


def test_linear_backend_setting():
    cpu = torch.device("cpu")
    assert not packing_wanted("torch", cpu, torch.float32)
    assert not packing_wanted("auto", cpu, torch.float16)  # oneDNN fp16 GEMMs are not used
    with pytest.raises(ValueError, match="linear_backend='onednn' needs a CPU device"):
        packing_wanted("onednn", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, onednn, torch, got 'mkl'"):
        EngineConfig(model="m", linear_backend="mkl")


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_engine_packs_its_cpu_weights_unless_told_not_to(tmp_path, arch):
    from batchgen.tiny import make_model

    path = str(make_model(tmp_path / arch, arch))
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.stats()["linear_backend"] == "onednn"
    packed = llm.engine.runner.model
    # qkv, o and the MLP's two per layer, and the LM head; the one MoE layer (of 2) has a router,
    # two per expert (6) and the shared expert's two and its gate in place of the MLP's two
    moe = 1 + 2 * 6 + 3 - 2 if arch == "qwen2_moe" else 0
    assert len(packed.linears) == 4 * 2 + 1 + moe
    assert all(layer.packed is not None for layer in packed.linears)
    plain_llm = LLM(path, dtype="float32", device="cpu", linear_backend="torch")
    assert plain_llm.stats()["linear_backend"] == "torch"
    plain = plain_llm.engine.runner.model
    assert plain.lm_head.packed is None and plain.layers[0].qkv.packed is None


def test_freed_memory_stays_in_the_process():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory() and keep_freed_memory()
