"""``python -m batchgen demo``, the README's first command, from an empty directory: it builds its
model and data, and its report shows the engine at work (prefix-cache hits on the shared few-shot
header, KV saved by sharing, copy-on-write copies); the beam rows (a per-row override in a sampling
job) equal ``LLM.generate`` with the same beam search; the empty prompts are error rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.dataset as pads

from batchgen import LLM, BeamSearchParams
from tests.job.helpers import ROOT


def test_demo_shows_sharing_caching_and_beams(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-m", "batchgen", "demo"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "out/demo/.batchgen/report.json").read_text())
    assert report["rows_ok"] == 60 and report["rows_failed"] == 4 and report["errors"] == {"prompt is empty": 4}
    assert report["prefix_cache_hit_rate"] > 0.5 and report["kv_saved_by_sharing"] > 0.3, report
    assert report["engine"]["cow_copies"] > 0
    for needle in ("prefix-cache hit rate", "KV memory saved by sharing", "copy-on-write block copies",
                   "(beam search, width 3)", "error: prompt is empty"):
        assert needle in res.stdout, res.stdout
    rows = {r["id"]: r for r in pads.dataset(tmp_path / "out/demo", format="parquet").to_table().to_pylist()}
    assert len(rows) == 64
    beams = [r for r in rows.values() if r["params"] and not r["error"]]
    sampled = [r for r in rows.values() if not r["params"] and not r["error"]]
    assert len(beams) == 8 and len(sampled) == 52
    assert all(len(r["completions"]) == 4 and r["completions"][0]["score"] is None for r in sampled)
    llm = LLM(str(tmp_path / "models/demo"), dtype="float32", num_kv_blocks=256)
    want = llm.generate([beams[0]["prompt"]], BeamSearchParams(beam_width=3, max_tokens=32))[0].outputs
    got = beams[0]["completions"]
    assert [c["token_ids"] for c in got] == [c.token_ids for c in want]
    assert all(abs(c["score"] - w.score) < 1e-5 for c, w in zip(got, want, strict=True))
