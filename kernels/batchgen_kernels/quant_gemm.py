"""Weight-only quantized GEMM in Triton: ``y = x @ dequantize(W).T`` with the weight dequantized in
registers, tile by tile, never in memory.

Weights (``QuantLinear``'s GPU layout, ``batchgen/model/quant.py``):

- int4: ``packed`` uint8 [N, K / 2], input 2k in the low nibble and 2k + 1 in the high one, values
  0..15; ``scale`` and ``zero`` float32 [N, K / group]: ``w = (q - zero) * scale``;
- int8: ``packed`` int8 [N, K] (signed, ``zero`` all 0) or uint8 with ``zero``;
- fp8: ``packed`` float8_e4m3fn [N, K], ``scale`` [N, 1] (per row; a per-tensor scale repeated)
  or [N, K / group] (block-wise: a row block's scales repeated over its rows);
- mxfp4 (gpt-oss's experts): ``packed`` uint8 [N, K / 2], two E2M1 codes a byte as int4's values,
  ``scale`` float32 [N, K / 32], each group's power of two.

One program computes a [BM, BN] tile of ``y`` over K in steps of ``BK`` (a multiple of the group
size or a divisor of it), accumulating in float32; float32 inputs multiply in IEEE float32.
``quant_gemm_ref`` is the torch reference the kernel is tested against under Triton's interpreter.
Where the device has FP8 tensor cores, ``torch._scaled_mm`` is the faster path for FP8 weights with
FP8 activations; this kernel keeps the activations as they are.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter multiplies bfloat16 tiles wrongly: there the kernel widens them to float32 first.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the E2M1 codes' values (batchgen.model.mxfp4's table; the reference reads it, the kernel computes it)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
KINDS = ("int4", "int8", "fp8", "mxfp4")


@triton.jit
def _quant_gemm_kernel(
    X, W, S, Z, Y, M, N, K, GROUP,
    sx, sw, ss, sy,
    KIND: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(X + rows64[:, None] * sx + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        mask = col_ok[None, :] & k_ok[:, None]
        if KIND == 0 or KIND == 3:  # int4 / MXFP4: two per byte along K
            byte = tl.load(W + cols64[None, :] * sw + (ks // 2)[:, None], mask=mask, other=0).to(tl.int32)
            c = (byte >> ((ks % 2) * 4)[:, None]) & 15
            if KIND == 0:
                q = c.to(tl.float32)
            else:  # E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal
                e = (c >> 1) & 3
                half = (c & 1).to(tl.float32) * 0.5
                mag = tl.where(e == 0, half, (1.0 + half) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
                q = tl.where(c >= 8, -mag, mag)
        elif KIND == 1:
            q = tl.load(W + cols64[None, :] * sw + ks[:, None], mask=mask, other=0).to(tl.float32)
        else:  # fp8 (no fp8 "other" value): masked lanes zeroed after the load
            q = tl.load(W + cols64[None, :] * sw + ks[:, None], mask=mask).to(tl.float32)
            q = tl.where(mask, q, 0.0)
        g = ks // GROUP
        s = tl.load(S + cols64[None, :] * ss + g[:, None], mask=mask, other=0.0)
        if HAS_ZERO:
            z = tl.load(Z + cols64[None, :] * ss + g[:, None], mask=mask, other=0.0)
            w = (q - z) * s  # [BK, BN]
        else:
            w = q * s
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = Y + rows64[:, None] * sy + cols64[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quant_gemm(
    x: torch.Tensor, kind: str, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """x [M, K] (rows contiguous); the weight as in the module docstring; returns [M, N] in x's dtype."""
    if kind not in KINDS:
        raise ValueError(f"quant_gemm: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    m, k = x.shape
    n = packed.shape[0]
    width = k // 2 if kind in ("int4", "mxfp4") else k
    if packed.dim() != 2 or packed.shape[1] != width or not packed.is_contiguous():
        raise ValueError(f"quant_gemm: {kind} weight must be contiguous [{n}, {width}], got {tuple(packed.shape)}")
    if k % group or scale.shape != (n, k // group) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"quant_gemm: scale must be contiguous float32 [{n}, {k // max(group, 1)}], got "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if zero is not None and (zero.shape != scale.shape or zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError(f"quant_gemm: zero must be like scale, got {tuple(zero.shape)} {zero.dtype}")
    if x.stride(1) != 1:
        raise ValueError("quant_gemm: x must have contiguous rows")
    bk = 32 if group % 32 == 0 else group & -group  # a power of two dividing the group
    if bk < 16:
        raise ValueError(f"quant_gemm: group {group} is not a multiple of 16")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _quant_gemm_kernel[grid](
        x, packed, scale, scale if zero is None else zero, y, m, n, k, group,
        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        KIND=KINDS.index(kind), HAS_ZERO=zero is not None, IEEE=x.dtype == torch.float32 or INTERPRET,
        BM=16, BN=64, BK=bk,
    )
    return y


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K / 2]: input 2k in the low nibble, 2k + 1 in the high one."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def quant_gemm_ref(
    x: torch.Tensor, kind: str, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    if kind in ("int4", "mxfp4"):
        q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        q = torch.tensor(FP4_VALUES)[q.long()] if kind == "mxfp4" else q.float()
    else:
        q = packed.float()
    s = scale.repeat_interleave(group, dim=1)
    w = (q - zero.repeat_interleave(group, dim=1)) * s if zero is not None else q * s
    return (x.float() @ w.T).to(x.dtype)
