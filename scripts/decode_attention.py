"""The CPU decode attention kernel's shared-block pass against row by row, on a workload's shapes.

    python scripts/decode_attention.py [--workload R|S] [--n N] [--dtype float32|bfloat16] [--generated 40]
        [--rounds 12] [--from-cache]
    python scripts/decode_attention.py --engine [--dtype ...] [--rounds 3]

Alone: block tables laid out as the engine lays out the n samples of each prompt (the prompt's full
blocks shared, then each sample's own), one cache per layer, all layers called in turn each round
(so that each layer's K/V comes from memory, as in a step), for ``paged_decode``'s three ``share``
modes in alternation; the median ms of the layers' calls per round for each. R: bench-deep's
attention shapes (9 query heads over 3 KV heads, head size 64, 30 layers), 32 prompts of 32-256
tokens, n=4; S: bench-56m's (8 over 2, 8 layers), 16 prompts of 64-256 tokens, n=8. ``--n``: another
number of samples per prompt (n=2: the job benchmark's).

``--from-cache``: also the default mode with every layer's call on the first layer's cache (one
layer's K/V, which stays in L2 / L3 between calls): the kernel's time with K/V from the caches,
against the same calls with K/V from memory. What the first takes over the second is the wait on
memory.

``--engine``: workload R through ``LLM.generate`` on ``models/bench-deep`` (built if missing), in
one engine, alternating ``share="always"`` and the default, timing the decode kernel's calls in each
run (runs after the first hit the prefix cache, so they are all decode).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from batchgen_kernels import cpu_attention

SHAPES = {  # kv heads, heads, head_dim, layers, prompts, prompt lengths, n
    "R": (3, 9, 64, 30, 32, (32, 256), 4),
    "S": (2, 8, 64, 8, 16, (64, 256), 8),
    "P": (2, 8, 64, 8, 1, (512, 512), 64),
}
MODES = ("always", True, False)


def tables_like_the_engine(prompts: np.ndarray, n: int, generated: int, block_size: int):
    tables, ctx, next_block = [], [], 0
    for p in prompts:
        full = int(p) // block_size
        shared = list(range(next_block, next_block + full))
        next_block += full
        for _ in range(n):
            c = int(p) + generated
            own = -(-c // block_size) - full
            tables.append(shared + list(range(next_block, next_block + own)))
            next_block += own
            ctx.append(c)
    width = max(map(len, tables))
    t = torch.zeros((len(tables), width), dtype=torch.int64)
    for i, row in enumerate(tables):
        t[i, : len(row)] = torch.tensor(row)
    return t, torch.tensor(ctx), next_block


def alone(args: argparse.Namespace) -> None:
    kvh, heads, dim, layers, count, (lo, hi), n = SHAPES[args.workload]
    n = args.n or n
    dtype = getattr(torch, args.dtype)
    prompts = np.random.default_rng(0).integers(lo, hi + 1, size=count)
    tables, ctx, blocks = tables_like_the_engine(prompts, n, args.generated, 16)
    caches = [
        (torch.randn(kvh, blocks, 16, dim).to(dtype), torch.randn(kvh, blocks, 16, dim).to(dtype))
        for _ in range(layers)
    ]
    q = torch.randn(len(ctx), heads, dim).to(dtype)
    out = torch.empty_like(q)

    def one_round(share, layer_caches=caches) -> float:
        t0 = time.perf_counter()
        for k, v in layer_caches:
            cpu_attention.paged_decode(q, k, v, tables, ctx, dim**-0.5, out=out, share=share)
        return (time.perf_counter() - t0) * 1e3

    modes = (*MODES, "cached") if args.from_cache else MODES

    def timed(mode) -> float:  # "cached": the default mode, every call on the first layer's cache
        return one_round(True, [caches[0]] * layers) if mode == "cached" else one_round(mode)

    for mode in modes:
        timed(mode)
    runs: dict = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            runs[mode].append(timed(mode))
    per_key = 2 * kvh * dim * caches[0][0].element_size()
    print(
        f"{args.workload} shapes, {args.dtype}, {len(ctx)} rows ({count} prompts x n={n}), {args.generated} "
        f"tokens generated, {layers} layers: {blocks * 16 * per_key * layers / 2**20:.0f} MiB of K/V"
    )
    for mode, label in zip(MODES, ('share="always"', "share=True (default)", "share=False"), strict=True):
        print(f"  {label}: median {statistics.median(runs[mode]):.2f} ms, best {min(runs[mode]):.2f} ms")
    if args.from_cache:
        cached, memory = statistics.median(runs["cached"]), statistics.median(runs[True])
        print(
            f"  share=True, every layer on the first layer's cache (K/V from L2 / L3): median {cached:.2f} ms, "
            f"best {min(runs['cached']):.2f} ms; from memory {memory / cached:.2f}x that"
        )


def engine(args: argparse.Namespace) -> None:
    from bench import make_workloads  # noqa: PLC0415

    from batchgen import LLM, SamplingParams  # noqa: PLC0415

    model = "models/bench-deep"
    if not (Path(model) / "config.json").exists():
        from fixtures.models import make_bench_deep_model  # noqa: PLC0415

        make_bench_deep_model(model)
    w = make_workloads(32000, ["R"])[0]
    llm = LLM(  # bench.py's settings
        model,
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        seed=0,
        num_threads=torch.get_num_threads(),
    )
    backend = llm.engine.runner.backend
    spent = [0.0]

    def timed(share, *a, **k):
        t0 = time.perf_counter()
        result = cpu_attention.paged_decode(*a, share=share, **k)
        spent[0] += time.perf_counter() - t0
        return result

    params = [
        SamplingParams(n=w.n, temperature=w.temperature, top_p=w.top_p, max_tokens=m, ignore_eos=True, seed=i)
        for i, m in enumerate(w.max_tokens)
    ]
    llm.generate(w.prompts, params, use_tqdm=False)  # fills the prefix cache
    runs: dict = {"always": [], True: []}
    for _ in range(args.rounds):
        for mode in runs:
            backend._paged_decode = functools.partial(timed, mode)
            spent[0] = 0.0
            t0 = time.perf_counter()
            llm.generate(w.prompts, params, use_tqdm=False)
            runs[mode].append((time.perf_counter() - t0, spent[0]))
    print(f"workload R in one engine, {args.dtype}, medians of {args.rounds} runs each:")
    for mode, label in (("always", 'share="always"'), (True, "share=True (default)")):
        wall = statistics.median(r[0] for r in runs[mode])
        kernel = statistics.median(r[1] for r in runs[mode])
        print(f"  {label}: run {wall:.2f} s, decode kernel {kernel:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="R", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default: the workload's)")
    ap.add_argument("--generated", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="workload R in the engine instead")
    ap.add_argument(
        "--from-cache", action="store_true", help="also time every layer's call on one layer's cache"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        args.rounds = args.rounds or 3
        engine(args)
    else:
        args.rounds = args.rounds or 12
        alone(args)


if __name__ == "__main__":
    main()
