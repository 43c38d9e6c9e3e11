"""LoRA over a batch of several adapters: punica's segmented GEMMs (SGMV) in Triton.

The rows of one adapter are contiguous in the batch (a segment: start, length, slot); the weights of
the resident adapters are stacked by slot. ``lora_shrink`` computes ``t = x @ A[slot].T`` for every
segment in one launch, ``lora_expand`` adds ``t @ B[slot].T`` into the module's output in another.
Rows outside every segment (the base model's) are left as they are. Float32 inputs are multiplied
in IEEE float32 (no TF32), so results match the torch reference to rounding. ``lora_shrink_ref`` and
``lora_expand_ref`` are the references the kernels are tested against, under Triton's interpreter
on a CPU machine.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter multiplies bfloat16 tiles wrongly: there the kernels widen them to float32 first.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _sgmv_kernel(
    IN, W, OUT, SEG, nseg, N, K,
    s_in, s_wslot, s_wn, s_out,
    ADD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """``OUT[rows, :N] (+)= IN[rows, :K] @ W[slot, :N, :K].T`` over one segment's tile of rows
    (``ADD``: added to what ``OUT`` holds, else stored as float32)."""
    s = tl.program_id(0)
    start = tl.load(SEG + s)
    length = tl.load(SEG + nseg + s)
    slot = tl.load(SEG + 2 * nseg + s).to(tl.int64)
    if tl.program_id(1) * BM >= length:
        return
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    row_ok = rows < length
    col_ok = cols < N
    rows64 = (start + rows).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(IN + rows64[:, None] * s_in + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            W + slot * s_wslot + cols[None, :].to(tl.int64) * s_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), w)
    ptr = OUT + rows64[:, None] * s_out + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ADD:
        y = tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)
    else:
        tl.store(ptr, acc, mask=mask)


def _check(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"{what}: input {tuple(x.shape)} and weights {tuple(w.shape)} [slots, out, in] do not fit")
    if seg.dim() != 2 or seg.shape[0] != 3 or seg.dtype != torch.int32:
        raise ValueError(f"{what}: segments must be int32 [3, segments] (start, length, slot), got {tuple(seg.shape)}")
    if x.stride(1) != 1 or not w.is_contiguous() or not seg.is_contiguous():
        raise ValueError(f"{what}: the input must be row-contiguous, the weights and segments contiguous")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg: torch.Tensor, max_len: int) -> torch.Tensor:
    """x [T, in], a [slots, R, in], seg [3, S] (start, length, slot): float32 t [T, R] with
    ``t[rows] = x[rows] @ a[slot].T`` on each segment's rows, 0 elsewhere."""
    _check(x, a, seg, "lora_shrink")
    rank, k = a.shape[1], a.shape[2]
    t = torch.zeros((x.shape[0], rank), dtype=torch.float32, device=x.device)
    nseg = seg.shape[1]
    if nseg == 0 or max_len == 0:
        return t
    bn = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (nseg, triton.cdiv(max_len, 16), triton.cdiv(rank, bn))
    _sgmv_kernel[grid](
        x, a, t, seg, nseg, rank, k, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        ADD=False, BM=16, BN=bn, BK=32, IEEE=x.dtype == torch.float32 or INTERPRET,
    )
    return t


def lora_expand(t: torch.Tensor, b: torch.Tensor, y: torch.Tensor, seg: torch.Tensor, max_len: int) -> None:
    """t [T, R] float32, b [slots, out, R], y [T, out]: ``y[rows] += t[rows] @ b[slot].T`` on each
    segment's rows, in place."""
    _check(t, b, seg, "lora_expand")
    if y.dim() != 2 or y.shape != (t.shape[0], b.shape[1]) or y.stride(1) != 1:
        raise ValueError(f"lora_expand: output {tuple(y.shape)} must be row-contiguous [{t.shape[0]}, {b.shape[1]}]")
    nseg = seg.shape[1]
    if nseg == 0 or max_len == 0:
        return
    n, rank = b.shape[1], b.shape[2]
    grid = (nseg, triton.cdiv(max_len, 16), triton.cdiv(n, 64))
    _sgmv_kernel[grid](
        t, b, y, seg, nseg, n, rank, t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        ADD=True, BM=16, BN=64, BK=16, IEEE=y.dtype == torch.float32 or INTERPRET,
    )


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    t = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for start, length, slot in seg.T.tolist():
        t[start : start + length] = x[start : start + length].float() @ a[slot].float().T
    return t


def lora_expand_ref(t: torch.Tensor, b: torch.Tensor, y: torch.Tensor, seg: torch.Tensor) -> None:
    for start, length, slot in seg.T.tolist():
        rows = slice(start, start + length)
        y[rows] = (y[rows].float() + t[rows] @ b[slot].float().T).to(y.dtype)
