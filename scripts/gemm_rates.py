"""GEMM rates of the CPU linear backends by row count: the compiled kernel ("cpu"), oneDNN's packed
GEMM ("onednn") and ``F.linear`` ("torch"), through ``batchgen.model.linear.Linear`` as the engine
calls them, on the [N, K] shapes of the bench models: bench-56m's fused qkv (also bench-moe's
experts' gate/up), gate/up, down and LM head, bench-moe's experts' down, bench-deep's qkv.

    python scripts/gemm_rates.py [--dtype float32|bfloat16] [--threads 2] [--rows 1 8 32 ...] [--fused] [--cold]

``--cold`` calls each backend on distinct copies of the weight in turn, 256 MB of them, so that every
call reads its weight from memory as the engine's steps do (a model's layers together outgrow the
caches; the default repeats one weight, which then stays in L2 / L3).

In bfloat16 on a CPU with AMX the kernel runs on AMX tiles (``batchgen_kernels.cpu_gemm.amx``); ``--no-amx``
times its dot-instruction path instead.

``--peak`` first measures the float32 FMA peak of the threads (a loop of independent vector FMAs,
built here with the kernels' compiler, ``batchgen_kernels.cpu.compiler``, at -O3 -march=native) and gives
each float32 rate as a share of it.

``--quant`` times instead bench-deep's four projections (960 x 576, 576 x 576, 3072 x 576, 576 x
1536) of 30 layers, one pass through all 120 as a decode step makes it, in ms (medians of
``--rounds``), for the bf16 kernel and the quantized paths a checkpoint's layers take here
(``QuantLinear``: int4 symmetric and with zero points in groups of 64, int8 weight-only, W8A8, FP8
per row, FP8 in 128 x 128 blocks), with random codes; each path's name as ``stats()`` gives it.

``--fused`` times instead what the kernel folds into a GEMM's pass, in ms per call with the
engine's allocator setting: bench-56m's gate/up GEMM then the SwiGLU kernel against the gated GEMM
(``Linear.silu_mul``), and the LM head then ``.float()`` against the widened GEMM
(``Linear.widened``, bf16 only).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from batchgen.model.linear import Linear
from batchgen.model.malloc import keep_freed_memory

SHAPES = [(768, 512), (3072, 512), (512, 1536), (32000, 512), (512, 384), (960, 576)]


COLD_BYTES = 256 << 20  # --cold: distinct copies of each weight, together well past the L3 cache


def gflops(layers: list[Linear], x: torch.Tensor, n: int) -> float:
    """The best of five rounds, each 10 calls or one call of every layer (``--cold``)."""
    seq = layers if len(layers) > 1 else layers * 10
    for layer in seq[:3]:
        layer(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for layer in seq:
            layer(x)
        best = min(best, (time.perf_counter() - t0) / len(seq))
    return 2 * x.shape[0] * n * x.shape[1] / best / 1e9


def ms_per_call(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


PEAK_LOOP = r"""
#include <omp.h>
#include <cstdio>
#include <cstdlib>
typedef float v16 __attribute__((vector_size(64)));
#ifdef __AVX512F__
#define ACC 12 /* 12 zmm accumulators: more than the FMA latency x ports */
#else
#define ACC 5 /* 10 ymm: AVX2 has 16 registers */
#endif
int main(int argc, char** argv) {
  const int threads = atoi(argv[1]);
  const long iters = 20000000;
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    float sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      v16 a[ACC], b = {}, c = {};
      for (int i = 0; i < ACC; ++i) a[i] = b + (float)(i + omp_get_thread_num());
      b += 1.0000001f;
      c += 1e-7f;
      for (long it = 0; it < iters; ++it)
        for (int i = 0; i < ACC; ++i) a[i] = a[i] * b + c; /* contracted to one FMA */
      for (int i = 0; i < ACC; ++i) sink += a[i][0];
    }
    const double rate = 2.0 * 16 * ACC * iters * threads / (omp_get_wtime() - t0) / 1e9;
    if (rate > best) best = rate;
    if (sink == 1.0f) std::puts("");  // the sums are used: the loop is not optimized away
  }
  printf("%f\n", best);
  return 0;
}
"""


def fma_peak(threads: int) -> float:
    """GFLOP/s of ``threads`` threads doing nothing but independent float32 vector FMAs."""
    from batchgen_kernels.cpu import compiler  # noqa: PLC0415

    cxx = compiler()
    if cxx is None:
        raise SystemExit("--peak needs a C++ compiler on PATH (g++, c++ or clang++; or set CXX)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(PEAK_LOOP)
        cc = [cxx, "-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", str(src), "-o", str(exe)]
        subprocess.run(cc, check=True)
        return float(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout)


def fused(dt: torch.dtype, rows: list[int]) -> None:
    from batchgen_kernels import cpu_ops  # noqa: PLC0415

    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 512, generator=gen) * 0.05).to(dt)
    plain, gated = (
        Linear(w, backends=["cpu"], strict=True),
        Linear(w, backends=["cpu"], strict=True, gated=True),
    )
    head = Linear((torch.randn(32000, 512, generator=gen) * 0.05).to(dt), backends=["cpu"], strict=True)
    print(f"ms per call, {dt}")
    print("| rows | gate/up GEMM + silu_mul | gated GEMM | LM head + .float() | widened LM head |")
    print("| --- | --- | --- | --- | --- |")
    for m in rows:
        x = torch.randn(m, 512, generator=gen).to(dt)
        cells = [
            ms_per_call(lambda x=x: cpu_ops.silu_mul(plain(x))),
            ms_per_call(lambda x=x: gated.silu_mul(x)),
        ]
        if dt == torch.bfloat16:
            cells += [
                ms_per_call(lambda x=x: head(x).float(), 5),
                ms_per_call(lambda x=x: head.widened(x), 5),
            ]
        print(
            f"| {m} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + " |"
            + ("" if len(cells) > 2 else " - | - |")
        )


DEEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # bench-deep's qkv, o, gate/up, down
DEEP_LAYERS = 30


def quant_layers(fmt: str, gen: torch.Generator) -> list:
    """bench-deep's 120 projections in ``fmt`` ("bf16" or a quantized format), random values."""
    from batchgen.model.quant import QuantLinear, QWeight  # noqa: PLC0415

    layers: list = []
    for _ in range(DEEP_LAYERS):
        for n, k in DEEP_SHAPES:
            if fmt == "bf16":
                layers.append(Linear((torch.randn(n, k, generator=gen) * 0.05).bfloat16(), backends=["cpu"],
                                     strict=True))
                continue
            if fmt.startswith("int4"):
                q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
                scale = torch.rand(n, k // 64, generator=gen) * 0.01 + 0.001
                zero = torch.full_like(scale, 8.0) if fmt == "int4-sym" else torch.randint(
                    0, 16, scale.shape, generator=gen).float()
                qw = QWeight("int", 4, q, scale, zero, 64)
            elif fmt in ("int8", "w8a8"):
                q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
                qw = QWeight("int", 8, q, torch.rand(n, 1, generator=gen) * 0.001, None, k,
                             activations="int8-token" if fmt == "w8a8" else None)
            else:  # fp8 per row, fp8-block per 128 x 128
                q = (torch.randn(n, k, generator=gen) * 0.05).to(torch.float8_e4m3fn)
                # blocks of 128 inputs; where the last is partial (576 inputs), the scales apply per 64,
                # as the loader gives them
                group = k if fmt == "fp8" else 128 if k % 128 == 0 else 64
                qw = QWeight("fp8", 8, q, torch.rand(n, k // group, generator=gen) + 0.5, None, group)
            layers.append(QuantLinear(qw, None, torch.device("cpu"), torch.bfloat16))
    return layers


def quant(rows: list[int], rounds: int, formats: list[str]) -> None:
    from batchgen.model.quant import path_counts  # noqa: PLC0415

    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    sides = {fmt: quant_layers(fmt, gen) for fmt in ["bf16", *formats]}
    names = {fmt: ", ".join(path_counts(ls)) if fmt != "bf16" else "bf16 kernel" for fmt, ls in sides.items()}
    print(f"ms per pass through bench-deep's {len(sides['bf16'])} projections, bfloat16, medians of {rounds}")
    print("| rows | " + " | ".join(f"{f} ({names[f]})" for f in sides) + " |")
    print("| --- | " + " | ".join("---" for _ in sides) + " |")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in DEEP_SHAPES}}
        times: dict[str, list[float]] = {f: [] for f in sides}
        for _ in range(rounds):
            for fmt, layers in sides.items():  # the sides alternate: drift falls on all of them
                for layer in layers[:4]:
                    layer(xs[layer.in_features])
                t0 = time.perf_counter()
                for layer in layers:
                    layer(xs[layer.in_features])
                times[fmt].append((time.perf_counter() - t0) * 1e3)
        med = {f: sorted(t)[len(t) // 2] for f, t in times.items()}
        cells = [f"{med['bf16']:.2f}"] + [f"{med[f]:.2f} ({med['bf16'] / med[f]:.2f}x)" for f in formats]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    ap.add_argument("--backends", nargs="+", default=["cpu", "onednn", "torch"])
    ap.add_argument("--fused", action="store_true", help="time the GEMM kernel's fused passes instead")
    ap.add_argument("--quant", nargs="*", metavar="FORMAT",
                    choices=["int4-sym", "int4-zero", "int8", "w8a8", "fp8", "fp8-block"],
                    help="time bench-deep's projections in bf16 and these quantized formats instead (none: all)")
    ap.add_argument("--rounds", type=int, default=7, help="--quant: rounds, the sides alternating")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="weights from memory, as in a model's step: each call on another of 256 MB of copies",
    )
    ap.add_argument("--peak", action="store_true", help="also each float32 rate as a share of the FMA peak")
    ap.add_argument("--no-amx", action="store_true", help="the kernel's bf16 on its dot instruction, not AMX tiles")
    args = ap.parse_args()
    if args.no_amx:
        from batchgen_kernels import cpu_gemm

        cpu_gemm.amx(False)
    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    if args.fused:
        fused(dt, args.rows)
        return
    if args.quant is not None:
        quant(args.rows, args.rounds, args.quant or ["int4-sym", "int4-zero", "int8", "w8a8", "fp8", "fp8-block"])
        return
    peak = fma_peak(args.threads) if args.peak else None
    if peak:
        print(f"float32 FMA peak of {args.threads} threads: {peak:.0f} GFLOP/s")
    print(
        f"GFLOP/s, {args.dtype}, {args.threads} threads"
        + (", weights from memory" if args.cold else "")
        + (", the kernel's bf16 off AMX tiles" if args.no_amx else "")
    )
    print("| N x K | rows | " + " | ".join(args.backends) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.backends) + " |")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        copies = max(2, COLD_BYTES // (n * k * dt.itemsize)) if args.cold else 1
        ws = [(torch.randn(n, k, generator=gen) * 0.05).to(dt) for _ in range(copies)]
        layers: dict[str, list[Linear] | None] = {}
        for b in args.backends:
            try:
                layers[b] = [Linear(w, backends=[b], strict=b != "torch") for w in ws]
            except ValueError:
                layers[b] = None
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dt)
            rates = []
            for group in layers.values():
                rate = gflops(group, x, n) if group else None
                share = f" ({rate / peak:.0%})" if rate and peak and dt == torch.float32 else ""
                rates.append(f"{rate:.0f}{share}" if rate else "-")
            print(f"| {n} x {k} | {m} | " + " | ".join(rates) + " |", flush=True)


if __name__ == "__main__":
    main()
