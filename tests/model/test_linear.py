"""Linear layers: the compiled GEMM kernel and oneDNN's packed GEMM equal ``F.linear``; the engine
uses the kernel on the CPU (oneDNN where the kernel cannot run) unless told otherwise, and the
setting is validated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, SamplingParams, utils
from batchgen.config import EngineConfig
from batchgen.model.linear import Linear, backends_for
from batchgen.model.malloc import keep_freed_memory
from batchgen_kernels import cpu, cpu_gemm, cpu_ops

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
# oneDNN's bf16 GEMM needs AVX-512 (or AMX / AVX2-VNNI-2); elsewhere a bf16 layer falls back to F.linear
needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN without bf16 on this CPU",
)


def kernel_runs(dtype: torch.dtype) -> bool:
    return cpu_gemm.pack(torch.zeros(16, 16, dtype=dtype)) is not None


def needs_kernel(dtype: torch.dtype):
    return pytest.mark.skipif(
        not kernel_runs(dtype), reason=f"no compiled GEMM kernel for {dtype} on this CPU"
    )


# The bf16 kernel tests run on both of the kernel's bf16 paths where this CPU has them: AMX tiles
# (``amx_part``, inputs of a multiple of 32 columns) and the dot instruction.
BF16_PATHS = [
    pytest.param(True, id="amx", marks=pytest.mark.skipif(not cpu_gemm.amx(), reason="no AMX tiles here")),
    pytest.param(False, id="dot"),
]
# (dtype, bf16 path) for the tests of both dtypes: float32 once, bf16 on each of its paths
DTYPE_PATHS = [
    pytest.param(torch.float32, None, id="float32"),
    *(pytest.param(torch.bfloat16, *p.values, id=f"bfloat16-{p.id}", marks=p.marks) for p in BF16_PATHS),
]


@pytest.fixture
def bf16_path(request):
    """Sets the kernel's bf16 path for one test (``cpu_gemm.amx``), restoring it after; None
    leaves it as it is (a float32 test)."""
    if request.param is None:
        yield None
        return
    before = cpu_gemm.amx()
    cpu_gemm.amx(request.param)
    yield request.param
    cpu_gemm.amx(before)


def check_against_float64(layer: Linear, w, b, x, rel: float) -> None:
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = layer(x)
    assert got.shape == want.shape and got.dtype == w.dtype
    err = (got.double() - want).abs().max()
    assert err <= rel * want.abs().max(), (float(err), float(want.abs().max()))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300, 2100])  # 2,100: pieces of 2,048 and 52 rows, padded
def test_onednn_linear_equals_f_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    layer = Linear(w, b, backends=["onednn"], strict=True)
    assert layer.packed is not None and layer.backend == "onednn"
    check_against_float64(layer, w, b, torch.randn(rows, 80, generator=gen), 1e-4)
    # a non-contiguous input (a slice of a wider activation) gives the same result
    wide = torch.randn(rows, 160, generator=gen)
    assert torch.allclose(layer(wide[:, ::2]), F.linear(wide[:, ::2], w, b), atol=1e-4)


@needs_onednn_bf16
def test_onednn_linear_bfloat16():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=gen).bfloat16()
    x = torch.randn(5, 48, generator=gen).bfloat16()
    layer = Linear(w, backends=["onednn"], strict=True)
    want = F.linear(x.float(), w.float())
    assert layer(x).dtype == torch.bfloat16
    assert ((layer(x).float() - want).abs().max() / want.abs().max()) < 2e-2


# Every row count of a 6-row register block's remainder (1-5 and full blocks), columns short of
# one 16-wide vector, not a multiple of the 4-vector block, split unevenly over two threads.
@needs_kernel(torch.float32)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 13, 64, 301])
@pytest.mark.parametrize("n", [5, 16, 88, 200])
def test_kernel_linear_float32(rows, n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 72
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if rows % 2 else None
    layer = Linear(w, b, backends=["cpu"], strict=True)
    assert layer.kernel is not None and layer.packed is None and layer.backend == "cpu"
    x = torch.randn(rows, k, generator=gen)
    check_against_float64(layer, w, b, x, 1e-5)
    # rows far apart (a view of a wider activation) and a non-unit column stride
    wide = torch.randn(rows, 3 * k, generator=gen)
    check_against_float64(layer, w, b, wide[:, k : 2 * k], 1e-5)
    check_against_float64(layer, w, b, wide[:, ::3], 1e-5)
    # leading dimensions are kept
    assert layer(x.view(1, rows, k)).shape == (1, rows, n)
    assert torch.equal(layer.widened(x), layer(x))


@needs_kernel(torch.bfloat16)
@pytest.mark.parametrize("bf16_path", BF16_PATHS, indirect=True)
@pytest.mark.parametrize("rows", [1, 5, 6, 16, 32, 40, 257])
@pytest.mark.parametrize("n", [7, 48, 200])
def test_kernel_linear_bfloat16(rows, n, bf16_path):
    """Products of bf16 values are exact in float32; the one rounding is the output's to bf16, so
    the error is at most half a bf16 ulp of the result (2^-9 relative) plus float32 summation.
    On AMX tiles: one 16-row tile (16), whole 32-row blocks (32), a block padded with zero rows (5,
    40), a second 256-row chunk of one row (257); 7 columns (a partial vector), 3 vectors (one
    thread's pair and the other's single vector)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 96
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if rows % 2 else None
    layer = Linear(w, b, backends=["cpu"], strict=True)
    assert layer.kernel is not None and layer.backend == "cpu"
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = layer(x).double()
    assert layer(x).dtype == torch.bfloat16
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-3).all()
    # the same as rounding the float32 result once
    assert (got - want.float().bfloat16().double()).abs().max() <= 2**-7 * want.abs().max()
    wide = torch.randn(rows, 2 * k, generator=gen).bfloat16()
    assert torch.equal(layer(wide[:, k:]), layer(wide[:, k:].contiguous()))
    # widened (the LM head's float32 logits): the bf16 result, bit for bit, as float32
    widened = layer.widened(x.view(1, rows, k))
    assert widened.dtype == torch.float32 and widened.shape == (1, rows, n)
    assert torch.equal(widened[0], layer(x).float())


# Each row block of a column panel prefetches a share of the next panel unless the two panels and
# the rows outgrow L2: rows 8 at k 1024 take the prefetching K loop, 1,200 (megabytes of rows) the
# plain one, and 600 rows at k 16 more row blocks (100) than the next panel has cache lines (64 in
# float32). Three panels per thread at n 384; the gated layer's epilogue behind both loops.
@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize(("rows", "k"), [(8, 1024), (1200, 1024), (600, 16)])
def test_kernel_with_and_without_the_next_panels_prefetch(dtype, rows, k, bf16_path):
    if not kernel_runs(dtype):
        pytest.skip(f"no compiled GEMM kernel for {dtype} on this CPU")
    from batchgen_kernels import cpu_ops

    gen = torch.Generator().manual_seed(rows + k)
    n = 384
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    layer = Linear(w, b, backends=["cpu"], strict=True)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    want = F.linear(x.double(), w.double(), b.double())
    got = layer(x).double()
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert (got - want).abs().max() <= tol * want.abs().max(), float((got - want).abs().max())
    gated = Linear(w, b, backends=["cpu"], strict=True, gated=True)
    hidden = gated.silu_mul(x)
    if dtype == torch.bfloat16:
        assert torch.equal(hidden, cpu_ops.silu_mul(layer(x)))
    else:
        gate, up = want.chunk(2, dim=-1)
        assert (hidden.double() - F.silu(gate) * up).abs().max() <= 1e-5 * (F.silu(gate) * up).abs().max()


@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
@pytest.mark.parametrize("n", [32, 96, 160])
def test_gated_kernel_gives_silu_of_gate_times_up(dtype, rows, n, bf16_path):
    """A [gate; up] layer packed gated: silu(gate) * up in the GEMM's pass equals the plain GEMM
    followed by the SwiGLU kernel, bit for bit in bf16 (the same rounding points), to float32
    rounding in float32; the plain call still gives [gate | up]. n: one vector pair, three (a
    4-vector block and a 2-vector one), five (split unevenly over two threads)."""
    if not kernel_runs(dtype):
        pytest.skip(f"no compiled GEMM kernel for {dtype} on this CPU")
    from batchgen_kernels import cpu_ops

    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 64
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
    gated = Linear(w, b, backends=["cpu"], strict=True, gated=True)
    plain = Linear(w, b, backends=["cpu"], strict=True)
    assert (
        gated.kernel is not None
        and gated.kernel.gated
        and plain.silu_mul(torch.ones(1, k, dtype=dtype)) is None
    )
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]  # strided rows and columns
    assert torch.equal(gated(x), plain(x))
    got = gated.silu_mul(x.view(1, rows, k))
    assert got.shape == (1, rows, n // 2) and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got[0], cpu_ops.silu_mul(plain(x)))
    else:
        gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, dim=-1)
        want = F.silu(gate) * up
        assert (got[0].double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize("tokens, top_k, bias", [(1, 1, False), (7, 2, True), (130, 4, False)])
def test_grouped_experts_equal_each_expert_on_its_rows(dtype, tokens, top_k, bias, bf16_path):
    """A mixture-of-experts layer's experts in one kernel call: every token's output is the sum
    over its slots of the routing weight times its expert's output on that token, the expert run
    alone (the same packed GEMMs, whose rows do not depend on each other), summed in float64 here:
    within one rounding to the dtype (2^-8 relative in bf16), 1e-5 in float32. Five experts, one
    never chosen; strided input rows; with and without biases."""
    if not kernel_runs(dtype):
        pytest.skip(f"no compiled GEMM kernel for {dtype} on this CPU")
    from batchgen.model.moe import Expert

    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts_count, d, inter = 5, 64, 48

    def linear(n: int, k: int, gated: bool = False) -> Linear:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        return Linear(w, b, backends=["cpu"], strict=True, gated=gated)

    experts = [Expert(linear(2 * inter, d, gated=True), linear(d, inter)) for _ in range(experts_count)]
    grouped = cpu_gemm.PackedExperts.of([e.gate_up.kernel for e in experts], [e.down.kernel for e in experts])
    assert grouped is not None
    x = torch.randn(tokens, 2 * d, generator=gen).to(dtype)[:, ::2]
    scores = torch.rand(tokens, experts_count - 1, generator=gen)  # expert 4 is never chosen
    weights, chosen = torch.topk(torch.softmax(scores, dim=-1), top_k, dim=-1)
    got = grouped(x, weights, chosen)
    assert got.shape == (tokens, d) and got.dtype == dtype
    want = torch.zeros(tokens, d, dtype=torch.float64)
    for t in range(tokens):
        for s in range(top_k):
            alone = experts[int(chosen[t, s])](x[t : t + 1], lambda gate_up: gate_up)  # unit unused: gated
            want[t] += float(weights[t, s]) * alone[0].double()
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= rel * want.abs() + 1e-6 * want.abs().max()).all()


@needs_kernel(torch.float32)
def test_grouped_experts_need_every_expert_packed_alike():
    """One expert not packed gated (its halves not whole vector pairs), a missing kernel, or
    experts of different shapes: no grouped call (the layer runs them one by one)."""
    gated = cpu_gemm.pack(torch.randn(64, 32), gated=True)
    down = cpu_gemm.pack(torch.randn(32, 32))
    assert cpu_gemm.PackedExperts.of([gated, gated], [down, down]) is not None
    assert cpu_gemm.PackedExperts.of([gated, cpu_gemm.pack(torch.randn(64, 32))], [down, down]) is None
    assert cpu_gemm.PackedExperts.of([gated, None], [down, down]) is None
    assert cpu_gemm.PackedExperts.of([gated, gated], [down, cpu_gemm.pack(torch.randn(32, 48))]) is None
    assert cpu_gemm.PackedExperts.of([], []) is None
    grouped = cpu_gemm.PackedExperts.of([gated, gated], [down, down])
    assert grouped is not None
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 2\), got \[\[0\], \[2\]\]"):
        grouped(torch.randn(2, 32), torch.ones(2, 1), torch.tensor([[0], [2]]))


@needs_kernel(torch.float32)
def test_gated_packing_needs_whole_vector_pairs():
    """[gate; up] halves that are not whole 16-column vectors pack plain (the activation then runs
    separately)."""
    layer = Linear(torch.randn(48, 16), backends=["cpu"], gated=True)
    assert layer.kernel is not None and not layer.kernel.gated
    assert layer.silu_mul(torch.randn(2, 16)) is None


@needs_onednn_bf16
@needs_kernel(torch.bfloat16)
@pytest.mark.parametrize(("cpu_amx", "kernel_amx", "k", "backend"), [
    (False, False, 48, "cpu"),  # no AMX: the kernel's dot instruction
    (True, True, 64, "cpu"),  # the kernel on AMX tiles
    (True, True, 48, "onednn"),  # a width the tiles do not take: oneDNN's AMX GEMM
    (True, False, 64, "onednn"),  # tiles not compiled in
])
def test_bfloat16_layers_on_amx_cpus_take_the_faster_gemm(monkeypatch, cpu_amx, kernel_amx, k, backend):
    from batchgen.model import linear

    monkeypatch.setattr(utils, "has_amx", lambda: cpu_amx)
    monkeypatch.setattr(linear, "_kernel_amx", lambda: kernel_amx)
    w = torch.randn(32, k).bfloat16()
    assert Linear(w, backends=backends_for("auto", torch.device("cpu"), torch.bfloat16)).backend == backend
    assert Linear(w, backends=["cpu"], strict=True).backend == "cpu"  # linear_backend="cpu" still runs it
    assert Linear(torch.randn(32, k), backends=["cpu", "onednn", "torch"]).backend == "cpu"  # float32


@pytest.mark.skipif(not utils.has_amx(), reason="no AMX here")
@pytest.mark.parametrize(("isa", "amx"), [("AVX512_CORE_BF16", False), ("AVX512_CORE", False), ("AVX2", False),
                                          ("AVX512_CORE_AMX", True), ("ALL", True)])
def test_capping_onednn_below_amx_makes_the_engine_choose_as_without_it(monkeypatch, isa, amx):
    """``ONEDNN_MAX_CPU_ISA`` below AMX: oneDNN runs without tiles, and the engine's choices that
    count on them (``has_amx``) follow, so that a forced variant stands in for a CPU without AMX."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    utils.has_amx.cache_clear()  # read once per process
    try:
        assert utils.has_amx() is amx
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        utils.has_amx.cache_clear()


@needs_kernel(torch.bfloat16)
@pytest.mark.skipif(not cpu_gemm.amx(), reason="no AMX tiles here")
def test_bfloat16_prefill_chunks_on_amx_tiles_go_through_f_linear(monkeypatch):
    """From _TORCH_FROM_ROWS rows a bf16 layer on AMX tiles runs F.linear on its own weight (MKL's
    AMX GEMM, faster at prefill sizes); fewer rows, and a gated layer's fused SwiGLU, stay on the
    tiles."""
    from batchgen.model.linear import _TORCH_FROM_ROWS

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    b = torch.randn(64, generator=gen).bfloat16()
    layer = Linear(w, b, backends=["cpu"], strict=True)
    gated = Linear(w, b, backends=["cpu"], strict=True, gated=True)
    assert layer.kernel is not None and gated.kernel is not None and gated.kernel.gated
    calls = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape) or linear(*a))
    big = torch.randn(_TORCH_FROM_ROWS, 96, generator=gen).bfloat16()
    assert torch.equal(layer(big), linear(big, w, b))
    assert torch.equal(layer(big.view(2, -1, 96)), linear(big, w, b).view(2, -1, 64))
    assert calls == [big.shape, (2, _TORCH_FROM_ROWS // 2, 96)]
    small = big[:-1]
    assert torch.equal(layer(small), layer.kernel(small))
    assert torch.equal(gated.silu_mul(big), gated.kernel.silu_mul(big))
    assert len(calls) == 2  # neither went through F.linear


@needs_onednn
def test_kernel_declines_an_odd_bfloat16_width():
    """The bf16 layout pairs input columns; an odd count falls back to oneDNN under "auto" (to
    ``F.linear`` where oneDNN has no bf16 GEMM on this CPU)."""
    w = torch.randn(32, 33).bfloat16()
    assert cpu_gemm.pack(w) is None
    fallback = "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch"
    assert Linear(w, backends=["cpu", "onednn", "torch"]).backend == fallback
    with pytest.raises(
        ValueError, match="linear_backend='cpu': it cannot run a \\(32, 33\\) torch.bfloat16 layer"
    ):
        Linear(w, backends=["cpu"], strict=True)


def test_linear_backend_setting():
    dev = torch.device("cpu")
    assert backends_for("torch", dev, torch.float32) == ["torch"]
    assert backends_for("auto", dev, torch.float16) == ["torch"]  # no fp16 GEMMs but F.linear's
    assert backends_for("auto", torch.device("cuda"), torch.bfloat16) == ["torch"]
    if cpu.available() and torch.backends.mkldnn.is_available():
        for dtype in (torch.float32, torch.bfloat16):
            assert backends_for("auto", dev, dtype) == ["cpu", "onednn", "torch"]
    with pytest.raises(ValueError, match="linear_backend='onednn' needs a CPU device"):
        backends_for("onednn", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend='cpu' needs a CPU device"):
        backends_for("cpu", dev, torch.float16)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, cpu, onednn, torch, got 'mkl'"):
        EngineConfig(model="m", linear_backend="mkl")


@needs_onednn
@needs_kernel(torch.float32)
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_engine_packs_its_cpu_weights_unless_told_not_to(tmp_path, arch):
    from batchgen.tiny import make_model

    path = str(make_model(tmp_path / arch, arch))
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.stats()["linear_backend"] == "cpu"
    packed = llm.engine.runner.model
    # qkv, o and the MLP's two per layer, and the LM head; the one MoE layer (of 2) has a router,
    # two per expert (6) and the shared expert's two and its gate in place of the MLP's two
    moe = 1 + 2 * 6 + 3 - 2 if arch == "qwen2_moe" else 0
    assert len(packed.linears) == 4 * 2 + 1 + moe
    assert all(layer.kernel is not None for layer in packed.linears)
    # the MoE layer's routed experts run as one kernel call
    assert [layer.grouped is not None for layer in packed._moe_blocks] == ([True] if arch == "qwen2_moe" else [])
    onednn_llm = LLM(path, dtype="float32", device="cpu", linear_backend="onednn")
    assert onednn_llm.stats()["linear_backend"] == "onednn"
    assert all(
        layer.packed is not None and layer.kernel is None for layer in onednn_llm.engine.runner.model.linears
    )
    plain_llm = LLM(path, dtype="float32", device="cpu", linear_backend="torch")
    assert plain_llm.stats()["linear_backend"] == "torch"
    plain = plain_llm.engine.runner.model
    assert all(layer.grouped is None for layer in onednn_llm.engine.runner.model._moe_blocks + plain._moe_blocks)
    assert (
        plain.lm_head.packed is None and plain.lm_head.kernel is None and plain.layers[0].qkv.kernel is None
    )
    # the three give the same greedy tokens
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = [
        [o.outputs[0].token_ids for o in m.generate(prompts, params)] for m in (llm, onednn_llm, plain_llm)
    ]
    assert outs[0] == outs[1] == outs[2]


def test_freed_memory_stays_in_the_process():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory() and keep_freed_memory()


def test_a_large_vocabulary_s_logits_stay_in_the_heap(tmp_path):
    """128 rows of a 151,936-token vocabulary's logits (78 MB, above glibc's default mmap cap)
    are allocated and freed every decode step: the runner raises the thresholds to cover them,
    so a decode step touches at most a quarter of them afresh (without it: about 19,000 faults a
    step, the whole block). In a process
    of its own, as a job's engine runs: a test session's heap, after hundreds of engines built and
    dropped, does not keep the block."""
    import platform
    import subprocess
    import sys

    from batchgen.tiny import make_model

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    path = make_model(tmp_path / "m", "llama", seed=0, vocab_size=151936, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    script = f"""
import resource
from batchgen import LLM, SamplingParams
llm = LLM({str(path)!r}, dtype="float32", device="cpu", max_num_seqs=128, num_kv_blocks=256, num_threads=2)
eng = llm.engine
for i in range(32):
    eng.add_request(str(i), [5 + i] * 8, SamplingParams(n=4, max_tokens=16, ignore_eos=True, seed=i))
for _ in range(4):  # the prompts, then decode steps of 128 rows
    eng.step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    eng.step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 4)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    per_step = float(done.stdout.strip().splitlines()[-1])
    # the block is 18,994 pages; some runs still fault a quarter of it a step (docs/kernels.md)
    assert per_step < 128 * 151936 * 4 // 4096 // 2, per_step


def fp8_kernel_runs() -> bool:
    return cpu_gemm.PackedBytes.of(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.ones(1), None,
                                 torch.float32) is not None


def assert_close_to_float64(got: torch.Tensor, want: torch.Tensor, rows: int, n: int, dtype: torch.dtype) -> None:
    """A widening kernel's output against the float64 product: within float32's rounding, or
    bfloat16's rounding of the output."""
    assert got.shape == (rows, n) and got.dtype == dtype
    if rows:
        rel = 1e-5 if dtype == torch.float32 else 2**-8
        assert (got.double() - want).abs().max() <= rel * want.abs().max()


def byte_weight(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """fp8: every one of the 256 E4M3 codes but NaN (the subnormals and zero among the first
    row's); int8: every value from -128 to 127."""
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        codes[0, : min(k, 8)] = torch.arange(min(k, 8), dtype=torch.uint8)
        codes[codes & 0x7F == 0x7F] = 0x7E  # no NaN
        return codes.view(torch.float8_e4m3fn)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)[: q.numel()]
    return q


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 / int8 GEMM kernel on this CPU")
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize("rows", [0, 1, 4, 7, 64])
@pytest.mark.parametrize("n", [5, 16, 88])
@pytest.mark.parametrize("k", [48, 96])
def test_byte_kernel_equals_the_widened_weight(kind, dtype, bf16_path, rows, n, k):
    """FP8 and int8 weights widened in registers (``byte_weight``'s values) against the float64
    product of the widened weight and its per-column or per-tensor scale; column tails short of a
    vector, row remainders of the register block, a strided input. In bf16 on a CPU with AMX, k 96
    takes the tiles (the bytes widened to bf16 pairs), k 48 the dot instruction."""
    gen = torch.Generator().manual_seed(rows * 100 + n + k)
    w = byte_weight(kind, n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]  # a strided view
    for scale in (torch.rand(n, generator=gen) + 0.5, torch.tensor([0.01])):
        packed = cpu_gemm.PackedBytes.of(w, scale, bias if n % 2 else None, dtype)
        assert packed is not None and packed.kernel == f"gemm_{kind}"
        got = packed(x)
        want = x.double() @ (w.double() * scale.double().reshape(-1, 1)).T
        if n % 2:
            want = want + bias.double()
        assert_close_to_float64(got, want, rows, n, dtype)


@pytest.mark.skipif(not cpu_gemm.amx_int8(), reason="no AMX-INT8 tiles here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k", "n"), [(0, 64, 16), (1, 64, 16), (3, 100, 40), (17, 576, 88), (33, 1536, 5),
                                              (300, 128, 50)])
def test_w8a8_tiles_equal_the_int8_products(dtype, rows, k, n):
    """W8A8 on AMX-INT8 tiles: each row rounded to its int8 grid (as ``round_tokens_int8`` rounds
    it), times every int8 weight value, summed exactly and scaled, against float64; inputs short of
    a 64-wide tile (k 100), column tails, row blocks past one chunk of 256, a strided input, a zero
    row (its scale clamped) and a row whose largest magnitude is negative."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    w = byte_weight("int8", n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]
    if rows > 2:
        x[1] = 0
        x[2, 0] = -x[2].abs().max() * 2
    for scale, b in ((torch.rand(n, generator=gen) * 0.01 + 1e-3, bias), (torch.tensor([0.02]), None)):
        packed = cpu_gemm.PackedInt8Tiles.of(w, scale, b, dtype)
        assert packed is not None
        got = packed(x)
        s = x.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        q = torch.round(x.float() / s).clamp(-128, 127)
        assert torch.equal((q * s).to(dtype), cpu_ops.round_tokens_int8(x.contiguous()))  # the same grid
        want = (q.double() @ w.double().T) * s.double() * scale.double().reshape(1, -1)
        if b is not None:
            want = want + b.double()
        assert_close_to_float64(got, want, rows, n, dtype)


@pytest.mark.skipif(not cpu_gemm.amx(), reason="no AMX tiles here")
@pytest.mark.parametrize(("rows", "k", "n", "group"), [(0, 64, 16, 32), (1, 64, 16, 64), (5, 96, 40, 32),
                                                       (33, 256, 88, 128), (300, 128, 5, 128),
                                                       (40, 576, 200, 64)])
def test_int4_tiles_equal_the_weight_rounded_to_bf16(rows, k, n, group):
    """int4 weight-only on the bf16 tiles: every code 0-15, a scale and a zero point per column and
    group (each group's different; scales kept in bf16), against float64 on the dequantized weight
    rounded to bf16 (the kernel's rounding of a weight); column tails, row blocks past one chunk of
    256, a strided input; several pairs of vectors a thread (each widened while the one before is
    multiplied)."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)[: codes.numel()]
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, 2 * k, generator=gen).to(torch.bfloat16)[:, ::2]
    packed = cpu_gemm.PackedInt4Tiles.of(codes, scale, zero, group, bias, torch.bfloat16)
    assert packed is not None
    scale16 = scale.to(torch.bfloat16).float()  # kept in bf16
    w = ((codes.float() - zero.repeat_interleave(group, 1)) * scale16.repeat_interleave(group, 1)).to(torch.bfloat16)
    want = x.double() @ w.double().T + bias.double()
    assert_close_to_float64(packed(x), want, rows, n, torch.bfloat16)
    signed = cpu_gemm.PackedInt4Tiles.of((codes.to(torch.int16) - 8).to(torch.int8), scale, zero, group, bias,
                                         torch.bfloat16)  # symmetric checkpoints' codes, stored minus 8
    assert signed is not None and torch.equal(signed(x), packed(x))
    eights = cpu_gemm.PackedInt4Tiles.of(codes, scale, torch.full_like(zero, 8.0), group, bias, torch.bfloat16)
    no_zeros = cpu_gemm.PackedInt4Tiles.of(codes, scale, None, group, bias, torch.bfloat16)  # symmetric: none kept
    assert eights is not None and no_zeros is not None and no_zeros.zeros is None
    assert torch.equal(no_zeros(x), eights(x))
    cpu_gemm.amx(False)  # the tiles turned off: the call says so
    try:
        if rows:
            with pytest.raises(cpu_gemm.KernelArgumentError, match="gemm_int4_amx"):
                packed(x)
    finally:
        cpu_gemm.amx(True)


@pytest.mark.skipif(not cpu_gemm.amx(), reason="no AMX tiles here")
def test_int4_tiles_refuse_what_they_cannot_take():
    codes, scale, zero = torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    assert cpu_gemm.PackedInt4Tiles.of(codes, scale, zero, 32, None, torch.bfloat16) is not None
    assert cpu_gemm.PackedInt4Tiles.of(codes, scale, zero, 32, None, torch.float32) is None  # bf16 only
    assert cpu_gemm.PackedInt4Tiles.of(codes[:, :48], scale, zero, 24, None, torch.bfloat16) is None  # k % 32
    assert cpu_gemm.PackedInt4Tiles.of(codes, scale[:, :1], zero, 32, None, torch.bfloat16) is None  # scales
    assert cpu_gemm.PackedInt4Tiles.of(codes, torch.ones(16, 3), torch.ones(16, 3), 21, None, torch.bfloat16) is None
    assert cpu_gemm.PackedInt4Tiles.of(codes.int(), scale, zero, 32, None, torch.bfloat16) is None  # bytes only


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 GEMM kernel on this CPU")
def test_fp8_kernel_refuses_what_it_cannot_take():
    w = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    assert cpu_gemm.PackedBytes.of(w.float(), torch.ones(1), None, torch.float32) is None  # not FP8 nor int8
    assert cpu_gemm.PackedBytes.of(w.view(torch.uint8), torch.ones(1), None, torch.float32) is None
    assert cpu_gemm.PackedBytes.of(w, torch.ones(3), None, torch.float32) is None  # scales for 3 of 16 columns
    assert cpu_gemm.PackedBytes.of(w, torch.ones(1), None, torch.float16) is None
    packed = cpu_gemm.PackedBytes.of(w, torch.ones(16), None, torch.bfloat16)
    with pytest.raises(cpu_gemm.KernelArgumentError, match="gemm_fp8: x must be bfloat16, got float32"):
        packed(torch.zeros(2, 32))
    with pytest.raises(cpu_gemm.KernelArgumentError, match=r"gemm_fp8: x must have shape \[\*, 32\]"):
        packed(torch.zeros(2, 31, dtype=torch.bfloat16))


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 GEMM kernel on this CPU")
@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize("rows", [0, 1, 4, 7, 64])
@pytest.mark.parametrize("n,group", [(5, 16), (16, 48), (88, 32), (33, 96)])
def test_fp8_block_kernel_equals_the_widened_weight(dtype, bf16_path, rows, n, group):
    """Block-wise FP8: every E4M3 code but NaN, a scale per column and group of inputs (2^-12 to
    2^4, each group's different) multiplying the widened weights, against the float64 product;
    one group or several, column tails, register-block row remainders, a strided input. On AMX
    tiles (bf16) each scaled weight is rounded to bf16 first, and the product is taken on those."""
    gen = torch.Generator().manual_seed(rows * 100 + n)
    k = 96
    w = byte_weight("fp8", n, k, gen)
    scale = torch.exp2(torch.randint(-12, 5, (n, k // group), generator=gen).float()) * (
        torch.rand(n, k // group, generator=gen) + 0.5)
    bias = torch.randn(n, generator=gen) if n % 2 else None
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]  # a strided view
    packed = cpu_gemm.PackedFP8Blocks.of(w, scale, group, bias, dtype)
    assert packed is not None and packed.kernel == "gemm_fp8_block"
    weight = w.double() * scale.double().repeat_interleave(group, dim=1)
    if bf16_path:
        weight = weight.to(torch.bfloat16).double()
    want = x.double() @ weight.T
    if bias is not None:
        want = want + bias.double()
    got = packed(x)
    assert_close_to_float64(got, want, rows, n, dtype)


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 GEMM kernel on this CPU")
def test_fp8_block_kernel_refuses_what_it_cannot_take():
    w, scale = torch.zeros(16, 64, dtype=torch.float8_e4m3fn), torch.ones(16, 2)
    assert cpu_gemm.PackedFP8Blocks.of(w, scale, 32, None, torch.float32) is not None
    assert cpu_gemm.PackedFP8Blocks.of(w, scale, 48, None, torch.float32) is None  # 64 inputs: not whole groups
    assert cpu_gemm.PackedFP8Blocks.of(w, scale[:, :1], 32, None, torch.float32) is None  # scales for half
    assert cpu_gemm.PackedFP8Blocks.of(w.view(torch.uint8), scale, 32, None, torch.float32) is None
    assert cpu_gemm.PackedFP8Blocks.of(w, scale, 32, None, torch.float16) is None
    packed = cpu_gemm.PackedFP8Blocks.of(w, scale, 32, None, torch.bfloat16)
    with pytest.raises(cpu_gemm.KernelArgumentError, match=r"gemm_fp8_block: x must have shape \[\*, 64\]"):
        packed(torch.zeros(2, 32, dtype=torch.bfloat16))


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 / MXFP4 GEMM kernel on this CPU")
@pytest.mark.parametrize(("dtype", "bf16_path"), DTYPE_PATHS, indirect=["bf16_path"])
@pytest.mark.parametrize("rows", [0, 1, 4, 7, 64])
@pytest.mark.parametrize("n", [5, 16, 88])
def test_mxfp4_kernel_equals_the_widened_weight(dtype, bf16_path, rows, n):
    """MXFP4 weights widened in registers (in bf16 on AMX, to bf16 pairs for the tiles: exact): all
    16 E2M1 codes in both nibbles, group scales from 2^-20 to 2^10 (biased exponents 107-137) and
    the extremes the kernel takes (0 and 240), against the float64 product of
    ``mxfp4.dequantize``'s weight."""
    from batchgen.model import mxfp4

    gen = torch.Generator().manual_seed(rows * 100 + n)
    k = 96
    blocks = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    blocks[0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # code c in both nibbles
    exponents = torch.randint(107, 138, (n, k // 32), generator=gen, dtype=torch.uint8)
    exponents[-1, 0] = 0
    bias = torch.randn(n, generator=gen) if n % 2 else None
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]  # a strided view
    packed = cpu_gemm.PackedMXFP4.of(blocks, exponents, bias, dtype)
    assert packed is not None
    weight = mxfp4.dequantize(blocks.view(n, k // 32, 16), exponents).view(n, k)
    want = x.double() @ weight.double().T
    if bias is not None:
        want = want + bias.double()
    got = packed(x)
    assert_close_to_float64(got, want, rows, n, dtype)
    exponents[0, 0] = 240
    big = cpu_gemm.PackedMXFP4.of(blocks, exponents, None, torch.float32)
    assert big is not None and torch.isfinite(big(x.float())).all()


@pytest.mark.skipif(not fp8_kernel_runs(), reason="no compiled FP8 / MXFP4 GEMM kernel on this CPU")
def test_mxfp4_kernel_refuses_what_it_cannot_take():
    blocks, exponents = torch.zeros(16, 32, dtype=torch.uint8), torch.full((16, 2), 127, dtype=torch.uint8)
    assert cpu_gemm.PackedMXFP4.of(blocks, exponents, None, torch.float32) is not None
    assert cpu_gemm.PackedMXFP4.of(blocks[:, :24], exponents, None, torch.float32) is None  # 48 inputs
    assert cpu_gemm.PackedMXFP4.of(blocks, exponents[:, :1], None, torch.float32) is None  # scales for half
    assert cpu_gemm.PackedMXFP4.of(blocks, exponents.int(), None, torch.float32) is None
    assert cpu_gemm.PackedMXFP4.of(blocks, exponents.fill_(241), None, torch.float32) is None  # 2^114: overflows
    packed = cpu_gemm.PackedMXFP4.of(blocks, exponents.fill_(127), None, torch.bfloat16)
    with pytest.raises(cpu_gemm.KernelArgumentError, match=r"gemm_mxfp4: x must have shape \[\*, 64\]"):
        packed(torch.zeros(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_are_the_weights_rows(dtype):
    """A tied LM head's packed copy serves the embedding lookup: every row back exactly, in any
    order and repeated, including rows of the last, partial 16-column vector."""
    if cpu_gemm.pack(torch.zeros(16, 8, dtype=dtype)) is None:
        pytest.skip(f"the kernel does not run {dtype} here")
    w = torch.randn(37, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = cpu_gemm.pack(w)
    assert packed is not None
    ids = torch.tensor([36, 0, 17, 17, 35, 1, 15, 16, 32])
    assert torch.equal(packed.rows(ids), w[ids])
    assert packed.rows(torch.arange(37)).dtype == dtype


@pytest.mark.parametrize("backend", ["auto", "onednn", "torch"])
def test_tied_embeddings_are_held_once(tmp_path, backend):
    """A tied model on the kernel keeps the LM head's packed copy alone and looks its tokens up
    there; on the other backends the embedding stays. Greedy tokens equal the torch backend's."""
    from batchgen.tiny import make_model

    path = str(make_model(tmp_path / "tied", "llama", seed=6, tie_word_embeddings=True, vocab_size=515))
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch is built without oneDNN")
    llm = LLM(path, dtype="float32", linear_backend=backend)
    model = llm.engine.runner.model
    on_kernel = model.lm_head.kernel is not None
    assert (model.embed is None) == on_kernel
    if backend == "auto" and cpu_gemm.pack(torch.zeros(16, 8)) is not None:  # the kernel runs float32 here
        assert on_kernel
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 514, 7], [3, 4, 40, 50, 513, 512]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", linear_backend="torch").generate(prompts, greedy)]
    assert got == want
