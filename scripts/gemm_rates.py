"""GEMM rates of the CPU linear backends by row count: the compiled kernel ("cpu"), oneDNN's packed
GEMM ("onednn") and ``F.linear`` ("torch"), through ``batchgen.model.linear.Linear`` as the engine
calls them, on the [N, K] shapes of the bench models: bench-56m's fused qkv (also bench-moe's
experts' gate/up), gate/up, down and LM head, bench-moe's experts' down, bench-deep's qkv.

    python scripts/gemm_rates.py [--dtype float32|bfloat16] [--threads 2] [--rows 1 8 32 ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen.model.linear import Linear

SHAPES = [(768, 512), (3072, 512), (512, 1536), (32000, 512), (512, 384), (960, 576)]


def gflops(layer: Linear, x: torch.Tensor, n: int) -> float:
    for _ in range(3):
        layer(x)
    best = float("inf")
    for _ in range(5):
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            layer(x)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * x.shape[0] * n * x.shape[1] / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    ap.add_argument("--backends", nargs="+", default=["cpu", "onednn", "torch"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    print(f"GFLOP/s, {args.dtype}, {args.threads} threads")
    print("| N x K | rows | " + " | ".join(args.backends) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.backends) + " |")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dt)
        layers = {}
        for b in args.backends:
            try:
                layers[b] = Linear(w, backends=[b], strict=b != "torch")
            except ValueError:
                layers[b] = None
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dt)
            rates = [f"{gflops(layer, x, n):.0f}" if layer else "-" for layer in layers.values()]
            print(f"| {n} x {k} | {m} | " + " | ".join(rates) + " |", flush=True)


if __name__ == "__main__":
    main()
