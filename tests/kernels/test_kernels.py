"""Each Triton kernel against its torch reference (under TRITON_INTERPRET=1 on a CPU machine):
random block tables over non-contiguous blocks, lengths at block boundaries, GQA ratios 1 / 4 / 8,
prefill chunks over a cached prefix mixed with decode tokens, split-KV, sliding windows, logit
soft-capping and attention sinks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.block_ops import copy_blocks, swap_blocks  # noqa: E402
from kernels.kv_write import write_kv  # noqa: E402
from kernels.paged_attention import choose_splits, paged_attention  # noqa: E402
from kernels.reference import copy_blocks_ref, paged_attention_ref, write_kv_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def mixed_batch(gen, seqs, bs, num_blocks):
    """seqs: list of (cached prefix length, new tokens). Returns per-token rows and context lengths
    and block tables drawn at random (non-contiguous) from the pool."""
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(-(-(c + n) // bs) for c, n in seqs)
    tables = torch.zeros((len(seqs), width), dtype=torch.long)
    used = 0
    rows, ctx = [], []
    for i, (cached, new) in enumerate(seqs):
        nb = -(-(cached + new) // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        for j in range(new):
            rows.append(i)
            ctx.append(cached + j + 1)
    return tables, torch.tensor(rows), torch.tensor(ctx)


def run_on_device(q, kc, vc, tables, rows, ctx, scale, **kwargs):
    """``paged_attention`` with every tensor on the test device (``max_context`` from ``ctx``)."""
    moved = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    args = (t.to(DEV) for t in (q, kc, vc, tables, rows, ctx))
    return paged_attention(*args, scale, max_context=int(ctx.max()), **moved)


@pytest.mark.parametrize("kvh, h", [(4, 4), (2, 8), (1, 8)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_paged_attention_matches_reference(kvh, h, bs):
    gen = torch.Generator().manual_seed(bs * 10 + h)
    d, num_blocks = 16, 40
    # decode tokens at block boundaries (bs-1, bs, bs+1 context), a prefill chunk over a cached
    # prefix, and a fresh prefill
    seqs = [(bs - 2, 1), (bs - 1, 1), (bs, 1), (2 * bs, 5), (0, bs + 3)]
    tables, rows, ctx = mixed_batch(gen, seqs, bs, num_blocks)
    q = torch.randn((len(rows), h, d), generator=gen)
    kc = torch.randn((kvh, num_blocks, bs, d), generator=gen)
    vc = torch.randn((kvh, num_blocks, bs, d), generator=gen)
    ref = paged_attention_ref(q, kc, vc, tables, rows, ctx, 0.3)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan")).to(DEV)  # every element must be written
        run_on_device(q, kc, vc, tables, rows, ctx, 0.3, num_splits=splits, out=out)
        assert torch.isfinite(out).all()
        assert torch.allclose(out.cpu(), ref, atol=1e-5, rtol=1e-4), splits


@pytest.mark.parametrize("softcap, use_sinks, window", [(5.0, False, None), (None, True, 7), (2.0, True, 5)])
def test_paged_attention_softcap_and_sinks(softcap, use_sinks, window):
    """Gemma 2's soft-capping and gpt-oss's sinks (with sliding windows, as those models use them),
    one split and three (the sink must count once across splits)."""
    gen = torch.Generator().manual_seed(11)
    kvh, h, d, bs, nb = 2, 4, 16, 8, 30
    tables, rows, ctx = mixed_batch(gen, [(bs - 1, 1), (3 * bs + 2, 1), (2 * bs, 6), (0, bs + 3)], bs, nb)
    q = 3 * torch.randn((len(rows), h, d), generator=gen)  # large scores: the cap bites
    kc, vc = torch.randn((kvh, nb, bs, d), generator=gen), torch.randn((kvh, nb, bs, d), generator=gen)
    sinks = 2 * torch.randn(h, generator=gen) if use_sinks else None
    ref = paged_attention_ref(q, kc, vc, tables, rows, ctx, 0.5, window=window, softcap=softcap, sinks=sinks)
    if use_sinks:  # the sink takes probability mass: the output is not a convex mix of values alone
        plain = paged_attention_ref(q, kc, vc, tables, rows, ctx, 0.5, window=window, softcap=softcap)
        assert not torch.allclose(ref, plain, atol=1e-3)
    for splits in (1, 3):
        out = run_on_device(
            q, kc, vc, tables, rows, ctx, 0.5, window=window, num_splits=splits, softcap=softcap, sinks=sinks
        )
        assert torch.allclose(out.cpu(), ref, atol=1e-5, rtol=1e-4), splits


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_paged_attention_half_precision_and_window(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    kvh, h, d, bs, nb = 2, 4, 64, 16, 12
    tables, rows, ctx = mixed_batch(gen, [(30, 1), (0, 9), (40, 2)], bs, nb)
    q = torch.randn((len(rows), h, d), generator=gen)
    kc, vc = torch.randn((kvh, nb, bs, d), generator=gen), torch.randn((kvh, nb, bs, d), generator=gen)
    for window in (None, 7):
        ref = paged_attention_ref(q, kc, vc, tables, rows, ctx, d**-0.5, window=window)
        out = paged_attention(
            q.to(dtype),
            kc.to(dtype),
            vc.to(dtype),
            tables,
            rows,
            ctx,
            d**-0.5,
            max_context=int(ctx.max()),
            window=window,
        )
        assert out.dtype == dtype
        assert (out.float() - ref).norm() / ref.norm() < tol


def test_write_kv_skips_padding_slots():
    gen = torch.Generator().manual_seed(4)
    kc, vc = torch.randn((2, 10, 8, 16), generator=gen), torch.randn((2, 10, 8, 16), generator=gen)
    k, v = torch.randn((6, 2, 16), generator=gen), torch.randn((6, 2, 16), generator=gen)
    slots = torch.tensor([3, -1, 17, 79, 8, -1])
    rk, rv = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots)
    write_kv_ref(k, v, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


def test_copy_blocks_all_layers_one_launch_and_swap():
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn((3, 2, 2, 10, 8, 16), generator=gen)  # layers, K/V, heads, blocks, slots, dim
    ref = cache.clone()
    src, dst = torch.tensor([1, 4, 4]), torch.tensor([7, 2, 9])
    copy_blocks(cache, src, dst)
    copy_blocks_ref(ref, src, dst)
    assert torch.equal(cache, ref)
    host = torch.zeros_like(cache)
    swap_blocks(cache, host, torch.tensor([7, 2]), torch.tensor([0, 1]))
    assert torch.equal(host[..., 0, :, :], cache[..., 7, :, :]) and torch.equal(
        host[..., 1, :, :], cache[..., 2, :, :]
    )


def test_wrappers_reject_bad_shapes_and_dtypes():
    kc = torch.zeros((2, 4, 8, 16))
    with pytest.raises(ValueError, match="shapes"):
        write_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), kc, kc.clone(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(
            torch.zeros(1, 4, 16, dtype=torch.float16),
            kc,
            kc.clone(),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
            max_context=1,
        )
    assert choose_splits(4, 8, 32768, 16) > 1 and choose_splits(4096, 8, 512, 16) == 1
