"""Set the tokens a grammar does not allow to -inf: structured outputs' mask on the logits' device.

The mask is xgrammar's int32 bitmask, one row per row of the scores and one bit per token (bit
``t % 32`` of word ``t // 32``); only ``rows`` are touched. The engine builds the mask on the CPU
(``batchgen/engine/structured.py``) and applies it here on a GPU; ``reference.token_mask_ref`` is the
torch reference the kernel is tested against, under Triton's interpreter on a CPU machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_mask_kernel(S, M, ROWS, vocab, stride_s, stride_m, BLOCK: tl.constexpr):
    row = tl.load(ROWS + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(M + row * stride_m + offs // 32, mask=inside, other=0)
    allowed = (words >> (offs % 32)) & 1  # arithmetic shift: bit 31 of a negative word reads 1
    ptr = S + row * stride_s + offs
    scores = tl.load(ptr, mask=inside)
    tl.store(ptr, tl.where(allowed == 0, float("-inf"), scores), mask=inside)


def token_mask(scores: torch.Tensor, mask: torch.Tensor, rows: list[int], block: int = 1024) -> None:
    """scores [R, V] (float, last dim contiguous); mask [R, ceil(V / 32)] int32 on the same device."""
    if scores.dim() != 2 or mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"token_mask: scores {tuple(scores.shape)} and mask {tuple(mask.shape)} need one row each")
    if mask.dtype != torch.int32 or mask.shape[1] * 32 < scores.shape[1]:
        raise ValueError(f"token_mask: mask must be int32 with a bit per token, got {mask.dtype} {tuple(mask.shape)}")
    if scores.stride(1) != 1 or mask.stride(1) != 1 or mask.device != scores.device:
        raise ValueError("token_mask: scores and mask must be row-contiguous on one device")
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int32, device=scores.device)
    grid = (len(rows), triton.cdiv(scores.shape[1], block))
    _token_mask_kernel[grid](scores, mask, index, scores.shape[1], scores.stride(0), mask.stride(0), BLOCK=block)

