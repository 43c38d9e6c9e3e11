"""Store each token's K and V in its slot of the paged cache (slot < 0: padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOTS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,
    BS: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a layer's cache can pass 2**31 elements
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, DP)
        m = offs < D
        b = slot // BS
        o = slot % BS
        k = tl.load(K + t * stride_kt + h * stride_kh + offs, mask=m)
        v = tl.load(V + t * stride_vt + h * stride_vh + offs, mask=m)
        dst = h * stride_ch + b * stride_cb + o * stride_cs + offs
        tl.store(KC + dst, k, mask=m)
        tl.store(VC + dst, v, mask=m)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v [T, KVH, D]; caches [KVH, NB, BS, D] (same dtype); slots [T] int (block * BS + offset)."""
    t, kvh, d = k.shape
    if (
        v.shape != k.shape
        or k_cache.shape != v_cache.shape
        or k_cache.shape[0] != kvh
        or k_cache.shape[3] != d
    ):
        raise ValueError(
            f"write_kv: shapes k {tuple(k.shape)} v {tuple(v.shape)} caches {tuple(k_cache.shape)}"
        )
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"write_kv: dtypes {k.dtype}/{v.dtype} vs cache {k_cache.dtype}")
    if slots.shape != (t,):
        raise ValueError(f"write_kv: slots must be [{t}], got {tuple(slots.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("write_kv: the head dimension and the caches must be contiguous")
    if t == 0:
        return
    _write_kv_kernel[(t, kvh)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BS=k_cache.shape[2],
        D=d,
        DP=triton.next_power_of_2(d),
    )
