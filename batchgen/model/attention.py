"""Attention over the paged KV cache for one flattened, mixed batch.

Batch layout (built by the runner each step)::

    tokens   [ d0 d1 d2 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ... ]
               decode tokens, one     prefill chunks, each attending to its cached /
               per sequence           computed prefix and causally to itself

``AttentionMetadata`` carries the slot of every token (where its K/V is written), and either the
decode rows in ``DecodeGroups`` plus one ``PrefillChunk`` per prefill (torch backend) or the same
batch per token (Triton backend). The caches are head-major, ``[kv_heads, num_blocks, block_size,
head_dim]`` per layer. A backend implements ``forward`` for one layer; ``TorchAttention`` runs anywhere.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from batchgen import utils
from batchgen.model.layers import fused_cpu_ops


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class DecodeGroups:
    """Decode rows attended a group at a time. A group is one row, or the rows whose block tables
    start with the same full blocks (the n samples of a prompt, the beams of a search, requests that
    hit the same cached prefix). A group's keys are its shared blocks once, then each row's own
    blocks; ``mask`` says which key positions each row sees. Groups of similar size are batched:
    ``G`` groups of at most ``R`` rows and ``U`` blocks."""

    row_index: torch.Tensor  # [G, R] long decode rows, padded with 0
    row_valid: torch.Tensor  # [G, R] bool
    block_tables: torch.Tensor  # [G, U] long, padded with the null block
    mask: torch.Tensor  # [G, R, U * block_size] bool: True = attend
    context_lens: torch.Tensor  # [G, R] long (for sliding windows; groups of one row only)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for each token
    num_decode: int = 0
    decode_groups: list[DecodeGroups] = field(default_factory=list)
    # The same batch per token, for kernels that treat every token alike (the Triton backend):
    block_tables: torch.Tensor | None = None  # [S, W] long, one row per scheduled sequence
    token_rows: torch.Tensor | None = None  # [T] long: each token's row of block_tables
    token_ctx: torch.Tensor | None = None  # [T] long: positions each token attends to (position + 1)
    max_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Decode rows one by one, for backends with ``decode_rows`` (the compiled CPU kernel):
    decode_tables: torch.Tensor | None = None  # [num_decode, W] long block tables
    decode_context: torch.Tensor | None = None  # [num_decode] long: keys each decode row attends to


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the attention of one layer and another's, across the families:
    the score scale, a sliding window (the last ``window`` positions, the token's own included),
    logit soft-capping (``softcap * tanh(score / softcap)``, Gemma 2) and attention sinks (one
    learned logit per query head in the softmax denominator, gpt-oss)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads] float32


class AttentionBackend(Protocol):
    seconds: float  # time spent in ``forward`` where the host can measure it
    decode_rows: bool  # decode rows as per-row tables (``decode_tables``), not ``decode_groups``

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store each token's K/V ([T, kv_heads, head_dim]) in its slot of the head-major caches
    (on the compiled CPU kernel where it runs: ``batchgen_kernels.cpu_ops.kv_write``)."""
    if (ops := fused_cpu_ops(k, v, k_cache, v_cache, kernel="kv_write")) is not None and slots.dtype == torch.int64:
        ops.kv_write(k, v, k_cache, v_cache, slots)
        return
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))


def gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, d] at ``block_table`` [..., n] -> [kv_heads, ..., n * block_size, d].
    The head-major layout makes the result contiguous: matmuls use it without another copy."""
    return cache[:, block_table].flatten(-3, -2)


PREFILL_SCORES = 1 << 23  # query x key scores per head a prefill computes at once (see _prefill)


def _softmax(scores: torch.Tensor, layer: LayerAttention, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of masked scores, with the sink logits (already shaped to
    broadcast against ``scores[..., :1]``) as one more column that is dropped afterwards. The
    softmax runs in float32 whatever the scores' dtype (bfloat16 on a CPU), as transformers does."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(scores.dtype)


def _plain_causal(layer: LayerAttention) -> bool:
    """Whether a layer's attention is plain causal softmax: no window, soft-capping or sinks."""
    return layer.window is None and layer.softcap is None and layer.sinks is None


def _cpu_flash_takes(q: torch.Tensor, layer: LayerAttention) -> bool:
    """Whether torch's CPU flash-attention kernel, called for its log-sum-exp, runs this layer."""
    return (
        q.device.type == "cpu"
        and _plain_causal(layer)
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


@functools.cache
def _cpu_flash_takes_gqa() -> bool:
    """Whether torch's CPU flash-attention kernel takes fewer key / value heads than query heads
    itself. Releases that do not (torch 2.6) read heads past the keys' last one and return wrong
    values without an error; there the keys and values are repeated to the query heads first. The
    probe's keys and values are views into larger tensors, so such reads stay inside them."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, length, 16, generator=gen) for length in (3, 5, 5))
    got = flash(q, k[:, :2], v[:, :2], 0.0, False, scale=0.25)[0]
    want = F.scaled_dot_product_attention(
        q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1), scale=0.25
    )
    return bool(torch.allclose(got, want, atol=1e-5))


def _prefill_after_context(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """A prefill chunk after ``ctx - n`` cached positions (a later chunk of a long prompt, or the rest
    of a prompt after a cached prefix) on torch's CPU flash kernel, without a mask: the queries over
    the cached keys (every pair visible) and over their own keys (causal) are two calls, merged by
    their log-sum-exps. With an [n, ctx] mask instead the kernel would score every pair, the masked
    triangle included, and read the mask."""
    n, ctx = q.shape[0], keys.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # bfloat16 runs in bfloat16 on a CPU with AMX, where the kernel's products run on AMX tiles;
    # elsewhere in float32 throughout (the kernel is no faster in bfloat16 there), so that bfloat16
    # outputs are rounded once, after the merge
    dt = torch.bfloat16 if q.dtype == torch.bfloat16 and utils.has_amx() else torch.float32
    qh = q.to(dt).transpose(0, 1)[None]  # [1, heads, n, d]
    kh, vh = keys.to(dt)[None], values.to(dt)[None]  # [1, kv_heads, ctx, d]
    if kh.shape[1] != qh.shape[1] and not _cpu_flash_takes_gqa():
        group = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    past = ctx - n
    o1, lse1 = flash(qh, kh[:, :, :past], vh[:, :, :past], 0.0, False, scale=scale)
    o2, lse2 = flash(qh, kh[:, :, past:], vh[:, :, past:], 0.0, True, scale=scale)
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[..., None], torch.exp(lse2 - top)[..., None]  # [1, heads, n, 1]
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out.to(q.dtype)[0].transpose(0, 1)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


class TorchAttention:
    """Reference backend in plain torch: gathers blocks and computes attention with matmuls.
    The caches are head-major: [kv_heads, num_blocks, block_size, head_dim].
    ``seconds`` accumulates the time spent here (host time: exact on CPU)."""

    decode_rows = False  # decode rows come as ``decode_groups``

    def __init__(self) -> None:
        self.seconds = 0.0

    def forward(self, q, k, v, k_cache, v_cache, meta, layer):
        t0 = time.perf_counter()
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, layer, out[:nd])
        self._prefills(q, k_cache, v_cache, meta.prefills, layer, out)
        self.seconds += time.perf_counter() - t0
        return out

    def _prefills(self, q, k_cache, v_cache, chunks, layer, out):
        """Attention of each prefill chunk, written into its rows of ``out``."""
        for chunk in chunks:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk, layer)

    def _decode(self, q, k_cache, v_cache, meta, layer, out_rows):
        """Attention of the decode rows ``q`` [nd, heads, d], written into ``out_rows``."""
        nd, h, d = q.shape
        kvh = k_cache.shape[0]
        g = h // kvh
        window = layer.window
        capped = layer.softcap is not None
        # With soft-capping the scale applies to the scores (tanh is not linear); else to q, once.
        qh = (q if capped else q * layer.scale).view(nd, kvh, g, d).transpose(0, 1)  # [kvh, nd, g, d]
        sinks = None if layer.sinks is None else layer.sinks.view(kvh, 1, 1, g, 1)
        out = torch.empty((kvh, nd, g, d), dtype=q.dtype, device=q.device)
        for gb in meta.decode_groups:
            groups, rows = gb.row_index.shape
            keys = gather(k_cache, gb.block_tables)  # [kvh, G, L, d]
            values = gather(v_cache, gb.block_tables)
            length = keys.shape[2]
            s = torch.matmul(qh[:, gb.row_index].reshape(kvh, groups, rows * g, d), keys.transpose(-1, -2))
            if capped:
                s = _cap(s * layer.scale, layer.softcap)
            mask = gb.mask
            if window is not None:  # groups are single rows here: key position = absolute position
                pos = torch.arange(length, device=q.device)
                mask = mask & (pos[None, None, :] > gb.context_lens[:, :, None] - 1 - window)
            s = s.view(kvh, groups, rows, g, length).masked_fill(~mask[None, :, :, None, :], float("-inf"))
            p = _softmax(s, layer, sinks).view(kvh, groups, rows * g, length)
            o = torch.matmul(p, values).view(kvh, groups, rows, g, d)
            out[:, gb.row_index[gb.row_valid]] = o[:, gb.row_valid]
        out_rows.copy_(out.transpose(0, 1).reshape(nd, h, d))

    def _prefill(self, q, k_cache, v_cache, chunk, layer):
        n, ctx = chunk.num_tokens, chunk.context_len
        keys = gather(k_cache, chunk.block_table)[:, :ctx]  # [kvh, ctx, d]
        values = gather(v_cache, chunk.block_table)[:, :ctx]
        if ctx > n and _cpu_flash_takes(q, layer):
            return _prefill_after_context(q, keys, values, layer.scale)
        if n * ctx <= PREFILL_SCORES:
            return self._prefill_rows(q, keys, values, layer)
        # A long context: queries in blocks, so that the scores held at once stay bounded (one
        # [heads, n, ctx] tensor of a 2,048-token chunk over 16k keys is a gigabyte), each block
        # against the keys up to its last query only.
        out = torch.empty_like(q)
        step = max(1, PREFILL_SCORES // ctx)
        for start in range(0, n, step):
            end = min(n, start + step)
            last = ctx - n + end
            out[start:end] = self._prefill_rows(q[start:end], keys[:, :last], values[:, :last], layer)
        return out

    def _prefill_rows(self, q, keys, values, layer):
        """Attention of ``q`` (the last ``n`` positions of the ``ctx`` keys) over ``keys`` / ``values``."""
        n, ctx = q.shape[0], keys.shape[1]
        qh = q.transpose(0, 1)  # [h, n, d]
        kvh, h = keys.shape[0], qh.shape[0]
        window, scale = layer.window, layer.scale
        mask = None
        if ctx != n or window is not None or layer.softcap is not None or layer.sinks is not None:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
        if layer.softcap is None and layer.sinks is None:
            # 4-D inputs (a batch of one): torch's CPU flash-attention kernel takes only those;
            # 3-D ones run the unfused math path, which is slower and holds every score at once
            o = F.scaled_dot_product_attention(
                qh[None],
                keys[None],
                values[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=kvh != h,
            )
            return o[0].transpose(0, 1)
        assert mask is not None  # built above whenever soft-capping or sinks are on
        g = h // kvh
        s = torch.matmul(qh.reshape(kvh, g * n, -1), keys.transpose(-1, -2)).view(kvh, g, n, ctx)
        s = _cap(s * scale, layer.softcap).masked_fill(~mask, float("-inf"))
        sinks = None if layer.sinks is None else layer.sinks.view(kvh, g, 1, 1)
        p = _softmax(s, layer, sinks).view(kvh, g * n, ctx)
        return torch.matmul(p, values).view(h, n, -1).transpose(0, 1)


class CpuAttention(TorchAttention):
    """The torch backend with its decode rows on the compiled CPU kernel
    (``batchgen_kernels.cpu_attention.paged_decode``): each row's keys and values read in place from the
    paged caches, one online softmax, no gathered copies. The runner gives decode rows as per-row
    block tables (``decode_rows``), not shared-prefix groups. Prefill chunks of plain causal layers
    run on the compiled prefill kernel (``batchgen_kernels.cpu_attention.prefill``), others as in the torch
    backend."""

    decode_rows = True
    # float32 chunks over longer contexts keep torch's flash kernel, which is as fast or faster
    # there (FMA products run at half the bf16 dot instruction's rate; docs/kernels.md, "Thresholds").
    F32_PREFILL_MAX_CONTEXT = 2048
    # bfloat16 chunks on AMX tiles while one kv head's keys and values (context x head_dim x 2 x 2
    # bytes) fit in a core's L2: every block of 16 / group positions reads them again; past that,
    # torch's flash kernel (on AMX tiles too) is faster (docs/kernels.md, "Thresholds").
    AMX_PREFILL_MAX_KV = 8192 * 64

    def __init__(self) -> None:
        super().__init__()
        from batchgen_kernels.cpu_attention import load, paged_decode, prefill, prefill_chunks  # noqa: PLC0415

        load()  # builds the library on first use; KernelUnavailable where it cannot
        self._paged_decode = paged_decode
        self._prefill_kernel = prefill
        self._prefill_chunks = prefill_chunks
        self._batched: tuple | None = None  # (the step's chunks, their AMX batch, the others)

    def _prefills(self, q, k_cache, v_cache, chunks, layer, out):
        """bfloat16 chunks on AMX tiles (``AMX_PREFILL_MAX_KV``) all in one kernel call per layer,
        where a step has several (a batch of prompts after a cached prefix); the others one at a
        time."""
        if len(chunks) > 1 and q.dtype == torch.bfloat16 and _plain_causal(layer) and utils.has_amx():
            batch, others = self._amx_batch(chunks, q.shape[-1])
            if batch is not None:
                tables, starts, lengths, contexts = batch
                if self._prefill_chunks(q, k_cache, v_cache, tables, starts, lengths, contexts, layer.scale, out):
                    chunks = others
        super()._prefills(q, k_cache, v_cache, chunks, layer, out)

    def _amx_batch(self, chunks, head_dim):
        """The chunks that run on AMX tiles as the batch ``prefill_chunks`` takes (block tables,
        first rows, lengths, context lengths; None for fewer than two), and the rest; built once a
        step, for its first layer."""
        if self._batched is None or self._batched[0] is not chunks:
            tiles: list[PrefillChunk] = []
            others: list[PrefillChunk] = []
            for c in chunks:
                (tiles if c.context_len * head_dim <= self.AMX_PREFILL_MAX_KV else others).append(c)
            batch = None
            if len(tiles) > 1:
                width = max(c.block_table.numel() for c in tiles)
                tables = torch.zeros((len(tiles), width), dtype=torch.int64)
                for i, c in enumerate(tiles):
                    tables[i, : c.block_table.numel()] = c.block_table
                columns = torch.tensor(
                    [[c.token_start, c.num_tokens, c.context_len] for c in tiles], dtype=torch.int64
                ).T.contiguous()
                batch = (tables, columns[0], columns[1], columns[2])
            self._batched = (chunks, batch, others if batch is not None else chunks)
        return self._batched[1], self._batched[2]

    def _prefill(self, q, k_cache, v_cache, chunk, layer):
        """Chunks on the compiled prefill kernel (bf16 on the dot instruction: torch's flash kernel
        is no faster in bf16 than in float32 without AMX; float32 on FMA products up to
        ``F32_PREFILL_MAX_CONTEXT`` positions), where it runs; else the torch path. bfloat16 on a
        CPU with AMX runs on the kernel's AMX tiles up to ``AMX_PREFILL_MAX_KV``, and on torch's
        flash kernel past it, whose products run on AMX tiles too there and are faster than the dot
        instruction's kernel."""
        amx_bf16 = q.dtype == torch.bfloat16 and utils.has_amx()
        if amx_bf16 and _plain_causal(layer) and chunk.context_len * q.shape[-1] <= self.AMX_PREFILL_MAX_KV:
            out = self._prefill_kernel(
                q, k_cache, v_cache, chunk.block_table, chunk.context_len, layer.scale, amx=True
            )
            if out is not None:
                return out
        if (
            _plain_causal(layer)
            and not amx_bf16
            and (q.dtype != torch.float32 or chunk.context_len <= self.F32_PREFILL_MAX_CONTEXT)
        ):
            out = self._prefill_kernel(q, k_cache, v_cache, chunk.block_table, chunk.context_len, layer.scale)
            if out is not None:
                return out
        return super()._prefill(q, k_cache, v_cache, chunk, layer)

    def _decode(self, q, k_cache, v_cache, meta, layer, out_rows):
        self._paged_decode(
            q,
            k_cache,
            v_cache,
            meta.decode_tables,
            meta.decode_context,
            layer.scale,
            layer.window,
            layer.softcap,
            layer.sinks,
            out_rows,  # written in place
        )


def make_backend(name: str, device: torch.device, shape: CacheShape) -> AttentionBackend:
    """The backend ``name`` asks for; ``"auto"``: Triton on CUDA, the compiled CPU kernel on the
    CPU where it builds and takes the model's shapes, else the torch backend."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from batchgen_kernels.backend import TritonAttention  # noqa: PLC0415
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention_backend='triton' needs the triton package: {e}") from e
        else:
            return TritonAttention()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from batchgen_kernels.cpu_attention import KernelUnavailable, supports  # noqa: PLC0415

        why = (
            "it runs on the CPU only"
            if device.type != "cpu"
            else supports(shape.dtype, shape.heads, shape.kv_heads, shape.head_dim, shape.block_size)
        )
        if why is None:
            try:
                return CpuAttention()
            except KernelUnavailable as e:
                why = str(e)
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' cannot run here: {why}")
        warnings.warn(
            f"the compiled CPU attention is not used ({why}); using the torch backend", stacklevel=2
        )
    return TorchAttention()


@dataclass(frozen=True)
class CacheShape:
    """What a backend needs to know of the model to say whether it can run it."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
