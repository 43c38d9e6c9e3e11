"""The compiled prefill attention (``kernels/batchgen_kernels/cpu_prefill.cpp``), bfloat16 and float32, against a
float64 reference and against torch's own kernel on the same inputs: chunks from the start of a
sequence and after cached positions, contexts on and off tile and block boundaries, 1 to 16 query
heads per kv head, head_dim 64 and 128, block sizes 8 to 32, scrambled block tables whose unused
slots hold NaN; and an engine on it against the torch path on the same model. On a CPU with AMX
the same for bfloat16 chunks on AMX tiles (``amx=True``).

Tolerance: in bf16 the kernel rounds the softmax weights to bf16 before the weighted sum, as
torch's flash kernel does for bf16, and accumulates in float32, so its error against the exact
result is a bf16 rounding of the output plus that of the weights. In both dtypes its error must be
no larger than torch's kernel's on the same inputs (mean within 25% of it, maximum within twice
it, plus 1e-6), and each output within 2^-7 (bf16) or 1e-5 (float32) of the reference's largest
magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams, utils
from batchgen.model.attention import CpuAttention, TorchAttention
from batchgen_kernels import cpu
from batchgen_kernels.cpu_attention import amx_tiles, prefill, prefill_chunks

# Only a machine without any C++ compiler skips these; a compiler that fails to build them fails them.
if cpu.compiler() is None:
    pytest.skip("no C++ compiler: prefill chunks keep torch's kernel", allow_module_level=True)


def kernel_takes(dtype: torch.dtype) -> bool:
    q = torch.zeros((1, 1, 64), dtype=dtype)
    kc = torch.zeros((1, 1, 16, 64), dtype=dtype)
    return prefill(q, kc, kc, torch.zeros(1, dtype=torch.int64), 1, 1.0) is not None


DTYPES = [
    pytest.param(
        dt, marks=pytest.mark.skipif(not kernel_takes(dt), reason=f"no AVX-512 for {dt}: torch's kernel")
    )
    for dt in (torch.bfloat16, torch.float32)
]
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 1e-5}
# the bfloat16 kernel on the dot instruction, and on AMX tiles where the CPU has them
PATHS = [
    pytest.param((dt, False), id=str(dt).removeprefix("torch."), marks=param.marks)
    for param, dt in zip(DTYPES, (torch.bfloat16, torch.float32), strict=True)
] + [
    pytest.param(
        (torch.bfloat16, True),
        id="bfloat16-amx",
        marks=pytest.mark.skipif(not amx_tiles(), reason="no AMX-BF16: the dot instruction's kernel"),
    )
]


def chunk(gen, n, ctx, heads, kvh, d, bs, dtype=torch.bfloat16):
    """n queries (positions ctx - n .. ctx - 1) over a scrambled block table of ctx keys; the
    cache's other slots, and the last block's slots past ctx, hold NaN."""
    blocks = -(-ctx // bs)
    num_blocks = blocks + 3
    table = torch.randperm(num_blocks, generator=gen)[:blocks].clone()
    kc = torch.full((kvh, num_blocks, bs, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    keys = torch.randn((kvh, ctx, d), generator=gen).to(dtype)
    values = torch.randn((kvh, ctx, d), generator=gen).to(dtype)
    for i in range(ctx):
        kc[:, table[i // bs], i % bs] = keys[:, i]
        vc[:, table[i // bs], i % bs] = values[:, i]
    q = (torch.randn((n, heads, d), generator=gen) * 2).to(dtype)
    return q, kc, vc, table, keys, values


def reference(q, keys, values, scale):
    """Exact causal attention in float64: [n, heads, d]."""
    n, heads, d = q.shape
    kvh, ctx, _ = keys.shape
    g = heads // kvh
    qh = q.double().transpose(0, 1)
    k = keys.double().repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)
    s = qh @ k.transpose(1, 2) * scale
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return (torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v).transpose(0, 1)


def torch_kernel(q, keys, values, scale):
    """torch's kernel on the same inputs (the flash kernel, as the torch path calls it; the keys
    repeated to the query heads, which with enable_gqa torch 2.6 sends to another path)."""
    n, ctx = q.shape[0], keys.shape[1]
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    g = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=visible, scale=scale)
    return o[0].transpose(0, 1)


SHAPES = [  # n, ctx, heads, kv_heads, head_dim, block_size
    (1, 1, 4, 1, 64, 16),
    (5, 5, 8, 2, 64, 16),
    (31, 31, 4, 2, 64, 16),
    (32, 32, 4, 2, 64, 16),
    (33, 33, 4, 2, 64, 16),
    (37, 37, 9, 3, 64, 16),
    (70, 70, 16, 1, 64, 8),
    (1, 100, 8, 2, 64, 16),  # one query after 99 cached keys
    (40, 300, 8, 2, 64, 8),
    (64, 64, 4, 4, 128, 16),
    (33, 70, 8, 2, 128, 32),
    (130, 200, 6, 2, 64, 32),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-ctx{}-h{}-kv{}-d{}-bs{}".format(*s))
def test_prefill_matches_reference_as_closely_as_torch(shape, path):
    n, ctx, heads, kvh, d, bs = shape
    dtype, amx = path
    gen = torch.Generator().manual_seed(n * 1000 + ctx)
    q, kc, vc, table, keys, values = chunk(gen, n, ctx, heads, kvh, d, bs, dtype)
    scale = d**-0.5
    out = prefill(q, kc, vc, table, ctx, scale, amx=amx)
    if amx and bs % 16:  # the tile pass reads 16 keys of one block at a time
        assert out is None
        return
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    want = reference(q, keys, values, scale)
    ours = (out.double() - want).abs()
    theirs = (torch_kernel(q, keys, values, scale).double() - want).abs()
    assert ours.mean() <= 1.25 * theirs.mean() + 1e-6
    assert ours.max() <= 2 * theirs.max() + 1e-6
    assert ours.max() <= TOLERANCE[dtype] * want.abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_each_query_sees_exactly_its_own_prefix(path):
    """Values of one-hot keys: query i's output is the average of the values it sees when every
    score is equal (zero queries), so any key seen too many or too few shows at once."""
    dtype, amx = path
    n, ctx, heads, kvh, d, bs = 50, 80, 4, 1, 64, 16
    gen = torch.Generator().manual_seed(0)
    _, kc, vc, table, _, _ = chunk(gen, n, ctx, heads, kvh, d, bs, dtype)
    values = torch.zeros((kvh, ctx, d))
    values[0, :, 0] = torch.arange(ctx, dtype=torch.float32) / 128  # exact in bf16
    for i in range(ctx):
        vc[:, table[i // bs], i % bs] = values[:, i].to(dtype)
        kc[:, table[i // bs], i % bs] = 0
    q = torch.zeros((n, heads, d), dtype=dtype)
    out = prefill(q, kc, vc, table, ctx, 0.125, amx=amx)
    assert out is not None
    positions = torch.arange(ctx - n, ctx, dtype=torch.float64)
    mean_seen = positions / 2 / 128  # the mean of 0 .. p, over 128
    assert torch.allclose(out[:, :, 0].double(), mean_seen[:, None].expand(n, heads), rtol=2**-8, atol=0)
    assert (out[:, :, 1:] == 0).all()


@pytest.mark.skipif(not amx_tiles(), reason="no AMX-BF16: chunks run one at a time")
def test_chunks_in_one_call_match_each_alone():
    """Chunks of several sequences in one call (the engine's batch of prompts after a cached prefix,
    and others from the start) against each chunk alone on the same tiles: the same outputs bit for
    bit in their rows of the batch, and the rows of no chunk (decode rows) left as they were."""
    gen = torch.Generator().manual_seed(5)
    heads, kvh, d, bs = 8, 2, 64, 16
    shapes = [(32, 544), (7, 7), (1, 300), (50, 50), (16, 80)]  # (positions, context)
    width = max(-(-ctx // bs) for _, ctx in shapes)
    num_blocks = sum(-(-ctx // bs) for _, ctx in shapes) + 2
    kc = torch.randn((kvh, num_blocks, bs, d), generator=gen).to(torch.bfloat16)
    vc = torch.randn((kvh, num_blocks, bs, d), generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen)
    tables, starts, used, row = torch.zeros((len(shapes), width), dtype=torch.int64), [], 0, 3  # 3 decode rows first
    for i, (n, ctx) in enumerate(shapes):
        blocks = -(-ctx // bs)
        tables[i, :blocks] = order[used : used + blocks]
        used += blocks
        starts.append(row)
        row += n
    q = (torch.randn((row, heads, d), generator=gen) * 2).to(torch.bfloat16)
    out = torch.full_like(q, 7.0)
    n_of = torch.tensor([n for n, _ in shapes])
    ctx_of = torch.tensor([ctx for _, ctx in shapes])
    assert prefill_chunks(q, kc, vc, tables, torch.tensor(starts), n_of, ctx_of, d**-0.5, out)
    for i, (n, ctx) in enumerate(shapes):
        rows = slice(starts[i], starts[i] + n)
        alone = prefill(q[rows], kc, vc, tables[i, : -(-ctx // bs)], ctx, d**-0.5, amx=True)
        assert torch.equal(out[rows], alone), i
    assert (out[:3] == 7.0).all()


def test_prefill_declines_shapes_it_does_not_take():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kvh, d in [(4, 1, 32), (34, 2, 64)]:  # head_dim 32; 17 query heads per kv head
            q, kc, vc, table, _, _ = chunk(gen, 4, 4, heads, kvh, d, 16, dtype)
            assert prefill(q, kc, vc, table, 4, d**-0.5) is None
            assert prefill(q, kc, vc, table, 4, d**-0.5, amx=True) is None
    q, kc, vc, table, _, _ = chunk(gen, 4, 4, 8, 2, 64, 16, torch.float32)
    assert prefill(q, kc, vc, table, 4, 0.125, amx=True) is None  # AMX tiles: bfloat16 only


@pytest.mark.parametrize("path", PATHS)
def test_engine_on_the_prefill_kernel_matches_the_torch_path(head64_dir, monkeypatch, path):
    """Greedy with chunked prefill (chunks after cached positions) and a cached shared prefix,
    prompts through the kernel and through torch's kernel: the same tokens, and log-probabilities
    that differ by rounding only: in bf16 mean at most 0.05 nats, each at most 0.2 (the two kernels
    round weights and outputs at different points, and 2 layers over ~200-token prompts of a random
    model carry that to the logits; the same prompts in float32 differ from either by 0.2 nats on
    average), in float32 1e-4 (float32 summation order); and the kernel did run (on AMX tiles for
    the bfloat16-amx case, the engine's choice on such a CPU). In bf16 a row may part at a near-tie
    (this random model's top two tokens within 0.05 nats, which that rounding can flip: the kernel's
    token is the torch path's runner-up by at most that), after which its tokens are not compared;
    most tokens must still agree."""
    import batchgen_kernels.cpu_attention as ca

    dtype, amx = path
    calls, batches = [], []
    kernel, batched = ca.prefill, ca.prefill_chunks

    def counted(*args, **kwargs):
        if kwargs.get("amx", False) == amx:
            calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    def counted_batch(*args):
        batches.append(args[3].shape[0])  # chunks in the call
        return batched(*args)

    shared = [1] + [(7 * i) % 300 + 3 for i in range(140)]
    prompts = [shared + [5, 6, 7], shared + [9], [1, 2, 3, 4, 5, 6], list(range(3, 200))]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)

    def run():
        llm = LLM(
            head64_dir,
            dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=8,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
        )
        assert isinstance(llm.engine.runner.backend, CpuAttention)
        return llm.generate(prompts, params, use_tqdm=False)

    monkeypatch.setattr(ca, "prefill", counted)
    monkeypatch.setattr(ca, "prefill_chunks", counted_batch)
    if not amx:  # without AMX, bf16 runs on the dot instruction's kernel
        monkeypatch.setattr(utils, "has_amx", lambda: False)
    ours = run()
    assert calls and max(calls) > 1
    if amx:  # steps with several prompts' chunks ran them in one call
        assert batches and max(batches) > 1
    monkeypatch.setattr(CpuAttention, "_prefill", TorchAttention._prefill)
    monkeypatch.setattr(CpuAttention, "_prefills", TorchAttention._prefills)
    calls.clear()
    batches.clear()
    theirs = run()
    assert not calls and not batches
    tie = 0.05 if dtype == torch.bfloat16 else 0.0
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        got, want = a.outputs[0], b.outputs[0]
        for g, w, x, y in zip(got.token_ids, want.token_ids, got.logprobs, want.logprobs, strict=True):
            if g != w:
                assert g in y and y[w].logprob - y[g].logprob <= tie, (g, w, y)
                break
            diffs.append(abs(x[g].logprob - y[g].logprob))
    most, mean = (0.2, 0.05) if dtype == torch.bfloat16 else (1e-4, 1e-5)
    assert len(diffs) >= 0.75 * 8 * len(prompts)
    assert max(diffs) <= most and sum(diffs) / len(diffs) <= mean
