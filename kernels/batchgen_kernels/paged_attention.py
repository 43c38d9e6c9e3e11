"""Paged attention for one flattened mixed batch, in one launch (plus a reduce launch when the KV
range is split).

Every query token t (a decode token or a token of a prefill chunk) attends to the first
``token_ctx[t]`` positions of its sequence (its own position + 1: causal within a chunk, the whole
cached prefix before it), reading K/V through ``block_tables[token_rows[t]]`` in tiles of whole
blocks (64 keys by default), each scored and summed with ``tl.dot`` (or elementwise, ``use_dot=False``).
Gemma 2's logit soft-capping (``softcap * tanh(score / softcap)``) and gpt-oss's attention sinks
(a per-head logit in the softmax denominator) are compile-time options. One program handles one
token and one KV head, so the ``H / KVH`` query heads that share the KV head read each K/V block
once (grouped-query attention). With ``num_splits > 1`` the context is cut
into ranges handled by separate programs whose partial results (max, sum, output) a second kernel
merges: the flash-decoding layout for long contexts with few sequences.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _attn_kernel(
    Q,
    KC,
    VC,
    BT,
    ROWS,
    CTX,
    OUT,
    SINKS,
    M_PART,
    L_PART,
    O_PART,
    scale,
    window,
    softcap,
    blocks_per_split,
    stride_qt,
    stride_qh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCKS: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CTX + t)
    row = tl.load(ROWS + t).to(tl.int64)
    nblocks = tl.cdiv(ctx, BS)
    first = sp * blocks_per_split
    last = tl.minimum(nblocks, first + blocks_per_split)
    if USE_WINDOW:
        first = tl.maximum(first, (ctx - window) // BS)

    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_k = tl.arange(0, BLOCKS * BS)  # the keys of BLOCKS consecutive blocks, one tile
    blk = offs_k // BS
    slot = offs_k % BS
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(
        Q + t * stride_qt + (kh * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if not USE_DOT:
        q = q.to(tl.float32)
    # 64-bit offsets: one layer's cache can hold more than 2**31 elements
    base = kh.to(tl.int64) * stride_ch

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if USE_SINKS:
        # a sink is one more logit in the softmax with a zero value vector: start the running
        # max and sum from it (in the first split only: the reduce adds the splits' sums)
        sink = tl.load(SINKS + kh * G + offs_g, mask=gmask, other=float("-inf")).to(tl.float32)
        first_split = gmask & (sp == 0)
        m_i = tl.where(first_split, sink, m_i)
        l_i = tl.where(first_split, 1.0, l_i)
    acc = tl.zeros([GP, DP], tl.float32)
    for j in range(first, last, BLOCKS):
        jb = j + blk
        bid = tl.load(BT + row * stride_bt + jb, mask=jb < last, other=0).to(tl.int64)
        pos = jb * BS + slot
        valid = (jb < last) & (pos < ctx)
        if USE_WINDOW:
            valid = valid & (pos > ctx - 1 - window)
        off = base + bid[:, None] * stride_cb + slot[:, None] * stride_cs + offs_d[None, :]
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(KC + off, mask=kv_mask, other=0.0)
        v = tl.load(VC + off, mask=kv_mask, other=0.0)
        if USE_DOT:  # tensor cores: heads padded to 16 rows, float32 accumulation
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (portable to the interpreter)
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * (s / softcap))) - 1.0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    heads = kh * G + offs_g
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            OUT + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )
    else:
        H = tl.num_programs(1) * G
        part = (t * H + heads) * NUM_SPLITS + sp
        tl.store(M_PART + part, m_i, mask=gmask)
        tl.store(L_PART + part, l_i, mask=gmask)
        tl.store(O_PART + part[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _reduce_kernel(
    OUT,
    M_PART,
    L_PART,
    O_PART,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    smask = offs_s < NUM_SPLITS
    base = (t * H + h) * NUM_SPLITS
    m = tl.load(M_PART + base + offs_s, mask=smask, other=float("-inf"))
    l_ = tl.load(L_PART + base + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(smask, tl.exp(m - m_max), 0.0)
    acc = tl.load(
        O_PART + (base + offs_s)[:, None] * D + offs_d[None, :],
        mask=smask[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    total = tl.sum(l_ * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


DEFAULT_KEYS_PER_STEP = 64
DEFAULT_NUM_SMS = 132  # streaming multiprocessors of an H100 / H200, when no device is at hand


@functools.lru_cache(maxsize=8)
def device_num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(
    num_tokens: int, kv_heads: int, max_context: int, block_size: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """Split the KV range when too few (token, head) programs exist to fill the device and the
    contexts are long: each split should still cover at least 16 blocks."""
    programs = num_tokens * kv_heads
    if programs >= 2 * num_sms:
        return 1
    blocks = triton.cdiv(max_context, block_size)
    return max(1, min(32, triton.cdiv(2 * num_sms, max(programs, 1)), blocks // 16))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [KVH, NB, BS, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, W] int
    token_rows: torch.Tensor,  # [T] int: the row of block_tables of each token
    token_ctx: torch.Tensor,  # [T] int: positions each token attends to (its position + 1)
    scale: float,
    max_context: int,
    window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] float32: one logit per query head
    keys_per_step: int = DEFAULT_KEYS_PER_STEP,
    use_dot: bool = True,
) -> torch.Tensor:
    """``keys_per_step``: keys (whole blocks, at least one) each program loads and scores per
    step of its loop. ``use_dot``: scores and the weighted sum of values through ``tl.dot`` (tensor
    cores, query heads padded to 16 rows; float32 caches in full float32 precision), else through
    elementwise products and sums."""
    t, h, d = q.shape
    kvh, _, bs, dc = k_cache.shape
    if v_cache.shape != k_cache.shape or dc != d or h % kvh:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} do not fit")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention: dtypes q {q.dtype}, cache {k_cache.dtype} must match")
    if q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("paged_attention: q's head dimension and the caches must be contiguous")
    if token_rows.shape != (t,) or token_ctx.shape != (t,) or block_tables.dim() != 2:
        raise ValueError("paged_attention: token_rows / token_ctx must be [T], block_tables [S, W]")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_attention: block_tables rows must be contiguous")
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    g = h // kvh
    # a sliding window bounds the keys any token reads, whatever the context
    span = max_context if window is None else min(max_context, window + bs)
    splits = num_splits or choose_splits(t, kvh, span, bs, device_num_sms(q.device))
    per_split = triton.cdiv(triton.cdiv(max(max_context, 1), bs), splits)
    blocks = max(1, keys_per_step // bs)
    use_dot = use_dot and d >= 16
    if use_dot:
        blocks = max(blocks, 16 // bs)  # tl.dot's smallest tile is 16 keys
    common = dict(
        G=g,
        GP=max(triton.next_power_of_2(g), 16 if use_dot else 1),
        D=d,
        DP=triton.next_power_of_2(d),
        BS=bs,
        BLOCKS=blocks,
        USE_DOT=use_dot,
        # float32 caches keep full precision (no tf32); so do bf16 ones under Triton's interpreter,
        # whose bf16 tl.dot returns garbage (Triton 3.9)
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting()),
        NUM_SPLITS=splits,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
    )
    if sinks is not None and (sinks.shape != (h,) or sinks.dtype != torch.float32):
        raise ValueError(
            f"paged_attention: sinks must be float32 [{h}], got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if splits > 1:
        m_part = torch.empty((t, h, splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty((t, h, splits, d), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = o_part = out  # unused
    _attn_kernel[(t, kvh, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        token_rows,
        token_ctx,
        out,
        sinks if sinks is not None else out,
        m_part,
        l_part,
        o_part,
        scale,
        window or 0,
        softcap or 1.0,
        per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        **common,
    )
    if splits > 1:
        _reduce_kernel[(t, h)](
            out,
            m_part,
            l_part,
            o_part,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            SP=triton.next_power_of_2(splits),
            D=d,
            DP=triton.next_power_of_2(d),
        )
    return out
