"""Peak memory (RSS) of a job over 10,000 and 100,000 input rows with the same engine settings:
the two peaks should differ by less than 20% (memory is bounded by the rows in flight, not by the
dataset). Each size runs in its own process; the peak comes from ``resource.getrusage``.

    python scripts/job_memory.py [--rows 10000 100000] [--max-tokens 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

CHILD = """
import resource, sys, json
from batchgen.cli import main
rc = main(["job", sys.argv[1], "--no-progress"])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(rc)
"""


def make_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat", "quick", "brown"]
    writer = None
    for start in range(0, n, 10_000):
        rows = [
            {
                "id": i,
                "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 20))),
                "payload": "x" * 200,
            }
            for i in range(start, min(n, start + 10_000))
        ]
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--model", default=None, help="model dir (default: a tiny llama built here)")
    ap.add_argument(
        "--engine-setting", action="append", default=[], metavar="KEY=VALUE", help="extra engine setting"
    )
    args = ap.parse_args()
    extra = dict(item.partition("=")[::2] for item in args.engine_setting)
    tmp = Path(tempfile.mkdtemp(prefix="batchgen-mem-"))
    model = args.model
    if model is None:
        from batchgen.tiny import make_model

        model = str(make_model(tmp / "model", "llama", seed=0))
    results = {}
    for n in args.rows:
        data = tmp / f"rows-{n}.parquet"
        make_rows(data, n)
        cfg = {
            "model": model,
            "engine": {
                "dtype": "float32",
                "max_num_seqs": 256,
                "max_num_batched_tokens": 4096,
                "num_kv_blocks": 2048,
                **extra,
            },
            "input": {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
            "generation": {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True},
            "output": {"path": str(tmp / f"out-{n}"), "rows_per_shard": 5000},
        }
        cfg_path = tmp / f"job-{n}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        res = subprocess.run([sys.executable, "-c", CHILD, str(cfg_path)], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(res.stderr)
        peak_kb = int(
            next(line.split()[1] for line in res.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
        )
        report = json.loads((tmp / f"out-{n}" / ".batchgen" / "report.json").read_text())
        results[n] = {
            "peak_rss_mib": round(peak_kb / 1024, 1),
            "rows_in_output": report["rows_in_output"],
            "wall_s": round(report["wall_s"], 1),
        }
        print(
            f"{n:>8} rows: peak RSS {peak_kb / 1024:8.1f} MiB, {report['rows_in_output']} rows out, "
            f"{report['wall_s']:.1f} s",
            flush=True,
        )
    if len(results) >= 2:
        lo, hi = results[min(results)]["peak_rss_mib"], results[max(results)]["peak_rss_mib"]
        print(f"peak RSS ratio {max(results)} / {min(results)} rows: {hi / lo:.3f} (goal: < 1.20)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
