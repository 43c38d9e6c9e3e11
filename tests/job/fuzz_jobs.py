"""A large fuzz run of the job's row path: the property test's generated datasets
(``tests/job/row_strategies.py``: every input format, random types, arbitrary Unicode, broken JSON
and bytes, invalid parameters, repeated and missing ids) run as real jobs, in this process, on a
tiny model, until at least ``--rows`` input rows have gone through; each job is run again after
every other shard was deleted (a rerun after a crash).

It reports rows in, rows out, rows missing or written twice, error rows grouped by message (quoted
values and numbers folded), and job crashes (a job that raised; goal: 0), with the first crashes'
datasets.

    python -m tests.job.fuzz_jobs --rows 100000 [--seed 0] [--work /tmp/fuzz]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

from batchgen.config import EngineConfig
from batchgen.engine.engine import LLMEngine
from batchgen.tiny import make_model
from tests.job.row_strategies import datasets
from tests.job.test_row_path import ENGINE, run_dataset


def fold(message: str) -> str:
    message = re.sub(r"'[^']*'", "'…'", message)
    message = re.sub(r"\(Expecting[^)]*\)|\(.*?line \d+ column \d+.*?\)", "(…)", message)
    return re.sub(r"\d+", "N", message)[:110]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="input rows to run, at least")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--first-round", type=int, default=0, help="start at this round of 500 datasets")
    args = ap.parse_args()
    import datasets as hf_datasets

    hf_datasets.disable_progress_bars()
    work = Path(args.work or tempfile.mkdtemp(prefix="batchgen-fuzz-"))
    model = str(make_model(work / "model", "llama", seed=0))
    engine = LLMEngine(EngineConfig.from_kwargs(model, **ENGINE))
    totals = collections.Counter()
    formats = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    crashes: dict[str, str] = {}  # kind -> the first traceback and dataset
    crash_kinds: collections.Counter[str] = collections.Counter()
    t0 = time.perf_counter()

    def one(ds) -> None:
        totals["jobs"] += 1
        formats[ds.fmt] += 1
        try:
            rows, expected, _ = run_dataset(ds, work / "job", model, engine, resume=True)
        except Exception as e:  # noqa: BLE001 - what the run is looking for: counted and shown
            totals["crashes"] += 1
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "/batchgen/" in f.filename]
            where = f"{frames[-1].filename.split('/batchgen/')[-1]}:{frames[-1].lineno}" if frames else "?"
            kind = f"{type(e).__name__} at {where}: {str(e)[:160]}"
            if kind not in crashes:
                crashes[kind] = f"{traceback.format_exc()[:4000]}\n{repr(ds)[:2000]}"
            crash_kinds[kind] += 1
            return
        positions = collections.Counter(r["row_index"] for r in rows)
        totals["rows_in"] += expected
        totals["rows_out"] += len(rows)
        totals["missing"] += sum(1 for p in range(expected) if p not in positions)
        totals["twice"] += sum(c - 1 for c in positions.values() if c > 1)
        for r in rows:
            error = r["error"]["message"] if ds.fmt == "openai" and r["error"] else r["error"]
            if error is None:
                totals["ok"] += 1
            else:
                errors[fold(error)] += 1

    round_ = args.first_round
    while totals["rows_in"] < args.rows:
        run = settings(max_examples=500, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(seed(args.seed * 1000 + round_)(given(ds=datasets())(one)))
        run()
        round_ += 1
        print(f"  {totals['jobs']} jobs, {totals['rows_in']} rows, {totals['crashes']} crashes, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    summary = {
        "jobs": totals["jobs"],
        "jobs_by_format": dict(formats),
        "rows_in": totals["rows_in"],
        "rows_out": totals["rows_out"],
        "rows_ok": totals["ok"],
        "rows_missing": totals["missing"],
        "rows_written_twice": totals["twice"],
        "job_crashes": totals["crashes"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary, indent=2))
    print("error rows by message:")
    for message, count in errors.most_common():
        print(f"  {count:7d}  {message}")
    print("job crashes by kind:")
    for kind, count in crash_kinds.most_common():
        print(f"  {count:7d}  {kind}")
    for kind, first in crashes.items():
        print(f"\n--- {kind} ---\n{first}")
    return 0 if not totals["crashes"] and not totals["missing"] and not totals["twice"] else 1


if __name__ == "__main__":
    sys.exit(main())
