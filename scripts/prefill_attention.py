"""The CPU prefill attention paths on bench-56m's attention shapes (8 query heads over 2 KV heads,
head size 64, blocks of 16), one layer, per chunk shape: torch's path (``TorchAttention._prefill``:
one flash call, or two merged after cached positions), the compiled kernel, and in bfloat16 on a CPU
with AMX the kernel on AMX tiles (``prefill(..., amx=True)``); best of ``--repeat`` calls each.

    python scripts/prefill_attention.py [--dtype bfloat16|float32] [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen.model.attention import CpuAttention, LayerAttention, PrefillChunk, TorchAttention
from batchgen_kernels.cpu_attention import amx_tiles, prefill

# (chunk tokens, context: cached positions + the chunk)
SHAPES = [
    (1, 544),
    (32, 544),
    (32, 64),
    (128, 128),
    (544, 544),
    (2048, 2048),
    (2048, 4096),
    (2048, 8192),
    (2048, 16384),
]


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def time_shape(
    n: int, ctx: int, dtype: torch.dtype, tiles: bool, repeat: int
) -> tuple[float, float, float | None]:
    """ms of one layer's chunk of ``n`` tokens over ``ctx`` positions: torch's path, the kernel, tiles."""
    kvh, heads, dim, bs = 2, 8, 64, 16
    layer = LayerAttention(scale=dim**-0.5)
    blocks = -(-ctx // bs)
    kc = torch.randn(kvh, blocks, bs, dim).to(dtype)
    vc = torch.randn(kvh, blocks, bs, dim).to(dtype)
    q = torch.randn(n, heads, dim).to(dtype)
    table = torch.arange(blocks)
    chunk = PrefillChunk(0, n, ctx, table)
    ref = best_ms(lambda: TorchAttention()._prefill(q, kc, vc, chunk, layer), repeat)
    kernel = best_ms(lambda: prefill(q, kc, vc, table, ctx, layer.scale), repeat)
    amx = best_ms(lambda: prefill(q, kc, vc, table, ctx, layer.scale, amx=True), repeat) if tiles else None
    return ref, kernel, amx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tiles = dtype == torch.bfloat16 and amx_tiles()
    print(f"{args.dtype}, per layer, best of {args.repeat}; AMX tiles: {tiles}")
    print("| chunk | context | torch's path ms | kernel ms | AMX tiles ms |")
    print("| --- | --- | --- | --- | --- |")
    for n, ctx in SHAPES:
        ref, kernel, amx = time_shape(n, ctx, dtype, tiles, args.repeat)
        print(
            f"| {n} | {ctx} | {ref:.3f} | {kernel:.3f} | {'-' if amx is None else f'{amx:.3f}'} |", flush=True
        )
    print(f"the engine takes the tiles up to context x head size {CpuAttention.AMX_PREFILL_MAX_KV}")


if __name__ == "__main__":
    main()
