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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset for each token
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_context_lens: torch.Tensor | None = None  # [num_decode] long, including the new token
    decode_max_context: int = 0
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
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
    """Store each token's K/V in its slot."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


class TorchAttention:
    """Reference backend in plain torch: gathers each sequence's blocks and calls SDPA.
    ``seconds`` accumulates the time spent here (host time: exact on CPU)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        t0 = time.perf_counter()
        out = self._forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        self.seconds += time.perf_counter() - t0
        return out

    def _forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk, scale, sliding_window)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        # [..., nblocks] -> [..., nblocks * block_size, kv_heads, head_dim]
        g = cache[block_table]
        return g.flatten(-4, -3)

    def _decode(self, q, k_cache, v_cache, meta, scale, window):
        buckets = meta.decode_buckets or [
            DecodeBucket(
                None,
                meta.decode_block_tables[:, : -(-meta.decode_max_context // k_cache.shape[1])],
                meta.decode_context_lens,
            )
        ]
        if len(buckets) == 1 and buckets[0].rows is None:
            b = buckets[0]
            return self._decode_rows(q, k_cache, v_cache, b.block_tables, b.context_lens, scale, window)
        out = torch.empty_like(q)
        for b in buckets:
            out[b.rows] = self._decode_rows(
                q[b.rows], k_cache, v_cache, b.block_tables, b.context_lens, scale, window
            )
        return out

    def _decode_rows(self, q, k_cache, v_cache, bt, context_lens, scale, window):
        keys = self._gather(k_cache, bt).transpose(1, 2)  # [B, kvh, L, d]
        values = self._gather(v_cache, bt).transpose(1, 2)
        length = keys.shape[2]
        pos = torch.arange(length, device=q.device)
        ctx = context_lens[:, None]
        mask = pos[None, :] < ctx
        if window is not None:
            mask &= pos[None, :] > ctx - 1 - window
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=keys.shape[1] != q.shape[1],
        )
        return o.squeeze(2)

    def _prefill(self, q, k_cache, v_cache, chunk, scale, window):
        n, ctx = chunk.num_tokens, chunk.context_len
        keys = self._gather(k_cache, chunk.block_table)[:ctx].transpose(0, 1)  # [kvh, ctx, d]
        values = self._gather(v_cache, chunk.block_table)[:ctx].transpose(0, 1)
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
