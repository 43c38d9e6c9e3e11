"""Where an engine step's time goes on the CPU path, on a benchmark workload's own requests and
engine settings (``scripts/bench.py``: S, B, P, D, Z and the rest), measured by the engine's timers
over every step of the run, with the decode-only steps apart.

    python scripts/profile_step.py [S|B|P|D|Z|...] [--model DIR] [--dtype bfloat16] [--skeleton]
        [--attention-backend torch] [--torch-profile 8] [--json profile.json]

Parts of a step: the model forward (less its attention: linear layers, norms, rotary, activations),
attention (KV write and the attention kernels), the LM head, sampling (or the beam step), the rest
of post-processing (token append, stop checks, forks), scheduler + block manager, input building
and block copies, output assembly. "Overhead" is everything outside the model forward and LM head.
Also the minor page faults per decode step (fresh memory the step touched). ``--skeleton`` runs the
workload on its model cut to width 64 (same layers and vocabulary, one head of 64; built beside the
model): a step's cost besides its arithmetic, the Python and call overhead that a faster GEMM leaves.

``--torch-profile N`` also runs N decode-only steps from the middle of the run under
``torch.profiler`` and prints the operators with the most self CPU time, the compiled kernels among
them (``kernel::NAME``: each call to the kernel library recorded as a range while the profiler runs).
Those steps are left out of the engine-timer columns.

With the compiled CPU attention (the default where it builds) it also prints the rate at which the
decode kernel reads K/V over its own time: every row's whole context (shared prefix blocks read once
per row), and the distinct blocks of each call (each shared block once, whole: what must come from
memory), against this machine's memcpy bandwidth (bytes copied per second by ``Tensor.copy_`` of a
256 MiB buffer, same thread count).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import engine_settings, make_workloads, request_params  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.model.attention import CpuAttention  # noqa: E402

PARTS = {  # part: its seconds from two snapshots of LLM.stats()
    "model forward less attention": lambda s: s["forward_s"] - s["attention_s"],
    "attention (KV write, kernels)": lambda s: s["attention_s"],
    "LM head": lambda s: s["lm_head_s"],
    "sampling / beam step": lambda s: s["sampler_s"],
    "post-processing (append, stops, forks)": lambda s: s["postprocess_s"] - s["sampler_s"],
    "scheduler + block manager": lambda s: s["schedule_s"],
    "input building + block copies": lambda s: s["runner_prepare_s"],
    "output assembly": lambda s: s["output_s"],
}
TIMERS = ("forward_s", "attention_s", "lm_head_s", "sampler_s", "postprocess_s", "schedule_s",
          "runner_prepare_s", "output_s", "prefill_tokens", "decode_tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="S", help="a workload of scripts/bench.py (default S)")
    ap.add_argument("--model", help="default: the workload's model (models/bench-56m, models/bench-z, ...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="also profile N decode-only steps with torch.profiler")
    ap.add_argument("--skeleton", action="store_true",
                    help="the workload's model cut to width 64 (its layers and vocabulary, one head of 64): "
                         "what a step costs besides its arithmetic")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    name = args.workload.upper()
    from transformers import AutoConfig

    from batchgen.tiny import make_bench_model, make_bench_moe_model
    from fixtures.models import make_bench_deep_model, make_bench_z_model

    probe = make_workloads(32000, [name])
    if not probe:
        ap.error(f"unknown workload {args.workload!r}")
    w = probe[0]
    model, make = (
        ("models/bench-z", make_bench_z_model) if w.z
        else ("models/bench-deep", make_bench_deep_model) if w.deep
        else ("models/bench-moe", make_bench_moe_model) if w.moe
        else ("models/bench-56m", make_bench_model)
    )
    model = args.model or model
    if not (Path(model) / "config.json").exists():
        print(f"building the bench model in {model} ...", flush=True)
        make(model)
    if args.skeleton:
        model = skeleton_of(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    w = make_workloads(vocab, [name], vocab_deep=vocab, vocab_z=vocab)[0]
    torch.set_num_threads(args.threads)
    if args.torch_profile:
        record_kernel_calls()
    llm = LLM(model, dtype=args.dtype, **engine_settings(w, args.threads, {"attention_backend": args.attention_backend}))
    llm.generate([w.prompts[0][:16]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, as bench.py
    eng = llm.engine
    for i, (prompt, params) in enumerate(zip(w.prompts, request_params(w), strict=True)):
        eng.add_request(str(i), prompt, params)
    eng.reset_stats()
    kernel = watch_decode_kernel(eng.runner.backend)

    def snapshot() -> dict[str, float]:
        s = llm.stats()
        return {k: float(s[k]) for k in TIMERS}

    sums = {"all": dict.fromkeys(PARTS, 0.0), "decode": dict.fromkeys(PARTS, 0.0)}
    wall = {"all": 0.0, "decode": 0.0}
    steps = {"all": 0, "decode": 0}
    tokens = {"all": 0, "decode": 0}  # rows computed: one per decode row, a chunk's tokens
    faults = {"all": 0, "decode": 0}  # minor page faults: fresh memory touched
    profiled = None
    decode_seen, last_decode = 0, False
    while eng.has_unfinished():
        before = snapshot()
        if args.torch_profile and profiled is None and decode_seen >= 8 and last_decode:
            profiled = run_profiled(eng, args.torch_profile)
            continue
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        eng.step()
        seconds = time.perf_counter() - t0
        step_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        after = snapshot()
        delta = {k: after[k] - before[k] for k in TIMERS}
        decode = delta["prefill_tokens"] == 0 and delta["decode_tokens"] > 0
        decode_seen, last_decode = decode_seen + decode, decode
        for kind in ("all", "decode") if decode else ("all",):
            wall[kind] += seconds
            steps[kind] += 1
            tokens[kind] += int(delta["decode_tokens"] + delta["prefill_tokens"])
            faults[kind] += step_faults
            for part, fn in PARTS.items():
                sums[kind][part] += fn(delta)
    report = {
        "workload": name, "model": model, "dtype": args.dtype, "threads": args.threads,
        "steps": steps, "wall_s": wall, "tokens": tokens, "page_faults": faults,
        "parts_s": sums, "torch_profile": profiled,
    }
    print(f"workload {name} ({model}, {args.dtype}, {args.threads} threads): {steps['all']} steps in {wall['all']:.2f} s, "
          f"{steps['decode']} of them decode-only ({tokens['decode'] / max(steps['decode'], 1):.0f} rows each)")
    print("| part | decode step ms (share) | whole run s (share) |")
    print("| --- | --- | --- |")
    for part in [*PARTS, "other (loop, timers)"]:
        cells = []
        for kind in ("decode", "all"):
            sec = sums[kind][part] if part in PARTS else wall[kind] - sum(sums[kind].values())
            scale = 1000 / max(steps[kind], 1) if kind == "decode" else 1
            cells.append(f"{sec * scale:.1f} ({sec / wall[kind]:.1%})" if wall[kind] else "-")
        print(f"| {part} | {cells[0]} | {cells[1]} |")
    step_ms = wall["decode"] * 1000 / max(steps["decode"], 1)
    print(f"| whole step | {step_ms:.1f} | {wall['all']:.2f} |")
    print(f"page faults per decode step: {faults['decode'] / max(steps['decode'], 1):.0f}")
    for kind in ("decode", "all"):
        model_s = sum(sums[kind][p] for p in ("model forward less attention", "attention (KV write, kernels)", "LM head"))
        if wall[kind]:
            label = "decode steps" if kind == "decode" else "whole run"
            print(f"overhead outside the model forward and LM head, {label}: {(wall[kind] - model_s) / wall[kind]:.1%}")
    if kernel["s"]:
        rate = kernel["bytes"] / kernel["s"] / 1e9
        distinct = kernel_distinct_bytes(kernel) / kernel["s"] / 1e9
        copy = memcpy_gb_s()
        report["decode_kernel"] = {"s": kernel["s"], "gb_s": rate, "distinct_gb_s": distinct, "memcpy_gb_s": copy}
        print(
            f"decode attention kernel: {kernel['s']:.2f} s in the run, reads K/V at {rate:.1f} GB/s "
            f"({rate / copy:.0%} of memcpy, {copy:.1f} GB/s copied); distinct blocks {distinct:.1f} GB/s "
            f"({distinct / copy:.0%})"
        )
    if profiled:
        print(f"\ntorch.profiler, {args.torch_profile} decode steps, {profiled['ms_per_step']:.1f} ms per step "
              f"under the profiler; operators by self CPU time:")
        print("| operator | calls per step | self ms per step | share of the step |")
        print("| --- | --- | --- | --- |")
        for op in profiled["ops"][:15]:
            print(f"| {op['name']} | {op['calls']:.0f} | {op['self_ms']:.2f} | {op['self_ms'] / profiled['ms_per_step']:.1%} |")
        print(f"| (outside the recorded operators: Python) | | {profiled['outside_ms']:.2f} | "
              f"{profiled['outside_ms'] / profiled['ms_per_step']:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def run_profiled(eng, n: int) -> dict:
    """``n`` engine steps under ``torch.profiler``: every operator, most self CPU time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        RECORDING[0] = True
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        seconds = time.perf_counter() - t0
        RECORDING[0] = False
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    inside = sum(e.self_cpu_time_total for e in ops) / 1000 / n
    ms = seconds * 1000 / n
    return {
        "ms_per_step": ms,
        "outside_ms": max(ms - inside, 0.0),
        "ops": [{"name": e.key, "calls": e.count / n, "self_ms": e.self_cpu_time_total / 1000 / n} for e in ops],
    }


def skeleton_of(model: str) -> str:
    """``model``'s skeleton beside it (built once): a Llama of its layer count, vocabulary,
    positions and tying, hidden size 64, intermediate 128, one query and one KV head of 64."""
    from transformers import AutoConfig

    from batchgen.tiny import make_model

    path = f"{model.rstrip('/')}-skeleton"
    if not (Path(path) / "config.json").exists():
        c = AutoConfig.from_pretrained(model)
        make_model(path, "llama", seed=0, vocab_size=c.vocab_size, hidden_size=64, intermediate_size=128,
                   num_layers=c.num_hidden_layers, num_heads=1, num_kv_heads=1,
                   max_positions=c.max_position_embeddings, tie_word_embeddings=bool(c.tie_word_embeddings))
    return path


RECORDING = [False]


def record_kernel_calls() -> None:
    """Each function of the compiled kernel library, wrapped to record its calls as
    ``kernel::NAME`` ranges while ``RECORDING[0]`` (before the model is built: the layers bind them)."""
    from torch.profiler import record_function

    from batchgen_kernels import cpu

    if not cpu.available():
        return
    lib = cpu.load()
    for name in cpu.SIGNATURES:
        fn = getattr(lib, name)

        def recorded(*a, _fn=fn, _label=f"kernel::{name}"):
            if not RECORDING[0]:
                return _fn(*a)
            with record_function(_label):
                return _fn(*a)

        setattr(lib, name, recorded)


def watch_decode_kernel(backend) -> dict:
    """Wrap the compiled decode attention to time it and count the K/V bytes of each call."""
    kernel: dict = {"s": 0.0, "bytes": 0, "calls": []}
    if not isinstance(backend, CpuAttention):
        return kernel
    decode = backend._paged_decode

    def timed(q, k_cache, v_cache, tables, context, *rest):
        t1 = time.perf_counter()
        out = decode(q, k_cache, v_cache, tables, context, *rest)
        kernel["s"] += time.perf_counter() - t1
        per_key = 2 * k_cache.shape[0] * k_cache.shape[-1] * k_cache.element_size()  # K and V
        kernel["bytes"] += int(context.sum()) * per_key
        kernel["calls"].append((tables.clone(), context.clone(), k_cache.shape[2], per_key))
        return out

    backend._paged_decode = timed
    return kernel


def kernel_distinct_bytes(kernel: dict) -> int:
    """Bytes of the distinct blocks each call read (a shared block once, whole)."""
    total = 0
    for tables, context, block_size, per_key in kernel["calls"]:
        in_context = torch.arange(tables.shape[1]) < ((context + block_size - 1) // block_size)[:, None]
        total += int(tables[in_context].unique().numel()) * block_size * per_key
    return total


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
