"""Where one engine step's time goes on the CPU path, at a batch of 128 decoding sequences
(workload S shape: 16 prompts x n=8 on bench-56m), or of workload B's 64 beams (``--beam-width 4``:
16 prompts, beam search of width 4; the beam step is in "post-processing").

    python scripts/profile_step.py [--model models/bench-56m] [--steps 24] [--dtype bfloat16]
        [--attention-backend torch] [--beam-width 4]

Prints each part's share of the step: the model forward (of which attention: KV write, scores,
softmax), the LM head, sampling, scheduler + block manager, input building, post-processing
(token append, stop checks), output assembly / detokenization. "Overhead" is everything outside
the model forward and LM head.

With the compiled CPU attention (the default where it builds) it also prints the rate at which the
decode kernel reads K/V: every row's whole context (shared prefix blocks are read once per row),
over the kernel's own time, against this machine's memcpy bandwidth (bytes copied per second by
``Tensor.copy_`` of a 256 MiB buffer, same thread count); and the same over the distinct blocks
the kernel reads each call (each shared block once, whole), what must come from memory.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.model.attention import CpuAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    ap.add_argument(
        "--beam-width", type=int, default=0, help="beam search of this width instead of n=8 sampling"
    )
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        from batchgen.tiny import make_bench_model

        make_bench_model(args.model)
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_num_batched_tokens=4096,
        num_threads=args.threads,
        attention_backend=args.attention_backend,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, size=int(n)).tolist() for n in rng.integers(64, 257, size=16)]
    eng = llm.engine
    for i, p in enumerate(prompts):
        params = (
            BeamSearchParams(beam_width=args.beam_width, max_tokens=args.steps + 8, ignore_eos=True)
            if args.beam_width
            else SamplingParams(
                n=8, temperature=0.8, top_p=0.95, max_tokens=args.steps + 8, ignore_eos=True, seed=i
            )
        )
        eng.add_request(str(i), p, params)
    for _ in range(4):  # prefill and the first decode steps
        eng.step()
    running = sum(len(g.live_seqs) for g in eng.scheduler.running)
    eng.reset_stats()
    t = eng.runner.times
    t.copy = t.prepare = t.forward = t.attention = t.lm_head = 0.0
    backend = eng.runner.backend
    kernel = {"s": 0.0, "bytes": 0, "distinct": 0}
    calls = []  # (block table, context, block size, bytes per key) of each call, counted after the steps
    if isinstance(backend, CpuAttention):
        decode = backend._paged_decode

        def timed(q, k_cache, v_cache, tables, context, *rest):
            t1 = time.perf_counter()
            out = decode(q, k_cache, v_cache, tables, context, *rest)
            kernel["s"] += time.perf_counter() - t1
            per_key = 2 * k_cache.shape[0] * k_cache.shape[-1] * k_cache.element_size()  # K and V
            kernel["bytes"] += int(context.sum()) * per_key
            calls.append((tables.clone(), context.clone(), k_cache.shape[2], per_key))
            return out

        backend._paged_decode = timed
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    wall = time.perf_counter() - t0
    for tables, context, block_size, per_key in calls:
        in_context = torch.arange(tables.shape[1]) < ((context + block_size - 1) // block_size)[:, None]
        kernel["distinct"] += int(tables[in_context].unique().numel()) * block_size * per_key
    s = llm.stats()
    parts = {
        "model forward (linear layers, norms, rope)": s["forward_s"] - s["attention_s"],
        "  attention (KV write, block gather, scores, softmax)": s["attention_s"],
        "LM head": s["lm_head_s"],
        "sampling": s["sampler_s"],
        "post-processing (append, stop checks, forks)": s["postprocess_s"] - s["sampler_s"],
        "scheduler + block manager": s["schedule_s"],
        "input building + block copies": s["runner_prepare_s"],
        "output assembly / detokenization": s["output_s"],
    }
    print(f"{running} decoding sequences, {args.steps} steps, {wall / args.steps * 1000:.1f} ms per step")
    print("| part | ms / step | share |")
    print("| --- | --- | --- |")
    for name, sec in parts.items():
        print(f"| {name} | {sec / args.steps * 1000:.1f} | {sec / wall:.1%} |")
    model = s["forward_s"] + s["lm_head_s"]
    print(
        f"| other (loop, timers) | {(wall - sum(parts.values())) / args.steps * 1000:.1f} | "
        f"{(wall - sum(parts.values())) / wall:.1%} |"
    )
    print(f"overhead outside the model forward and LM head: {(wall - model) / wall:.1%} of step time")
    if kernel["s"]:
        rate = kernel["bytes"] / kernel["s"] / 1e9
        distinct = kernel["distinct"] / kernel["s"] / 1e9
        copy = memcpy_gb_s()
        print(
            f"decode attention kernel: {kernel['s'] / args.steps * 1000:.1f} ms / step, reads K/V at {rate:.1f} GB/s; "
            f"memcpy {copy:.1f} GB/s copied; ratio {rate / copy:.0%}"
        )
        print(
            f"  distinct K/V blocks read: {distinct:.1f} GB/s ({kernel['distinct'] / kernel['bytes']:.0%} of the "
            f"per-row bytes), {distinct / copy:.0%} of memcpy"
        )


def memcpy_gb_s(size: int = 256 << 20, repeats: int = 10) -> float:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return size * repeats / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()
