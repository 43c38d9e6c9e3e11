"""Each Triton kernel against its torch reference (under TRITON_INTERPRET=1 on a CPU machine):
random block tables over non-contiguous blocks, lengths at block boundaries, GQA ratios 1 / 4 / 8,
prefill chunks over a cached prefix mixed with decode tokens, split-KV, sliding windows, logit
soft-capping and attention sinks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_kernels.block_ops import copy_blocks, swap_blocks  # noqa: E402
from batchgen_kernels.kv_write import write_kv  # noqa: E402
from batchgen_kernels.paged_attention import choose_splits, paged_attention  # noqa: E402
from batchgen_kernels.reference import copy_blocks_ref, paged_attention_ref, write_kv_ref  # noqa: E402

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


# the two inner loops: elementwise over one block a step, tl.dot over several blocks a step
PATHS = [dict(use_dot=False, keys_per_step=8), dict(use_dot=True, keys_per_step=64)]


@pytest.mark.parametrize("kvh, h", [(4, 4), (2, 8), (1, 8)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(
    "bs, path",
    [(8, PATHS[0]), (8, PATHS[1]), (16, PATHS[1]), (32, PATHS[1])],
    ids=["8-elementwise", "8-dot", "16-dot", "32-dot"],
)
def test_paged_attention_matches_reference(kvh, h, bs, path):
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
        run_on_device(q, kc, vc, tables, rows, ctx, 0.3, num_splits=splits, out=out, **path)
        assert torch.isfinite(out).all()
        assert torch.allclose(out.cpu(), ref, atol=1e-5, rtol=1e-4), splits


@pytest.mark.parametrize("path", PATHS, ids=["elementwise", "dot"])
@pytest.mark.parametrize("softcap, use_sinks, window", [(5.0, False, None), (None, True, 7), (2.0, True, 5)])
def test_paged_attention_softcap_and_sinks(softcap, use_sinks, window, path):
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
            q,
            kc,
            vc,
            tables,
            rows,
            ctx,
            0.5,
            window=window,
            num_splits=splits,
            softcap=softcap,
            sinks=sinks,
            **path,
        )
        assert torch.allclose(out.cpu(), ref, atol=1e-5, rtol=1e-4), splits


@pytest.mark.parametrize("path", PATHS, ids=["elementwise", "dot"])
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_paged_attention_half_precision_and_window(dtype, tol, path):
    gen = torch.Generator().manual_seed(3)
    kvh, h, d, bs, nb = 2, 4, 64, 16, 12
    tables, rows, ctx = mixed_batch(gen, [(30, 1), (0, 9), (40, 2)], bs, nb)
    q = torch.randn((len(rows), h, d), generator=gen)
    kc, vc = torch.randn((kvh, nb, bs, d), generator=gen), torch.randn((kvh, nb, bs, d), generator=gen)
    for window in (None, 7):
        ref = paged_attention_ref(q, kc, vc, tables, rows, ctx, d**-0.5, window=window)
        out = paged_attention(
            q.to(DEV, dtype),
            kc.to(DEV, dtype),
            vc.to(DEV, dtype),
            tables.to(DEV),
            rows.to(DEV),
            ctx.to(DEV),
            d**-0.5,
            max_context=int(ctx.max()),
            window=window,
            **path,
        )
        assert out.dtype == dtype
        assert (out.float().cpu() - ref).norm() / ref.norm() < tol


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


BEYOND_INT32 = r"""
import torch
from batchgen_kernels.block_ops import copy_blocks
from batchgen_kernels.kv_write import write_kv
from batchgen_kernels.paged_attention import paged_attention
from batchgen_kernels.reference import paged_attention_ref

gen = torch.Generator().manual_seed(0)
# copy_blocks: plane 8 of 9 starts past 2**31 bytes (pages never touched are never allocated)
nb = (1 << 20) + 16
cache = torch.empty((9, nb, 16, 16), dtype=torch.uint8)
for b in (5, nb - 1):
    cache[:, b] = torch.randint(0, 255, (9, 16, 16), dtype=torch.uint8, generator=gen)
copy_blocks(cache, torch.tensor([5, nb - 1]), torch.tensor([nb - 2, 7]))
assert torch.equal(cache[:, nb - 2], cache[:, 5]) and torch.equal(cache[:, 7], cache[:, nb - 1])
del cache

# write_kv and paged_attention: KV head 2 of 3 starts past 2**31 elements of its layer's cache
kvh, h, bs, d = 3, 6, 16, 16
nb = (1 << 22) + 8
kc = torch.empty((kvh, nb, bs, d), dtype=torch.float16)
vc = torch.empty_like(kc)
blocks = torch.tensor([nb - 1, 3, nb - 5])  # one sequence of 40 tokens over three blocks
ctx_len = 40
k = torch.randn((ctx_len, kvh, d), generator=gen).half()
v = torch.randn((ctx_len, kvh, d), generator=gen).half()
slots = blocks[torch.arange(ctx_len) // bs] * bs + torch.arange(ctx_len) % bs
write_kv(k, v, kc, vc, slots)
assert torch.equal(kc[2, nb - 5, : ctx_len - 2 * bs], k[2 * bs :, 2])
assert torch.equal(vc[2, nb - 1], v[:bs, 2])
q = torch.randn((1, h, d), generator=gen).half()
tables, rows, ctx = blocks[None], torch.tensor([0]), torch.tensor([ctx_len])
small_k = torch.zeros((kvh, 3, bs, d))  # the reference on a compact copy of the three blocks
small_v = torch.zeros((kvh, 3, bs, d))
small_k[:, :, :].view(kvh, 3 * bs, d)[:, :ctx_len] = k.float().transpose(0, 1)
small_v[:, :, :].view(kvh, 3 * bs, d)[:, :ctx_len] = v.float().transpose(0, 1)
ref = paged_attention_ref(q.float(), small_k, small_v, torch.tensor([[0, 1, 2]]), rows, ctx, 0.25)
for use_dot in (False, True):
    out = paged_attention(q, kc, vc, tables, rows, ctx, 0.25, max_context=ctx_len, use_dot=use_dot)
    assert (out.float() - ref).norm() / ref.norm() < 2e-2, use_dot
print("ok")
"""


def test_kernels_address_caches_past_two_to_the_31_elements():
    """A KV pool on a large GPU passes 2**31 elements (an H200's fills one layer's K cache of a
    16-layer model to about 2**31): every kernel's offsets are 64-bit. Run in a child process,
    since a 32-bit offset there is a wild write or a crash rather than a wrong number."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}  # host tensors, lazily allocated, on any machine
    run = subprocess.run(
        [sys.executable, "-c", BEYOND_INT32], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
