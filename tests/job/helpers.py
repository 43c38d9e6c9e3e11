"""Helpers for job tests: write a config, run ``python -m batchgen job`` in a subprocess, read shards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_job(config: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "batchgen", "job", str(config), "--no-progress", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=config.parent,
    )


def write_config(tmp: Path, model: str, input_spec: dict, generation: dict, name="job.yaml", **more) -> Path:
    cfg = {
        "model": model,
        "engine": {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 256},
        "input": input_spec,
        "generation": generation,
        "output": {"path": str(tmp / "out"), **more.pop("output", {})},
        **more,
    }
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_output(out: Path) -> list[dict]:
    rows = []
    for shard in sorted(out.glob("part-*.parquet")):
        rows.extend(pq.read_table(shard).to_pylist())
    return rows
