"""Attention over the paged KV cache for one flattened, mixed batch.

Batch layout (built by the runner each step)::

    tokens   [ d0 d1 d2 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ... ]
               decode tokens, one     prefill chunks, each attending to its cached /
               per sequence           computed prefix and causally to itself

``AttentionMetadata`` carries the slot of every token (where its K/V is written), the decode
sequences' block tables and context lengths as tensors, and one ``PrefillChunk`` per prefill.
A backend implements ``forward`` for one layer; ``TorchAttention`` runs anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class DecodeBucket:
    """Decode rows of similar context length, so that a padded gather wastes little."""

    rows: torch.Tensor | None  # [n] long rows of the decode part, or None for all of them
    block_tables: torch.Tensor  # [n, blocks] long, cut to the longest context of the bucket
    context_lens: torch.Tensor  # [n] long, including the new token


@dataclass
class SharedPrefixes:
    """Groups of decode rows whose block tables start with the same full, immutable blocks (the n
    samples of a prompt, the beams of a search, requests that hit the same cached prefix).
    Attention over each shared prefix is computed once for all its rows (cascade attention), all
    groups in one batched op: group g has rows ``row_index[g, :]`` (where ``row_valid``) and
    prefix ``block_tables[g]`` of ``prefix_lens[g]`` tokens."""

    row_index: torch.Tensor  # [G, R] long, padded with row 0
    row_valid: torch.Tensor  # [G, R] bool
    block_tables: torch.Tensor  # [G, P] long, padded with block 0
    prefix_lens: torch.Tensor  # [G] long, tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for each token
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_context_lens: torch.Tensor | None = None  # [num_decode] long, including the new token
    decode_max_context: int = 0
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    # with shared prefixes, the buckets hold each row's blocks *after* its shared prefix
    decode_shared: SharedPrefixes | None = None
    # The same batch per token, for kernels that treat every token alike (the Triton backend):
    block_tables: torch.Tensor | None = None  # [S, W] long, one row per scheduled sequence
    token_rows: torch.Tensor | None = None  # [T] long: each token's row of block_tables
    token_ctx: torch.Tensor | None = None  # [T] long: positions each token attends to (position + 1)
    max_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store each token's K/V ([T, kv_heads, head_dim]) in its slot of the head-major caches."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kvh, -1, d).index_copy_(1, slots, v.transpose(0, 1))


def gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, d] at ``block_table`` [..., n] -> [kv_heads, ..., n * block_size, d].
    The head-major layout makes the result contiguous: matmuls use it without another copy."""
    return cache[:, block_table].flatten(-3, -2)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None
):
    """q [kvh, B, g, d] against keys / values [kvh, B, L, d] (``mask`` [B, L]: True = attend).
    Returns the output [kvh, B, g, d] and the log-sum-exp [kvh, B, g] of the scores."""
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), values), lse.squeeze(-1)


class TorchAttention:
    """Reference backend in plain torch: gathers blocks and computes attention with matmuls.
    The caches are head-major: [kv_heads, num_blocks, block_size, head_dim].
    ``seconds`` accumulates the time spent here (host time: exact on CPU)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        t0 = time.perf_counter()
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk, scale, sliding_window)
        self.seconds += time.perf_counter() - t0
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, window):
        nd, h, d = q.shape
        kvh = k_cache.shape[0]
        g = h // kvh
        qh = q.view(nd, kvh, g, d).transpose(0, 1)  # [kvh, nd, g, d]
        buckets = meta.decode_buckets or [
            DecodeBucket(
                None,
                meta.decode_block_tables[:, : -(-meta.decode_max_context // k_cache.shape[2])],
                meta.decode_context_lens,
            )
        ]
        out = torch.empty((kvh, nd, g, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((kvh, nd, g), dtype=torch.float32, device=q.device)
        # With shared prefixes, the buckets hold each row's blocks after its prefix.
        for b in buckets:
            rows = b.rows
            keys = gather(k_cache, b.block_tables)
            values = gather(v_cache, b.block_tables)
            pos = torch.arange(keys.shape[2], device=q.device)[None, :]
            ctx = b.context_lens[:, None]
            mask = pos < ctx
            if window is not None:  # (no shared prefixes with windows: positions are absolute here)
                mask &= pos > ctx - 1 - window
            o, l_ = attend(qh if rows is None else qh[:, rows], keys, values, scale, mask)
            if rows is None:
                out, lse = o, l_.float()
            else:
                out[:, rows] = o
                lse[:, rows] = l_.float()
        if meta.decode_shared is not None:
            self._merge_shared_prefixes(qh, out, lse, k_cache, v_cache, meta.decode_shared, scale)
        return out.transpose(0, 1).reshape(nd, h, d)

    @staticmethod
    def _merge_shared_prefixes(qh, out, lse, k_cache, v_cache, sp, scale):
        """Cascade attention: each shared prefix attended once by all its rows (its rows become extra
        query heads of one batch entry), merged into the rows' outputs by log-sum-exp."""
        kvh, _, g, d = qh.shape
        groups, rmax = sp.row_index.shape
        keys = gather(k_cache, sp.block_tables)  # [kvh, G, L, d]
        values = gather(v_cache, sp.block_tables)
        qs = qh[:, sp.row_index].reshape(kvh, groups, rmax * g, d)
        mask = torch.arange(keys.shape[2], device=qh.device)[None, :] < sp.prefix_lens[:, None]
        o_p, l_p = attend(qs, keys, values, scale, mask)
        o_p = o_p.view(kvh, groups, rmax, g, d)[:, sp.row_valid]  # [kvh, rows, g, d]
        l_p = l_p.view(kvh, groups, rmax, g)[:, sp.row_valid].float()
        rows = sp.row_index[sp.row_valid]
        l_s = lse[:, rows]
        m = torch.maximum(l_s, l_p)
        w_s, w_p = torch.exp(l_s - m), torch.exp(l_p - m)
        merged = (out[:, rows] * w_s[..., None] + o_p * w_p[..., None]) / (w_s + w_p)[..., None]
        out[:, rows] = merged.to(out.dtype)

    def _prefill(self, q, k_cache, v_cache, chunk, scale, window):
        n, ctx = chunk.num_tokens, chunk.context_len
        keys = gather(k_cache, chunk.block_table)[:, :ctx]  # [kvh, ctx, d]
        values = gather(v_cache, chunk.block_table)[:, :ctx]
        qh = q.transpose(0, 1)  # [h, n, d]
        gqa = keys.shape[0] != qh.shape[0]
        if ctx == n and window is None:
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from kernels.backend import TritonAttention  # noqa: PLC0415
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention_backend='triton' needs the triton package: {e}") from e
        else:
            return TritonAttention()
    return TorchAttention()
