"""The compiled CPU decode attention (``kernels/batchgen_kernels/cpu_attention.cpp``) against the torch reference:
both of its code paths (the 16-key vector path for head_dim 64 / 128 with at most 8 query heads
per kv head and block sizes that are multiples of 16, and the general loop for the rest), float32
and bfloat16 caches, contexts ending on and off block boundaries, sliding windows, soft-capping and
sinks; rows whose tables share first blocks, run together; and an engine on it against the torch
backend on the same model."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.model.attention import CacheShape, CpuAttention, make_backend
from batchgen_kernels import cpu
from batchgen_kernels.cpu_attention import amx_tiles, bf16_dot_products, paged_decode, supports
from batchgen_kernels.reference import paged_attention_ref

# Only a machine without any C++ compiler skips these; a compiler that fails to build them fails them.
if cpu.compiler() is None:
    pytest.skip("no C++ compiler: the engine keeps the torch backend", allow_module_level=True)


def decode_batch(gen, contexts, kvh, h, d, bs, dtype):
    """One query per row over a random (non-contiguous) block table of ``contexts[i]`` keys."""
    width = max(-(-c // bs) for c in contexts)
    num_blocks = width * len(contexts) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: width * len(contexts)].view(len(contexts), width).clone()
    q = torch.randn((len(contexts), h, d), generator=gen).to(dtype)
    kc = torch.randn((kvh, num_blocks, bs, d), generator=gen).to(dtype)
    vc = torch.randn((kvh, num_blocks, bs, d), generator=gen).to(dtype)
    return q, kc, vc, tables, torch.tensor(contexts)


def check(q, kc, vc, tables, ctx, scale, tol, bf16_dot=True, share=True, **kw):
    ref = paged_attention_ref(q, kc, vc, tables, torch.arange(len(ctx)), ctx, scale, **kw)
    out = paged_decode(q, kc, vc, tables, ctx, scale, bf16_dot=bf16_dot, share=share, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    if q.dtype == torch.bfloat16:
        # the output's rounding to bf16 (half a unit in the last place, 2^-9 relative), and on the
        # dot path each softmax weight's rounding to bf16 (2^-9 relative, |error| <= 2^-9 max|v|
        # ~ 8e-3 for these values): a few units in the last place relative, 1e-2 absolute near 0
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=1e-2)
        return
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, err


# (kv_heads, heads, head_dim, block_size): the vector path, then shapes the general loop takes
SHAPES = [
    (2, 8, 64, 16),
    (1, 8, 128, 32),
    (3, 9, 64, 16),  # 3 query heads per kv head (workload R's model)
    (4, 4, 64, 48),
    (1, 12, 64, 16),  # 12 per kv head: general loop
    (2, 4, 48, 16),  # head_dim 48: general loop
    (2, 8, 64, 8),  # block size 8: general loop
]


# bfloat16 twice: on the bf16 dot instruction where it is compiled in, and widened to float32
DTYPES = [(torch.float32, 2e-5, True), (torch.bfloat16, 2**-6, True), (torch.bfloat16, 2**-6, False)]
DTYPE_IDS = ["float32", "bfloat16", "bfloat16-widened"]


def test_bf16_dot_instruction_is_used_exactly_where_the_variant_has_it():
    cpu.load()
    assert bf16_dot_products() == (cpu.variant in ("avx512_bf16", "amx"))


@pytest.mark.parametrize("kvh, h, d, bs", SHAPES)
@pytest.mark.parametrize("dtype, tol, bf16_dot", DTYPES, ids=DTYPE_IDS)
def test_matches_reference(kvh, h, d, bs, dtype, tol, bf16_dot):
    gen = torch.Generator().manual_seed(kvh * 1000 + h * 100 + d + bs)
    # one key, block boundaries either side, contexts of many blocks (and 64-key tiles) ending mid-chunk
    contexts = [1, bs - 1, bs, bs + 1, 2 * bs + 17, 5 * bs + 3, 300]
    q, kc, vc, tables, ctx = decode_batch(gen, contexts, kvh, h, d, bs, dtype)
    check(3 * q, kc, vc, tables, ctx, d**-0.5, tol, bf16_dot)  # large scores: the running max must rescale


@pytest.mark.parametrize("d", [64, 32])  # vector path, general loop
@pytest.mark.parametrize("softcap, use_sinks, window", [(5.0, False, None), (None, True, 7), (2.0, True, 21)])
@pytest.mark.parametrize("dtype, tol, bf16_dot", DTYPES, ids=DTYPE_IDS)
def test_window_softcap_and_sinks(d, softcap, use_sinks, window, dtype, tol, bf16_dot):
    gen = torch.Generator().manual_seed(d + int(use_sinks))
    kvh, h, bs = 2, 4, 16
    q, kc, vc, tables, ctx = decode_batch(gen, [3, 16, 30, 57, 80], kvh, h, d, bs, dtype)
    sinks = 2 * torch.randn(h, generator=gen) if use_sinks else None
    check(3 * q, kc, vc, tables, ctx, 0.5, tol, bf16_dot, window=window, softcap=softcap, sinks=sinks)


def shared_batch(gen, kvh, h, d, bs, dtype):
    """Rows whose tables share first blocks, as n samples, beams and cached prefixes do: a pack of
    five rows on 7 common blocks, then a row sharing 4 of them (the pack takes it only where it
    shares half of what the pack shares), a row on its own, two rows sharing one block (under the
    kernel's 32-key minimum at block size 16), and two rows that are the same sequence, contexts
    ending on and off block boundaries."""
    plan = [  # (common blocks with the previous rows' prefix or None, own context past them)
        (None, 7 * bs + 5),
        (7, 3),
        (7, 1),
        (7, bs),
        (7, 2 * bs + 9),
        (4, 40),
        (None, 3 * bs + 2),
        (None, bs + 4),
        (1, 5),
        (None, 4 * bs),
        ("same", 0),
    ]
    tables, ctx = [], []
    next_block = 0
    for common, extra in plan:
        if common == "same":
            tables.append(list(tables[-1]))
            ctx.append(ctx[-1])
            continue
        shared = [] if common is None else tables[-1][:common]
        keys = len(shared) * bs + extra
        own = -(-keys // bs) - len(shared)
        tables.append(shared + list(range(next_block, next_block + own)))
        next_block += own
        ctx.append(keys)
    width = max(len(t) for t in tables)
    perm = torch.randperm(next_block + 2, generator=gen)
    table = torch.zeros((len(tables), width), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = perm[torch.tensor(t)]
    q = torch.randn((len(tables), h, d), generator=gen).to(dtype)
    kc = torch.randn((kvh, next_block + 2, bs, d), generator=gen).to(dtype)
    vc = torch.randn((kvh, next_block + 2, bs, d), generator=gen).to(dtype)
    return q, kc, vc, table, torch.tensor(ctx)


@pytest.mark.parametrize("kvh, h, d, bs", [(2, 8, 64, 16), (1, 8, 128, 32), (3, 9, 64, 16), (2, 2, 64, 16)])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("dtype, tol, bf16_dot", DTYPES, ids=DTYPE_IDS)
def test_rows_sharing_blocks_attend_them_together(kvh, h, d, bs, use_sinks, dtype, tol, bf16_dot):
    """The pass over blocks that consecutive rows share (``share="always"``; by default only where
    a pack fills its lanes), against the reference and against the kernel run row by row."""
    gen = torch.Generator().manual_seed(h * 10 + d + bs + int(use_sinks))
    q, kc, vc, tables, ctx = shared_batch(gen, kvh, h, d, bs, dtype)
    sinks = 2 * torch.randn(h, generator=gen) if use_sinks else None
    check(3 * q, kc, vc, tables, ctx, d**-0.5, tol, bf16_dot, sinks=sinks)
    check(3 * q, kc, vc, tables, ctx, d**-0.5, tol, bf16_dot, share="always", sinks=sinks)
    kw = dict(sinks=sinks, bf16_dot=bf16_dot)
    together = paged_decode(3 * q, kc, vc, tables, ctx, d**-0.5, share="always", **kw)
    alone = paged_decode(3 * q, kc, vc, tables, ctx, d**-0.5, share=False, **kw)
    torch.testing.assert_close(
        together.float(), alone.float(), rtol=tol, atol=1e-2 if dtype == torch.bfloat16 else tol
    )


@pytest.mark.parametrize(
    "kvh, h, n, shared", [(3, 9, 4, False), (3, 9, 5, True), (2, 8, 3, False), (2, 8, 4, True)]
)
def test_shared_pass_runs_where_a_pack_fills_its_lanes(kvh, h, n, shared):
    """By default the shared pass takes a pack of n rows only where n x query heads per kv head
    fills more than 12 of its 16 lanes: its output is then bit for bit the ``share="always"`` one,
    else the row-by-row one (the two passes round differently, which the first assert checks)."""
    gen = torch.Generator().manual_seed(n)
    bs, d, common = 16, 64, 6
    own = [common + torch.arange(2) + 2 * r for r in range(n)]  # each row's two blocks
    tables = torch.stack([torch.cat([torch.arange(common), blocks]) for blocks in own])
    ctx = torch.full((n,), common * bs + 20)
    q = torch.randn((n, h, d), generator=gen)
    kc, vc = torch.randn((2, kvh, common + 2 * n, bs, d), generator=gen)
    always = paged_decode(q, kc, vc, tables, ctx, d**-0.5, share="always")
    alone = paged_decode(q, kc, vc, tables, ctx, d**-0.5, share=False)
    assert not torch.equal(always, alone)
    torch.testing.assert_close(always, alone)
    default = paged_decode(q, kc, vc, tables, ctx, d**-0.5)
    assert torch.equal(default, always if shared else alone)
    with pytest.raises(ValueError, match="share must be True, False or 'always'"):
        paged_decode(q, kc, vc, tables, ctx, d**-0.5, share="never")


def rising_shared_batch(gen, kvh, h, d, n, shared_blocks, bs=16):
    """n rows sharing ``shared_blocks`` blocks (then 1-2 own blocks each), keys whose scale rises
    along the context: later keys' scores pass the running maximum of the earlier ones by far more
    than e^8, several times over, so that the tile pass must rescale its accumulators mid-way."""
    own = [shared_blocks + 2 * r + torch.arange(2) for r in range(n)]
    tables = torch.stack([torch.cat([torch.arange(shared_blocks), blocks]) for blocks in own])
    blocks = shared_blocks + 2 * n
    kc = torch.randn((kvh, blocks, bs, d), generator=gen)
    growth = torch.linspace(0.2, 6.0, shared_blocks * bs).view(shared_blocks, bs, 1)
    kc[:, :shared_blocks] *= growth
    vc = torch.randn((kvh, blocks, bs, d), generator=gen)
    q = torch.randn((n, h, d), generator=gen)
    ctx = shared_blocks * bs + torch.tensor([bs + 3 * (r % 5) for r in range(n)])
    return q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, ctx


@pytest.mark.skipif(not amx_tiles(), reason="the shared pass runs on AMX tiles only on a CPU with AMX-BF16")
@pytest.mark.parametrize("kvh, h, d, n", [(2, 8, 64, 4), (3, 9, 64, 5), (1, 8, 128, 2), (2, 2, 64, 16)])
@pytest.mark.parametrize("shared_blocks", [7, 33])  # 112 keys (a 16-key tail after 3 x 32) and 528
@pytest.mark.parametrize("use_sinks", [False, True])
def test_amx_shared_pass_matches_the_reference_and_the_dot_pass(kvh, h, d, n, shared_blocks, use_sinks):
    """The shared-block pass on AMX tiles (the default on such a CPU) against the reference and
    against the same pass on the bf16 dot instruction (``amx=False``): both round the softmax
    weights to bf16 against the exact running maximum, so their errors against a float64 reference
    match (within 10% on average and 50% at the largest: a lagging maximum, which prefill uses,
    doubles the largest), and they are not the same code (the outputs differ in some last place)."""
    gen = torch.Generator().manual_seed(d + h + shared_blocks + int(use_sinks))
    q, kc, vc, tables, ctx = rising_shared_batch(gen, kvh, h, d, n, shared_blocks)
    sinks = 2 * torch.randn(h, generator=gen) if use_sinks else None
    ref = paged_attention_ref(q, kc, vc, tables, torch.arange(n), ctx, d**-0.5, sinks=sinks)
    tiles = paged_decode(q, kc, vc, tables, ctx, d**-0.5, sinks=sinks, share="always")
    dot = paged_decode(q, kc, vc, tables, ctx, d**-0.5, sinks=sinks, share="always", amx=False)
    torch.testing.assert_close(tiles.float(), ref.float(), rtol=2**-6, atol=1e-2)
    torch.testing.assert_close(tiles.float(), dot.float(), rtol=2**-6, atol=1e-2)
    assert not torch.equal(tiles, dot)
    exact = paged_attention_ref(
        q.double(), kc.double(), vc.double(), tables, torch.arange(n), ctx, d**-0.5, sinks=sinks
    )
    ours, theirs = (tiles.double() - exact).abs(), (dot.double() - exact).abs()
    assert ours.mean() <= 1.1 * theirs.mean() and ours.max() <= 1.5 * theirs.max()


@pytest.mark.skipif(not amx_tiles(), reason="the shared pass runs on AMX tiles only on a CPU with AMX-BF16")
def test_on_amx_tiles_every_pack_takes_the_shared_pass():
    """On tiles the shared pass costs less than the per-row one for any pack: by default it takes
    R's packs of 4 rows x 3 query heads (12 lanes), which the dot instruction's rule leaves row by row."""
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, tables, ctx = rising_shared_batch(gen, 3, 9, 64, 4, 6)
    default = paged_decode(q, kc, vc, tables, ctx, 0.125)
    assert torch.equal(default, paged_decode(q, kc, vc, tables, ctx, 0.125, share="always"))
    alone = paged_decode(q, kc, vc, tables, ctx, 0.125, share=False)
    assert not torch.equal(default, alone)
    dot_default = paged_decode(q, kc, vc, tables, ctx, 0.125, amx=False)
    assert torch.equal(dot_default, alone)


def test_refuses_what_it_cannot_run():
    assert supports(torch.float32, 8, 2, 64, 16) is None
    assert "float16" in supports(torch.float16, 8, 2, 64, 16)
    assert "64 query heads" in supports(torch.float32, 64, 1, 64, 16)
    assert "head_dim 512" in supports(torch.float32, 8, 2, 512, 16)


def test_engine_on_the_kernel_equals_the_torch_backend(tmp_path):
    """n=4 samples and shared prefixes (the torch backend attends them as decode groups; the
    kernel row by row): same tokens, log-probabilities within float32 rounding."""
    from batchgen.tiny import make_model

    path = str(make_model(tmp_path / "m", "llama", seed=3, hidden_size=256, num_heads=4, num_kv_heads=1))
    prompts = [[5 + i for i in range(40)] + [j] for j in range(3)] + [[7] * 9]
    params = SamplingParams(
        n=4, temperature=0.9, top_p=0.9, max_tokens=12, seed=1, ignore_eos=True, logprobs=0
    )
    results = {}
    for backend in ("cpu", "torch"):
        llm = LLM(path, dtype="float32", device="cpu", attention_backend=backend, block_size=16)
        assert isinstance(llm.engine.runner.backend, CpuAttention) == (backend == "cpu")
        results[backend] = llm.generate(prompts, params)
    for a, b in zip(results["cpu"], results["torch"], strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3


def test_backend_choice():
    shape = CacheShape(torch.float16, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: dtype torch.float16"):
        make_backend("cpu", torch.device("cpu"), shape)
    with pytest.warns(UserWarning, match="compiled CPU attention is not used"):
        assert type(make_backend("auto", torch.device("cpu"), shape)).__name__ == "TorchAttention"
