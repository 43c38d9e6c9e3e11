"""The Ray executor against the local one, and the Ray driver's memory.

    python scripts/bench_ray.py throughput [--rows 2000] [--model models/bench-56m]
    python scripts/bench_ray.py memory [--rows 10000 100000]

``throughput``: one dataset (text prompts of 8-96 words through the tokenizer, seeded sampling,
32 new tokens), run three ways in the same run, each a ``python -m batchgen job`` process:

* local: one engine with 2 threads (the local executor);
* ray:   ``run.executor: ray``, 2 replicas x 1 thread, the command starting its own local Ray
         (what a user runs on one machine: Ray's start and the actors' model loading included);
* ray, joined: the same, joining a Ray cluster that is already up (a persistent cluster or a
         KubeRay RayJob: no Ray start, but the actors still start and load the model).

Rows/s are the input rows over the command's wall time; the goal is ray >= 90% of local.

``memory``: the driver's peak RSS (``wait4`` of the driver process, which joins a Ray started by
this script, so that no Ray process counts as its child) for 10,000 and 100,000 rows; goal < 20%
growth. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog fox sat on mat quick brown jumps over lazy river stone light paper".split()


def make_rows(path: Path, n: int, lo: int, hi: int) -> None:
    rng = random.Random(0)
    writer = None
    for start in range(0, n, 10_000):
        rows = [
            {"id": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))}
            for i in range(start, min(n, start + 10_000))
        ]
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def write_config(
    tmp: Path, name: str, model: str, data: Path, generation: dict, engine: dict, ray: dict
) -> Path:
    cfg = {
        "model": model,
        "engine": {"dtype": "float32", **engine},
        "input": {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
        "generation": generation,
        "output": {"path": str(tmp / f"out-{name}"), "rows_per_shard": 5000},
        "ray": ray,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_job(config: Path, *sets: str) -> tuple[float, int, dict]:
    """Wall seconds, the process's peak RSS (KiB) and the saved report."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "batchgen", "job", str(config), "--no-progress"]
    for item in sets:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    out = yaml.safe_load(config.read_text())["output"]["path"]
    report = json.loads((Path(out) / ".batchgen" / "report.json").read_text())
    return wall, usage.ru_maxrss, report


def start_ray() -> str:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray.get_runtime_context().gcs_address


def throughput(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="batchgen-ray-"))
    model = args.model or _tiny(tmp)
    data = tmp / "rows.parquet"
    make_rows(data, args.rows, 8, 96)
    gen = {"n": 1, "temperature": 0.8, "top_p": 0.95, "max_tokens": 32, "ignore_eos": True, "seed": 0}
    engine = {"max_num_seqs": 128, "max_num_batched_tokens": 2048}
    ray_cfg = {"num_replicas": 2, "cpus_per_replica": 1, "batch_rows": args.batch_rows}
    results = {}
    local = write_config(tmp, "local", model, data, gen, engine, ray_cfg)
    wall, _, report = run_job(local)
    results["local (1 engine x 2 threads)"] = (wall, report)
    ray_own = write_config(tmp, "ray", model, data, gen, engine, ray_cfg)
    wall, _, report = run_job(ray_own, "run.executor=ray")
    results["ray (2 replicas x 1 thread, starts Ray)"] = (wall, report)
    address = start_ray()
    ray_join = write_config(tmp, "ray-joined", model, data, gen, engine, ray_cfg)
    wall, _, report = run_job(ray_join, "run.executor=ray", f"ray.address={address}")
    results["ray (2 replicas x 1 thread, joins a running Ray)"] = (wall, report)
    base = args.rows / results["local (1 engine x 2 threads)"][0]
    print(
        f"{args.rows} rows, model {model}, {gen['max_tokens']} new tokens per row, units of {args.batch_rows} rows"
    )
    print(f"{'executor':<50} {'wall s':>7} {'rows/s':>8} {'tok/s':>8} {'vs local':>9}")
    table = {}
    for name, (wall, report) in results.items():
        rate = args.rows / wall
        tokens = report["generated_tokens"] / wall
        table[name] = {"wall_s": round(wall, 2), "rows_per_s": round(rate, 2), "ratio": round(rate / base, 3)}
        print(f"{name:<50} {wall:7.1f} {rate:8.2f} {tokens:8.1f} {rate / base:9.3f}")
        assert report["rows_in_output"] == args.rows, report
    print(json.dumps(table))


def memory(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="batchgen-ray-mem-"))
    model = args.model or _tiny(tmp)
    address = start_ray()
    gen = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
    engine = {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "num_kv_blocks": 2048}
    ray_cfg = {"num_replicas": 2, "cpus_per_replica": 1, "batch_rows": 1000}
    results = {}
    for n in args.rows:
        data = tmp / f"rows-{n}.parquet"
        make_rows(data, n, 3, 20)
        config = write_config(tmp, f"mem-{n}", model, data, gen, engine, ray_cfg)
        wall, peak_kb, report = run_job(config, "run.executor=ray", f"ray.address={address}")
        results[n] = {
            "driver_peak_rss_mib": round(peak_kb / 1024, 1),
            "rows": report["rows_in_output"],
            "wall_s": round(wall, 1),
        }
        print(
            f"{n:>8} rows: driver peak RSS {peak_kb / 1024:8.1f} MiB, {report['rows_in_output']} rows out, {wall:.1f} s"
        )
    if len(results) >= 2:
        lo, hi = results[min(results)]["driver_peak_rss_mib"], results[max(results)]["driver_peak_rss_mib"]
        print(f"driver peak RSS ratio {max(results)} / {min(results)} rows: {hi / lo:.3f} (goal: < 1.20)")
    print(json.dumps(results))


def _tiny(tmp: Path) -> str:
    from batchgen.tiny import make_model

    return str(make_model(tmp / "model", "llama", seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--rows", type=int, default=2000)
    t.add_argument("--batch-rows", type=int, default=250, help="ray.batch_rows")
    t.add_argument("--model", default=None, help="model dir (default: a tiny llama built here)")
    m = sub.add_parser("memory")
    m.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    m.add_argument("--model", default=None)
    args = ap.parse_args()
    throughput(args) if args.what == "throughput" else memory(args)


if __name__ == "__main__":
    main()
