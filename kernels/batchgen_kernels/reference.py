"""Torch references of every kernel: slow, obvious, used by the tests and the GPU check."""

from __future__ import annotations

import math

import torch


def paged_attention_ref(
    q, k_cache, v_cache, block_tables, token_rows, token_ctx, scale, window=None, softcap=None, sinks=None
):
    """q [T, H, D]; caches [KVH, NB, BS, D]; block_tables [S, W]; token_rows [T] (row of each token's
    table); token_ctx [T] (how many positions token t attends to: its own position + 1); softcap:
    ``softcap * tanh(score / softcap)``; sinks [H]: a logit per head added to the softmax's denominator."""
    t_count, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    g = h // kvh
    out = torch.empty_like(q)
    for t in range(t_count):
        ctx = int(token_ctx[t])
        row = block_tables[int(token_rows[t])]
        nb = math.ceil(ctx / bs)
        keys = k_cache[:, row[:nb]].reshape(kvh, nb * bs, d)[:, :ctx].float()
        values = v_cache[:, row[:nb]].reshape(kvh, nb * bs, d)[:, :ctx].float()
        qq = q[t].float().view(kvh, g, d)
        s = torch.einsum("kgd,kld->kgl", qq, keys) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if window is not None:
            pos = torch.arange(ctx)
            s[..., pos <= ctx - 1 - window] = float("-inf")
        if sinks is not None:  # one more logit per head, whose value vector is zero
            s = torch.cat([s, sinks.float().view(kvh, g, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[t] = torch.einsum("kgl,kld->kgd", p, values).reshape(h, d).to(q.dtype)
    return out


def write_kv_ref(k, v, k_cache, v_cache, slots):
    kvh, _, bs, d = k_cache.shape
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        k_cache[:, slot // bs, slot % bs] = k[t]
        v_cache[:, slot // bs, slot % bs] = v[t]


def copy_blocks_ref(kv_cache, src, dst):
    """kv_cache [..., NB, BS, D] with the block axis third from the end."""
    for s, d_ in zip(src.tolist(), dst.tolist(), strict=True):
        kv_cache[..., d_, :, :] = kv_cache[..., s, :, :].clone()


def token_mask_ref(scores: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """The reference: unpack each row's bits, -inf where a token's bit is 0."""
    vocab = scores.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    for r in rows:
        bits = ((mask[r][:, None] >> shifts) & 1).flatten()[:vocab]
        scores[r].masked_fill_(bits == 0, float("-inf"))
