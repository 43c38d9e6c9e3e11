"""The decoder layer's elementwise steps on the compiled CPU kernel (``cpu_ops.cpp``): RMSNorm
(alone, or after the residual addition), SwiGLU and rotary embeddings, one pass each instead of
torch's chains of operators and temporaries, with torch's rounding points kept in bfloat16; the
KV-cache store (``kv_write``) and the copy-on-write block copies and zeroing of new blocks
(``copy_blocks``, ``zero_blocks``).
``batchgen.model.layers`` and ``batchgen.model.attention`` use them on the CPU where the library
builds (``available``); their torch code is the reference and the fallback."""

from __future__ import annotations

import torch

from batchgen_kernels.cpu import available, load
from batchgen_kernels.cpu_args import expect

# the kernels' name suffix per dtype (cpu_gemm uses it too)
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors: CPU, one dtype, float32 or bfloat16."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_SUFFIX:
        return False
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return False
    return available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last axis, statistics in float32."""
    expect("rms_norm", "x", x, tuple(DTYPE_SUFFIX))
    dim = x.shape[-1]
    expect("rms_norm", "weight", weight, x.dtype, (dim,))
    x = x.contiguous()
    out = torch.empty_like(x)
    fn = getattr(load(), "rms_norm_" + DTYPE_SUFFIX[x.dtype])
    fn(
        x.data_ptr(),
        weight.contiguous().data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(residual + x)`` and ``residual + x`` (the sum rounded to the dtype, as torch's
    addition) in one pass: the decoder's residual addition and the next layer's norm."""
    expect("add_rms_norm", "x", x, tuple(DTYPE_SUFFIX))
    dim = x.shape[-1]
    expect("add_rms_norm", "residual", residual, x.dtype, tuple(x.shape))
    expect("add_rms_norm", "weight", weight, x.dtype, (dim,))
    x, residual = x.contiguous(), residual.contiguous()
    total = torch.empty_like(x)
    out = torch.empty_like(x)
    fn = getattr(load(), "add_rms_norm_" + DTYPE_SUFFIX[x.dtype])
    fn(
        x.data_ptr(),
        residual.data_ptr(),
        weight.contiguous().data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        total.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2 * inter] holding [gate | up]."""
    expect("silu_mul", "gate_up", gate_up, tuple(DTYPE_SUFFIX), (None, None))
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    fn = getattr(load(), "silu_mul_" + DTYPE_SUFFIX[gate_up.dtype])
    fn(gate_up.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
    return out


def round_tokens_int8(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` [rows, dim] rounded to its int8 grid (scale max|x| / 127) and back, in one
    pass: W8A8's dynamic per-token activation quantization, as ``quant.fake_quantize_tokens``."""
    expect("round_tokens_int8", "x", x, tuple(DTYPE_SUFFIX), (None, None))
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        fn = getattr(load(), "round_tokens_int8_" + DTYPE_SUFFIX[x.dtype])
        fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [tokens, heads, dim] (heads contiguous; tokens may be strided,
    as in a view of the fused qkv output) by ``cos`` / ``sin`` [tokens, dim]: a new contiguous tensor."""
    expect("rotary", "x", x, tuple(DTYPE_SUFFIX), (None, None, None))
    tokens, heads, dim = x.shape
    expect("rotary", "cos", cos, x.dtype, (tokens, dim))
    expect("rotary", "sin", sin, x.dtype, (tokens, dim))
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    fn = getattr(load(), "rotary_" + DTYPE_SUFFIX[x.dtype])
    fn(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        dim,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``k_cache[h, slots[t]] = k[t, h]`` (and v) for k, v [tokens, kv_heads, dim] (token rows may
    be strided, as views of the fused qkv output) into head-major caches [kv_heads, ..., dim]:
    ``attention.write_kv``'s two ``index_copy_`` calls, which cost 15-50 us each here, as one loop
    of row copies. Slots out of range raise, as ``index_copy_`` does."""
    expect("kv_write", "k", k, shape=(None, None, None))
    tokens, kvh, dim = k.shape
    expect("kv_write", "v", v, k.dtype, tuple(k.shape))
    expect("kv_write", "k_cache", k_cache, k.dtype, (kvh, *[None] * (k_cache.dim() - 2), dim), contiguous=True)
    expect("kv_write", "v_cache", v_cache, k.dtype, tuple(k_cache.shape), contiguous=True)
    expect("kv_write", "slots", slots, torch.int64, (tokens,))
    per_head = k_cache.numel() // (kvh * dim)
    if k.stride(2) != 1 or k.stride(1) != dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != dim:
        v = v.contiguous()
    size = k.element_size()
    rc = load().kv_write(
        k.data_ptr(),
        k.stride(0) * size,
        v.data_ptr(),
        v.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.contiguous().data_ptr(),
        tokens,
        kvh,
        dim * size,
        per_head,
    )
    if rc:
        bad = slots[(slots < 0) | (slots >= per_head)]
        raise IndexError(f"kv_write: a slot outside [0, {per_head}): {int(bad[0])} (nothing written)")


def _planes(cache: torch.Tensor) -> tuple[int, int, int]:
    """A cache [..., blocks, block_size, head_dim] as (planes, blocks, bytes per block)."""
    expect("copy_blocks", "cache", cache, contiguous=True)
    if cache.dim() < 3:
        expect("copy_blocks", "cache", cache, shape=(None, None, None))
    blocks = cache.shape[-3]
    per_block = cache.shape[-2] * cache.shape[-1] * cache.element_size()
    return cache.numel() * cache.element_size() // (blocks * per_block), blocks, per_block


def independent(src: list[int], dst: list[int]) -> bool:
    """Whether block copies ``src[i] -> dst[i]`` can run in any order: no destination repeats or
    is also a source (copy-on-write's are: each destination is a block just allocated)."""
    return len(set(dst)) == len(dst) and not set(dst) & set(src)


def copy_blocks(cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """``cache[..., dst[i], :, :] = cache[..., src[i], :, :]`` for every leading index (layer, K / V,
    kv head), one memcpy per block and plane: the runner's copy-on-write copies, which torch's
    advanced-index assignment runs as a gather into a temporary and a scatter.
    The copies must be independent: no block is written twice or both written and read."""
    if not src:
        return
    if not independent(src, dst):
        raise ValueError("copy_blocks: a destination block repeats or is also a source")
    planes, blocks, per_block = _planes(cache)
    s, d = torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    rc = load().copy_blocks(
        cache.data_ptr(),
        planes,
        blocks,
        per_block,
        s.data_ptr(),
        d.data_ptr(),
        len(src),
        torch.get_num_threads(),
    )
    if rc:
        raise IndexError(f"copy_blocks: a block outside [0, {blocks}) (nothing copied)")


def zero_blocks(cache: torch.Tensor, ids: list[int]) -> None:
    """``cache[..., ids, :, :] = 0`` for every leading index, one memset per block and plane."""
    if not ids:
        return
    planes, blocks, per_block = _planes(cache)
    i = torch.tensor(ids, dtype=torch.int64)
    rc = load().zero_blocks(
        cache.data_ptr(), planes, blocks, per_block, i.data_ptr(), len(ids), torch.get_num_threads()
    )
    if rc:
        raise IndexError(f"zero_blocks: a block outside [0, {blocks}) (nothing zeroed)")
