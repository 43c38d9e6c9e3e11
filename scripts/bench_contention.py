"""Throughput on shared cores (docs/benchmarks.md, "Shared cores"): batchgen on workloads of
``scripts/bench.py`` with every OpenMP wait policy, on a quiet machine and with one core taken by a
busy loop (``python -c "while 1: pass"``), each run in a fresh process (libgomp reads its wait
policy once, when it loads).

    python scripts/bench_contention.py [D S] [--policies batchgen spin=300000 spin=10000 passive one-thread]
                                       [--prompts N] [--repeat N] [--conditions quiet busy] [--json contention.json]
    python scripts/bench_contention.py D S Z --replicas [--repeat N]

Policies: ``batchgen`` (the engine's defaults: no wait variable set, batchgen chooses), or parts
joined by ``+``: ``spin=N`` (``GOMP_SPINCOUNT=N``; libgomp's own default is 300,000 when
``OMP_WAIT_POLICY`` is unset, and the wait when none is named), ``passive``
(``OMP_WAIT_POLICY=PASSIVE``: sleep at once), ``active`` (spin for good), ``one-thread``
(``num_threads=1``), ``adapt`` (the engine's ``adapt_threads``: fewer threads while other
processes use the CPUs; off unless named). Ratios are each run's tokens/s over the median quiet run of
the first policy, in this invocation. ``--prompts N`` takes each workload's first N prompts.

``--replicas`` instead compares the two layouts of ``run.replicas`` on a quiet 2-core machine: one
engine of 2 threads on all the requests, against 2 engines of one thread, each pinned to its own
CPU with every other request, started together once both are warm (throughput: all their tokens
over the time from the first start to the last end).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (scripts/bench.py: the workloads and the batchgen side)

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_env(policy: str) -> tuple[dict[str, str], int, dict]:
    """The wait variables of ``policy``, its thread count and its engine settings. A policy is
    ``batchgen`` (the engine's defaults) or ``+``-joined parts: ``spin=N``, ``passive``,
    ``active``, ``one-thread``, ``adapt`` (``adapt_threads`` on; off unless named)."""
    if policy == "batchgen":
        return {}, 2, {}
    env, threads, settings = {"GOMP_SPINCOUNT": "300000"}, 2, {"adapt_threads": False}
    for part in policy.split("+"):
        if part == "one-thread":
            threads = 1
        elif part == "adapt":
            settings["adapt_threads"] = True
        elif part in ("passive", "active"):
            env = {"OMP_WAIT_POLICY": part.upper()}
        elif part.startswith("spin="):
            env = {"GOMP_SPINCOUNT": part.split("=", 1)[1]}
        else:
            raise SystemExit(f"unknown policy part {part!r} in {policy!r}")
    return env, threads, settings


def run_one(model: str, w: bench.Workload, policy: str, busy: bool) -> dict:
    env, threads, settings = policy_env(policy)
    saved = {k: os.environ.pop(k, None) for k in WAIT_VARS}
    os.environ.update(env)
    loop = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            r = pool.submit(bench.run_batchgen, model, w, threads, settings).result()
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
        for k in WAIT_VARS:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]
    st = r["stats"]
    return {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"], "wait": st.get("omp_wait_policy"),
            "threads": st.get("num_threads"), "reduced_threads_s": st.get("reduced_threads_s")}


def _replica(model: str, w: bench.Workload, cpus: set[int], barrier, results) -> None:
    os.sched_setaffinity(0, cpus)
    r = bench.run_batchgen(model, w, len(cpus), settings={"adapt_threads": False}, ready=barrier.wait)
    results.put({"start_end": r["start_end"], "generated_tokens": r["generated_tokens"]})


def run_layout(model: str, w: bench.Workload, replicas: int) -> dict:
    """``replicas`` engines (1: one of all the CPUs' threads), each on its share of the CPUs and
    of the requests, timed from the first start to the last end."""
    cpus = sorted(os.sched_getaffinity(0))
    if replicas == 1:
        shares = [set(cpus)]
    else:
        shares = [set(cpus[i::replicas]) for i in range(replicas)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(replicas), ctx.Queue()
    procs = []
    for i, share in enumerate(shares):
        part = bench.Workload(**{**w.__dict__, "prompts": w.prompts[i::replicas], "max_tokens": w.max_tokens[i::replicas]})
        procs.append(ctx.Process(target=_replica, args=(model, part, share, barrier, results)))
        procs[-1].start()
    got = [results.get() for _ in procs]
    for p in procs:
        p.join()
    start = min(g["start_end"][0] for g in got)
    end = max(g["start_end"][1] for g in got)
    tokens = sum(g["generated_tokens"] for g in got)
    return {"tokens_per_s": tokens / (end - start), "wall_s": end - start}


def layouts(args, models: dict[str, str]) -> None:
    results = []
    for w in bench.make_workloads(models["vocab"], [x.upper() for x in args.workloads]):
        model = models["z"] if w.z else models["56m"]
        runs: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.repeat):
            for replicas in (1, 2):
                r = run_layout(model, w, replicas)
                runs[replicas].append(r["tokens_per_s"])
                print(f"  {w.name} {replicas} x {2 // replicas} threads: {r['tokens_per_s']:.1f} tok/s "
                      f"({r['wall_s']:.1f} s)", flush=True)
        one, two = statistics.median(runs[1]), statistics.median(runs[2])
        print(f"| {w.name} | {one:.1f} | {two:.1f} | {two / one:.2f} |", flush=True)
        results.append({"workload": w.name, "runs": {f"{k} replicas": v for k, v in runs.items()}})
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=["D", "S"])
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--policies", nargs="+", default=["spin=300000", "passive", "spin=3000", "one-thread", "adapt", "batchgen"])
    ap.add_argument("--prompts", type=int, default=None, help="each workload's first N prompts")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, alternating policies; medians are reported")
    ap.add_argument("--conditions", nargs="+", default=["quiet", "busy"], choices=["quiet", "busy"])
    ap.add_argument("--json", default="contention.json")
    ap.add_argument("--replicas", action="store_true", help="1 engine x 2 threads against 2 x 1, quiet")
    ap.add_argument("--z-model", default="models/bench-z", help="the model of workload Z")
    args = ap.parse_args()
    from transformers import AutoConfig

    from batchgen.tiny import make_bench_model
    from fixtures.models import make_bench_z_model

    if not (Path(args.model) / "config.json").exists():
        make_bench_model(args.model)
    if "Z" in [x.upper() for x in args.workloads] and not (Path(args.z_model) / "config.json").exists():
        make_bench_z_model(args.z_model)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    if args.replicas:
        return layouts(args, {"vocab": vocab, "56m": args.model, "z": args.z_model})
    results = []
    for w in bench.make_workloads(vocab, [x.upper() for x in args.workloads]):
        if args.prompts:
            w.prompts, w.max_tokens = w.prompts[: args.prompts], w.max_tokens[: args.prompts]
        runs: dict[tuple[str, bool], list[dict]] = {}
        for _ in range(args.repeat):
            for policy in args.policies:
                for busy in [c == "busy" for c in args.conditions]:
                    r = run_one(args.model, w, policy, busy)
                    runs.setdefault((policy, busy), []).append(r)
                    print(f"  {w.name} {policy:<12} {'busy ' if busy else 'quiet'} {r['tokens_per_s']:8.1f} tok/s "
                          f"({r['threads']} threads, {r['wait']}, fewer threads for {r['reduced_threads_s']} s)", flush=True)
        med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
        base = med.get((args.policies[0], False))
        print(f"\n| {w.name}: policy | quiet tok/s | one core busy tok/s | busy / quiet | quiet / {args.policies[0]} quiet "
              f"| busy / {args.policies[0]} quiet |")
        print("| --- | --- | --- | --- | --- | --- |")

        def cell(x: float | None, y: float | None, fmt: str = ".2f") -> str:
            return "-" if x is None or y is None else format(x / y, fmt)

        for p in args.policies:
            q, b = med.get((p, False)), med.get((p, True))
            print(f"| {p} | {'-' if q is None else f'{q:.1f}'} | {'-' if b is None else f'{b:.1f}'} | {cell(b, q)} "
                  f"| {cell(q, base)} | {cell(b, base)} |")
        print(flush=True)
        results.append({"workload": w.name, "prompts": len(w.prompts),
                        "runs": {f"{p}/{'busy' if b else 'quiet'}": [r["tokens_per_s"] for r in v]
                                 for (p, b), v in runs.items()}})
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
