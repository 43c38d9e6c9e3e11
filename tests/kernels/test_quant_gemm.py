"""The weight-only quantized GEMM kernel (``batchgen_kernels.quant_gemm``) against its torch reference
under Triton's interpreter: int4 two per byte with zero points, int8 signed and with zero points,
FP8 with per-row or per-block scales; odd row counts and group sizes; and ``QuantLinear`` on the kernel (its
GPU layout, built from each format's weights) against the dequantized weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen.model.quant import QuantFormat, QuantLinear  # noqa: E402
from batchgen_kernels.quant_gemm import pack_int4, quant_gemm, quant_gemm_ref  # noqa: E402
from scripts.fixtures.quant import quantization_config, quantize_weight  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kind,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", 128), ("fp8", 128), ("fp8", 32), ("mxfp4", 32)]
)
def test_the_kernel_equals_the_reference(kind, group, dtype):
    gen = torch.Generator().manual_seed(0)
    m, n, k = 19, 72, 128
    x = torch.randn(m, k, generator=gen).to(dtype)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = None
    if kind == "int4":
        packed = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
        zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    elif kind == "int8":
        packed = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    elif kind == "mxfp4":  # every code in both nibbles; scales powers of two from 2^-8 to 2^2
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        packed[0, :16] = torch.arange(16, dtype=torch.uint8) * 17
        scale = torch.ldexp(torch.ones(n, k // group), torch.randint(-8, 3, (n, k // group), generator=gen))
    else:
        packed = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
    got = quant_gemm(x, kind, packed, scale, zero, group)
    want = quant_gemm_ref(x, kind, packed, scale, zero, group)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_quant_linear_runs_mxfp4_experts_on_the_kernel():
    """gpt-oss's MXFP4 projections on the kernel (codes as stored, exponents as float32 powers of
    two) against ``mxfp4.dequantize``'s weight."""
    from batchgen.model import mxfp4
    from batchgen.model.quant import QWeight

    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 1, 96)
    blocks, scales = mxfp4.quantize(w)
    layer = QuantLinear(QWeight.mxfp4(blocks, scales), None, torch.device("cpu"), torch.float32, triton=True)
    assert layer.path == "triton-mxfp4"
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))
    want = x @ mxfp4.dequantize(blocks, scales).reshape(48, 96).T
    assert torch.allclose(layer(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_arguments_are_checked():
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="int4 weight must be"):
        quant_gemm(x, "int4", torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 2), None, 32)
    with pytest.raises(ValueError, match="scale must be"):
        quant_gemm(x, "int8", torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 3), None, 32)
    with pytest.raises(ValueError, match="kind must be"):
        quant_gemm(x, "int2", torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 2), None, 32)
    with pytest.raises(ValueError, match="group 8 is not a multiple of 16"):
        quant_gemm(x, "int8", torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 8), None, 8)


@pytest.mark.parametrize(
    "fmt,opts",
    [("gptq", dict(bits=4, group=32, sym=False, desc_act=True)), ("awq", dict(group=32, sym=False)),
     ("ct-int4", dict(group=32)), ("gptq", dict(bits=8, group=32, sym=False)), ("ct-w8a8", {}),
     ("ct-fp8", dict(per_channel=True)), ("ct-fp8", {}), ("fp8", dict(block=(32, 32))),
     ("ct-fp8", dict(per_channel="block", block=(16, 48)))],
)
def test_quant_linear_on_the_kernel_equals_the_dequantized_weight(fmt, opts):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    tensors, deq = quantize_weight(w, fmt, **opts)
    named = {f"p.{k}": v for k, v in tensors.items()}
    qw = QuantFormat.of(quantization_config(fmt, **opts)).read(lambda n: named.pop(n), lambda n: n in named, "p")
    layer = QuantLinear(qw, None, torch.device("cpu"), torch.float32, triton=True)
    assert layer.path.startswith("triton-")
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    if fmt == "ct-w8a8":
        s = x.abs().amax(-1, keepdim=True) / 127
        x_used = torch.round(x / s).clamp(-128, 127) * s
    else:
        x_used = x
    assert torch.allclose(layer(x), x_used @ deq.T, rtol=1e-4, atol=1e-4)
