"""Decode attention on the compiled CPU kernel (``cpu_attention.cpp``, built by ``batchgen_kernels.cpu``) and
the attention backend that uses it.

The kernel reads each decode row's keys and values in place from the paged caches and runs an
online softmax, instead of the torch path's gathered copies, masked score matrices and separate
softmax. Prefill chunks run on ``cpu_prefill.cpp`` (``prefill``: in bfloat16 on the bf16 dot
instruction, 2-4x torch's flash kernel, which is no faster in bf16 than in float32 here; in
float32 on FMA products), the torch path (``scaled_dot_product_attention``) where it does not run.
``batchgen.model.attention.CpuAttention`` is the backend that uses both; ``attention_backend="auto"``
picks it on the CPU where it builds and takes the model's shapes (``supports``), and keeps the
torch backend otherwise.
"""

from __future__ import annotations

from typing import Literal

import torch

from batchgen_kernels.cpu import KernelUnavailable, load
from batchgen_kernels.cpu_args import KernelArgumentError, expect

__all__ = [
    "KernelUnavailable",
    "amx_tiles",
    "bf16_dot_products",
    "paged_decode",
    "prefill",
    "prefill_chunks",
    "supports",
]

MAX_GROUP, MAX_DIM, MAX_BLOCK = 32, 256, 256  # the kernel's limits (kMaxGroup, kMaxDim, kMaxBlock)
_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def supports(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Why the kernel cannot run a model's decode attention, or None when it can (and it builds)."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} (float32 and bfloat16 only)"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} query heads over {kv_heads} kv heads (at most {MAX_GROUP} per kv head)"
    if head_dim > MAX_DIM or block_size > MAX_BLOCK:
        return f"head_dim {head_dim} / block_size {block_size} (at most {MAX_DIM} / {MAX_BLOCK})"
    return None


def bf16_dot_products() -> bool:
    """Whether bfloat16 caches run on the CPU's bf16 dot instruction (AVX-512 BF16, compiled in
    where the build targets a CPU that has it): scores from bf16 query x key pairs, the weighted
    sum from the softmax weights rounded to bf16 (as torch's flash attention does for bf16) x
    value pairs, float32 accumulation and softmax statistics. Elsewhere bf16 is widened to
    float32 before every product."""
    return bool(load().bf16_dot_products())


def amx_tiles() -> bool:
    """Whether bfloat16 attention runs on AMX tiles (Intel Sapphire Rapids and later: compiled in
    where the build targets such a CPU, and granted to the process by Linux), head_dim 64 or 128:
    decode rows over the blocks they share, and ``prefill(..., amx=True)``. The same bf16 products
    and float32 sums as the dot instruction's passes, 16 keys x 16 query heads x 32 dims per tile
    instruction."""
    return bool(load().amx_tiles())


def paged_decode(
    q: torch.Tensor,  # [rows, heads, dim]
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, dim]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [rows, width] int64
    context_lens: torch.Tensor,  # [rows] int64: keys each row attends to, its own included
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads] float32
    out: torch.Tensor | None = None,  # [rows, heads, dim], contiguous: written in place
    bf16_dot: bool = True,
    share: bool | Literal["always"] = True,
    amx: bool = True,
) -> torch.Tensor:
    """Decode attention of one query token per row over its paged context (see the module).
    ``bf16_dot=False`` widens bfloat16 to float32 before every product even where the bf16 dot
    instruction is compiled in (``bf16_dot_products``): the path other CPUs run, for tests;
    ``amx=False`` keeps the shared pass off AMX tiles where they are used (``amx_tiles``).
    ``share=False`` runs every row on its own, also over the blocks it shares with the rows next to
    it. By default consecutive rows whose tables start alike attend to those blocks together where
    they fill more than 3/4 of the pass's 16 lanes (rows x query heads per kv head; below that the
    per-row pass was as fast or faster), ``share="always"`` wherever two or more rows share."""
    if share not in (True, False, "always"):
        raise ValueError(f"paged_decode: share must be True, False or 'always', not {share!r}")
    expect("paged_decode", "q", q, (torch.float32, torch.bfloat16), (None, None, None))
    rows, heads, dim = q.shape
    expect("paged_decode", "k_cache", k_cache, q.dtype, (None, None, None, dim), contiguous=True)
    kvh, num_blocks, block_size, _ = k_cache.shape
    expect("paged_decode", "v_cache", v_cache, q.dtype, tuple(k_cache.shape), contiguous=True)
    expect("paged_decode", "tables", tables, torch.int64, (rows, None))
    expect("paged_decode", "context_lens", context_lens, torch.int64, (rows,))
    if sinks is not None:
        expect("paged_decode", "sinks", sinks, shape=(heads,))
    if out is not None:
        expect("paged_decode", "out", out, q.dtype, tuple(q.shape), contiguous=True)
    name = _DTYPES[k_cache.dtype]
    if k_cache.dtype == torch.bfloat16 and not bf16_dot:
        name = "paged_decode_bf16_widened"
    elif k_cache.dtype == torch.bfloat16 and not amx:
        name = "paged_decode_bf16_dot"
    fn = getattr(load(), name)
    q = q.contiguous()
    tables = tables.contiguous()
    context_lens = context_lens.contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    if out is None:
        out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        context_lens.data_ptr(),
        rows,
        heads,
        kvh,
        dim,
        num_blocks,
        block_size,
        scale,
        window or 0,
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
        2 if share == "always" else int(share),
    )
    if rc:
        raise ValueError(
            f"cpu paged_decode: unsupported shape (heads {heads}, kv_heads {kvh}, head_dim {dim}, "
            f"block_size {block_size})"
        )
    return out


def prefill(
    q: torch.Tensor,  # [n, heads, dim] float32 or bfloat16: positions ctx - n .. ctx - 1
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, dim], q's dtype
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [blocks] int64: the sequence's block table, covering ctx positions
    context_len: int,
    scale: float,
    amx: bool = False,
) -> torch.Tensor | None:
    """Causal attention of a prefill chunk over its paged context (``cpu_prefill.cpp``: bfloat16 on
    the bf16 dot instruction, float32 on FMA products), without a window, soft-capping or sinks;
    None where the kernel does not run (no AVX-512 compiled in, or for bf16 no AVX-512 BF16;
    head_dim other than 64 or 128, more than 16 query heads per kv head), and the caller keeps
    torch's kernel. ``amx=True``: a bfloat16 chunk on AMX tiles instead (``amx_tiles``; blocks of
    16 / group positions, each over its keys: for short chunks), None where they are not used."""
    expect("prefill", "q", q, (torch.float32, torch.bfloat16), (None, None, None))
    n, heads, dim = q.shape
    expect("prefill", "k_cache", k_cache, q.dtype, (None, None, None, dim), contiguous=True)
    kvh, num_blocks, block_size, _ = k_cache.shape
    expect("prefill", "v_cache", v_cache, q.dtype, tuple(k_cache.shape), contiguous=True)
    expect("prefill", "table", table, torch.int64, (None,))
    if not table.numel() * block_size >= context_len >= n:
        raise KernelArgumentError(
            f"prefill: context_len {context_len} must lie between the chunk's {n} positions and the "
            f"{table.numel() * block_size} the table covers"
        )
    if amx and q.dtype != torch.bfloat16:
        return None
    lib = load()
    fn = lib.prefill_bf16_amx if amx else lib.prefill_bf16 if q.dtype == torch.bfloat16 else lib.prefill_f32
    q = q.contiguous()
    table = table.contiguous()
    out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        n,
        context_len,
        heads,
        kvh,
        dim,
        num_blocks,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return None if rc else out


def prefill_chunks(
    q: torch.Tensor,  # [tokens, heads, dim] bfloat16: the step's flattened batch
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, dim]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [chunks, width] int64: each chunk's block table, padded
    starts: torch.Tensor,  # [chunks] int64: each chunk's first row of q
    lengths: torch.Tensor,  # [chunks] int64: positions in each chunk
    context_lens: torch.Tensor,  # [chunks] int64: positions each chunk's last one sees
    scale: float,
    out: torch.Tensor,  # q's shape, contiguous: each chunk's rows written in place
) -> bool:
    """Several bfloat16 prefill chunks on AMX tiles in one call (``prefill(..., amx=True)`` for
    each, their work items shared by the threads); False, having written nothing, where the tiles
    are not used or the kernel does not take the shapes."""
    expect("prefill_chunks", "q", q, torch.bfloat16, (None, None, None))
    rows, heads, dim = q.shape
    expect("prefill_chunks", "k_cache", k_cache, torch.bfloat16, (None, None, None, dim), contiguous=True)
    kvh, num_blocks, block_size, _ = k_cache.shape
    expect("prefill_chunks", "v_cache", v_cache, torch.bfloat16, tuple(k_cache.shape), contiguous=True)
    expect("prefill_chunks", "out", out, torch.bfloat16, tuple(q.shape), contiguous=True)
    chunks = starts.numel()
    expect("prefill_chunks", "tables", tables, torch.int64, (chunks, None))
    for name, t in (("starts", starts), ("lengths", lengths), ("context_lens", context_lens)):
        expect("prefill_chunks", name, t, torch.int64, (chunks,))
    if chunks and int((starts + lengths).max()) > rows:
        raise KernelArgumentError(f"prefill_chunks: a chunk ends past q's {rows} rows")
    q, tables = q.contiguous(), tables.contiguous()
    starts, lengths, context_lens = starts.contiguous(), lengths.contiguous(), context_lens.contiguous()
    rc = load().prefill_bf16_amx_chunks(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        starts.data_ptr(),
        lengths.data_ptr(),
        context_lens.data_ptr(),
        starts.numel(),
        heads,
        kvh,
        dim,
        num_blocks,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return rc == 0
