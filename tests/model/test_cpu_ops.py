"""The compiled elementwise kernels (``kernels/batchgen_kernels/cpu_ops.cpp``: RMSNorm, SwiGLU, rotary embeddings,
the KV-cache store, block copies and zeroing)
against the torch code they replace (``batchgen.model.layers``, ``batchgen.model.moe``), in
float32 and bfloat16, on contiguous and strided inputs; and an engine with them switched off
against one with them on.

bfloat16 results must equal torch's bit for bit except where the two round a value that lies
within float32 noise of a bf16 rounding boundary (a sum taken in another order, the exponential's
last bits): at most one unit in the last place, on a small share of the elements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams
from batchgen.model import layers
from batchgen.model.attention import write_kv
from batchgen.model.layers import apply_rotary, rms_norm
from batchgen.model.moe import swiglu
from batchgen_kernels import cpu, cpu_ops
from batchgen_kernels.reference import write_kv_ref

if cpu.compiler() is None:
    pytest.skip("no C++ compiler: the model keeps the torch code", allow_module_level=True)


@pytest.fixture
def torch_code(monkeypatch):
    """Runs its test's reference calls on the torch code."""

    def reference(fn, *args):
        monkeypatch.setattr(layers, "FUSED_CPU_OPS", False)
        try:
            return fn(*args)
        finally:
            monkeypatch.setattr(layers, "FUSED_CPU_OPS", True)

    return reference


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    ulp = 2.0 ** (torch.frexp(want.float()).exponent.float() - 8)  # one bf16 step at each value
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) < 0.01  # nearly everything identical


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (7, 576), (5, 72), (300, 512)])  # 72: a tail; 300 x 512: threaded
def test_rms_norm(torch_code, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    w = (1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    assert layers.fused_cpu_ops(x, w, kernel="rms_norm")
    assert_close(rms_norm(x, w, 1e-6), torch_code(rms_norm, x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (7, 576), (5, 72), (300, 512)])
def test_residual_addition_then_rms_norm(torch_code, dtype, rows, dim):
    """The decoder's residual addition fused with the next norm, against torch's addition then
    the norm: the sum as the new residual, and its norm."""
    gen = torch.Generator().manual_seed(rows * dim)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    residual = (20 * torch.randn(rows, dim, generator=gen)).to(dtype)  # the sum rounds in bf16
    w = (1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    normed, total = layers.add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_total = torch_code(layers.add_rms_norm, x, residual, w, 1e-6)
    assert torch.equal(total, residual + x) and torch.equal(want_total, residual + x)
    assert_close(normed, want_normed)
    # without a weight (a family with no norm there): the sum, twice
    plain, total = layers.add_rms_norm(x, residual, None, 1e-6)
    assert plain is total and torch.equal(total, residual + x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 40), (9, 1536), (100, 1536)])
def test_swiglu(torch_code, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -20.0, 0.0, 1e-8, 20.0, 100.0])  # far tails of silu
    assert_close(swiglu(gate_up, F.silu), torch_code(swiglu, gate_up, F.silu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 200])
@pytest.mark.parametrize("d", [64, 40])  # 40: a tail past the 16 lanes
def test_rotary_on_a_view_of_the_fused_qkv(torch_code, dtype, tokens, d):
    gen = torch.Generator().manual_seed(tokens)
    h, kvh = 9, 3
    qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=gen).to(dtype)
    qk = qkv[:, : (h + kvh) * d].view(tokens, h + kvh, d)  # strided over tokens
    angles = torch.rand(tokens, d // 2, generator=gen) * 100
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    got = apply_rotary(qk, cos, sin)
    assert got.is_contiguous()
    assert_close(got, torch_code(apply_rotary, qk, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_kv_write_from_views_of_the_fused_qkv(dtype, block_size):
    """The engine's store (``attention.write_kv``, on the kernel) against the reference loop, from
    strided views (of a fused qkv output, and of a wider buffer) into scattered slots; the other slots keep what they held."""
    gen = torch.Generator().manual_seed(block_size)
    tokens, h, kvh, d, blocks = 37, 9, 3, 64, 12
    qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=gen).to(dtype)
    k = qkv[:, h * d : (h + kvh) * d].view(tokens, kvh, d)
    v = torch.randn(tokens, (kvh + 1) * d, generator=gen).to(dtype)[:, d:].view(tokens, kvh, d)  # another stride
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    k_cache = torch.randn(kvh, blocks, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(kvh, blocks, block_size, d, generator=gen).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, want_k, want_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    with pytest.raises(IndexError, match="slot outside"):
        cpu_ops.kv_write(k[:2], v[:2], k_cache, v_cache, torch.tensor([0, blocks * block_size]))
    assert torch.equal(k_cache, before)  # nothing written


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_copies_and_zeroing(dtype):
    """The runner's copy-on-write copies and zeroing of new blocks against torch's indexing on the
    paged cache's shape ([layers, K / V, kv heads, blocks, block_size, dim]); the other blocks keep
    what they held; blocks out of range raise with nothing touched; copies that are not
    independent are refused."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(3, 2, 2, 11, 4, 8, generator=gen).to(dtype)
    want = cache.clone()
    src, dst = [1, 4, 4, 0], [7, 2, 9, 10]
    want[:, :, :, dst] = want[:, :, :, src]
    cpu_ops.copy_blocks(cache, src, dst)
    assert torch.equal(cache, want)
    want[:, :, :, [3, 7]] = 0
    cpu_ops.zero_blocks(cache, [3, 7])
    assert torch.equal(cache, want)
    with pytest.raises(IndexError, match="outside"):
        cpu_ops.copy_blocks(cache, [1, 11], [5, 6])
    with pytest.raises(IndexError, match="outside"):
        cpu_ops.zero_blocks(cache, [2, -1])
    with pytest.raises(ValueError, match="repeats or is also a source"):
        cpu_ops.copy_blocks(cache, [1, 2], [2, 5])
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 7), (5, 576), (300, 1536)])
def test_w8a8_rounding_of_tokens_equals_torchs_bit_for_bit(dtype, rows, dim):
    """W8A8's per-token rounding of a projection's input: the same operations in the same order as
    ``quant.fake_quantize_tokens``, so every value equals it exactly (an all-zero row included,
    rows whose scales span six orders of magnitude, values on a rounding tie)."""
    from batchgen.model.quant import fake_quantize_tokens

    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen) * torch.logspace(-4, 2, rows)[:, None]
    x[0, :2] = torch.tensor([127.0, 0.5])  # 0.5 of a step: ties round to even
    if rows > 1:
        x[1] = 0
    x = x.to(dtype)
    want = fake_quantize_tokens(x.float()).to(dtype)
    assert torch.equal(cpu_ops.round_tokens_int8(x), want)
    strided = x[:, ::2]  # a view: copied to rows first
    assert torch.equal(cpu_ops.round_tokens_int8(strided), fake_quantize_tokens(strided.float()).to(dtype))


def test_takes_only_what_it_runs():
    x = torch.ones(2, 4)
    assert cpu_ops.takes(x, torch.ones(4))
    assert not cpu_ops.takes(x.half(), torch.ones(4).half())
    assert not cpu_ops.takes(x, torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_and_without_the_kernels(model_dirs, monkeypatch, dtype):
    """Same sampled tokens in float32 (log-probabilities within 1e-4); in bfloat16, where a one-step
    rounding difference can flip a near-tie, the same greedy tokens on most positions."""
    params = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=3, ignore_eos=True, logprobs=0)
    prompts = [[1, 5, 9, 200, 31], [1] + list(range(40, 70))]
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(layers, "FUSED_CPU_OPS", fused)
        llm = LLM(model_dirs["qwen3"], dtype=dtype, max_num_seqs=8)
        runs.append(llm.generate(prompts, params))
    same = total = 0
    for a, b in zip(*runs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            if dtype == "float32":
                assert x.token_ids == y.token_ids
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
            same += sum(p == q for p, q in zip(x.token_ids, y.token_ids))
            total += len(x.token_ids)
    assert same >= 0.75 * total
