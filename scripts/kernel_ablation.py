"""What each compiled CPU kernel earns the engine: whole workloads of scripts/bench.py run with
every kernel compiled in, and again with one kernel at a time sent to the library path it replaces
(``BATCHGEN_LIBRARY_KERNELS`` for the elementwise, block, sampling and beam kernels; the engine
settings ``linear_backend=onednn`` for the GEMM and ``attention_backend=torch`` for attention).

    python scripts/kernel_ablation.py [S B D] [--rounds 3] [--dtype float32|bfloat16]
                                      [--kernels rms_norm gemm rotary,kv_write ...] [--json kernel-ablation.json]

Kernels joined by commas are one configuration: all of them on the library path at once (kernels
too light to resolve one by one, measured together).

Each run is a fresh process. A round runs every configuration once, so that the machine's drift
meets all of them, each round starting one configuration later than the last (a place in the round
that drift favours is no configuration's for good); the table gives each configuration's median
over the rounds and the kernel's gain, ``median(all compiled) / median(this kernel on the library)
- 1``. The variant of the compiled kernels is this CPU's best, or ``BATCHGEN_CPU_CAPABILITY``'s
(docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import in_fresh_process, make_workloads, run_batchgen  # noqa: E402

from batchgen_kernels import cpu  # noqa: E402

# kernel -> (engine settings, library path) for the kernels an engine setting switches
SETTINGS = {
    "gemm": ({"linear_backend": "onednn"}, "oneDNN's packed GEMM (linear_backend=onednn)"),
    "attention": ({"attention_backend": "torch"}, "torch's SDPA / flash attention (attention_backend=torch)"),
}


def run(model: str, workload, threads: int, dtype: str, kernel: str | None) -> float:
    """tokens/s with ``kernel`` (a name, or several joined by commas: one configuration) on the library."""
    names = kernel.split(",") if kernel else []
    settings = {k: v for n in names if n in SETTINGS for k, v in SETTINGS[n][0].items()}
    os.environ["BATCHGEN_LIBRARY_KERNELS"] = ",".join(n for n in names if n in cpu.LIBRARY_ALTERNATIVES)
    try:  # the spawned interpreter reads the variable as it starts
        return in_fresh_process(run_batchgen, model, workload, threads, settings, dtype)["tokens_per_s"]
    finally:
        os.environ.pop("BATCHGEN_LIBRARY_KERNELS", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=["S", "B", "D"])
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    # int8_gemm / int4_gemm run only in quantized checkpoints (workload Q measures them), token_mask only under
    # structured outputs (workload J: --kernels token_mask J); docs/kernels.md
    dense = [k for k in cpu.LIBRARY_ALTERNATIVES if k not in ("int8_gemm", "int4_gemm", "token_mask")]
    ap.add_argument("--kernels", nargs="*", default=[*SETTINGS, *dense])
    ap.add_argument("--json", default="kernel-ablation.json")
    args = ap.parse_args()
    unknown = {n for k in args.kernels for n in k.split(",")} - set(SETTINGS) - set(cpu.LIBRARY_ALTERNATIVES)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; one of {[*SETTINGS, *cpu.LIBRARY_ALTERNATIVES]}")
    if not Path(args.model).is_dir():
        from batchgen.tiny import make_bench_model

        make_bench_model(args.model)
    cpu.load()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    configs: list[str | None] = [None, *args.kernels]
    results: dict[str, dict[str, list[float]]] = {}
    for w in make_workloads(vocab, args.workloads):
        runs: dict[str, list[float]] = {str(c): [] for c in configs}
        for r in range(args.rounds):
            # each round starts one configuration later: no configuration keeps the same place
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                runs[str(c)].append(run(args.model, w, args.threads, args.dtype, c))
                print(f"{w.name} round {r + 1}: {c or 'all compiled'}: {runs[str(c)][-1]:.1f} tok/s", flush=True)
        results[w.name] = runs
    base = {w: statistics.median(runs["None"]) for w, runs in results.items()}
    names = list(results)
    print(f"\nvariant {cpu.variant}, {args.dtype}, {args.threads} threads, median of {args.rounds} rounds")
    print("| kernel | library path | " + " | ".join(f"{w} gain" for w in names) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " |")
    print("| (all compiled) | | " + " | ".join(f"{base[w]:.1f} tok/s" for w in names) + " |")
    for k in args.kernels:
        what = "; ".join(SETTINGS[n][1] if n in SETTINGS else cpu.LIBRARY_ALTERNATIVES[n] for n in k.split(","))
        gains = [base[w] / statistics.median(results[w][k]) - 1 for w in names]
        print(f"| {k} | {what} | " + " | ".join(f"{g:+.1%}" for g in gains) + " |")
    Path(args.json).write_text(
        json.dumps({"variant": cpu.variant, "dtype": args.dtype, "rounds": args.rounds, "runs": results}, indent=2)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
