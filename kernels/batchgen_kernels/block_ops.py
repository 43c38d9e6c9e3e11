"""Block copy for copy-on-write: every pair of a step over every layer in one launch. (The swap
between device and host caches is ``batchgen_kernels.swap.swap_blocks``, plain torch.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen_kernels.swap import swap_blocks  # noqa: F401 - re-exported


@triton.jit
def _copy_blocks_kernel(C, SRC, DST, stride_plane, stride_block, N: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # 64-bit offsets: the whole pool passes 2**31 elements
    src = tl.load(SRC + pair).to(tl.int64)
    dst = tl.load(DST + pair).to(tl.int64)
    base = C + plane * stride_plane
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < N
        x = tl.load(base + src * stride_block + offs, mask=m)
        tl.store(base + dst * stride_block + offs, x, mask=m)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache [..., NB, BS, D] contiguous (all layers, K and V, heads in the leading dims);
    copies block ``src[i]`` into ``dst[i]`` in every leading plane. ``dst`` must not repeat."""
    if not kv_cache.is_contiguous():
        raise ValueError("copy_blocks: the cache must be contiguous")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"copy_blocks: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-d")
    if src.numel() == 0:
        return
    nb, bs, d = kv_cache.shape[-3:]
    planes = kv_cache.numel() // (nb * bs * d)
    view = kv_cache.view(planes, nb, bs * d)
    _copy_blocks_kernel[(src.numel(), planes)](
        view,
        src,
        dst,
        view.stride(0),
        view.stride(1),
        N=bs * d,
        CHUNK=min(1024, triton.next_power_of_2(bs * d)),
    )
