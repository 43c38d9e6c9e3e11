"""Helpers for job tests: write a config, run ``python -m batchgen job`` in a subprocess, read shards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_job(config: Path, *extra: str, idle_timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m batchgen job CONFIG --no-progress EXTRA`` to the end. It is stopped (and the
    test fails) only after ``idle_timeout`` seconds without progress, i.e. with no change in the
    output directory: a slow or loaded machine makes a job slow, not a failure."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchgen", "job", str(config), "--no-progress", *extra],
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            cwd=config.parent,
        )
        _wait_while_progressing(proc, _output_dir(config), idle_timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def finish_job(proc: subprocess.Popen, out_dir: Path, idle_timeout: float = 300) -> tuple[str, str]:
    """Wait for a job started with pipes to end, for as long as it makes progress in ``out_dir``;
    returns its (stdout, stderr)."""
    _wait_while_progressing(proc, out_dir, idle_timeout)
    return proc.communicate()


def _wait_while_progressing(proc: subprocess.Popen, out_dir: Path | None, idle_timeout: float) -> None:
    """Wait for ``proc`` to end; kill it (and raise TimeoutExpired) after ``idle_timeout`` seconds
    in which ``out_dir`` did not change."""
    last, seen = time.monotonic(), _progress(out_dir)
    while proc.poll() is None:
        time.sleep(0.1)
        now = _progress(out_dir)
        if now != seen:
            last, seen = time.monotonic(), now
        elif time.monotonic() - last > idle_timeout:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, idle_timeout)


def _output_dir(config: Path) -> Path | None:
    try:
        path = yaml.safe_load(config.read_text())["output"]["path"]
    except Exception:  # noqa: BLE001 - a test of a broken config
        return None
    return (config.parent / path) if not Path(path).is_absolute() else Path(path)


def _progress(out_dir: Path | None) -> tuple:
    """What changes while a job works: its output files and their sizes."""
    if out_dir is None or not out_dir.is_dir():
        return ()
    try:
        return tuple(sorted((p.name, p.stat().st_size) for p in out_dir.iterdir()))
    except OSError:
        return ()


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
