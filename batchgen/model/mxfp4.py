"""MXFP4, the format of gpt-oss's expert weights: groups of 32 FP4 (E2M1) values, two per byte
(low nibble first), sharing one power-of-two scale stored as a biased exponent (bias 127).
Checkpoints store ``NAME_blocks`` [..., rows, groups, 16] uint8 and ``NAME_scales`` [..., rows,
groups] uint8; batchgen keeps them so (``quant.QWeight.mxfp4``) and widens them per call.
``quantize`` writes the same format (for tests and for making small quantized checkpoints)."""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
SCALE_BIAS = 127
# byte -> (value of its low nibble, value of its high nibble)
_PAIRS = torch.tensor([(FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]) for b in range(256)], dtype=torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., rows, groups, 16] uint8 and [..., rows, groups] uint8 -> [..., rows, groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(expected blocks [..., groups, {GROUP // 2}])"
        )
    values = _PAIRS[blocks.int()].flatten(-2)  # [..., groups, 32] float32: each byte's two values
    return (values * scales_of(scales)[..., None]).flatten(-2).to(dtype)


def scales_of(exponents: torch.Tensor) -> torch.Tensor:
    """Biased exponents (uint8) -> the groups' scales, float32 powers of two (exact)."""
    return torch.ldexp(torch.ones(exponents.shape, device=exponents.device), exponents.to(torch.int32) - SCALE_BIAS)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] (cols a multiple of 32) -> (blocks, scales): each group's scale is the
    power of two that brings its largest magnitude to at most 6, values round to the nearest FP4."""
    *lead, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {GROUP} columns, got {cols}")
    groups = weight.float().reshape(*lead, cols // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponent.int())[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)
    codes = codes + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).reshape(*lead, cols // GROUP, GROUP // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exponent.int() + SCALE_BIAS).to(torch.uint8)
