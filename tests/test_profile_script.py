"""``scripts/profile_step.py``, run as a user runs it, on a small model: its parts account for the
steps' time without counting any twice, its decode steps are those of the workload, and the
compiled kernels show in the torch profiler's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchgen_kernels import cpu

ROOT = Path(__file__).resolve().parent.parent


def test_profile_of_workload_p(head64_dir, tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run(
        [sys.executable, "scripts/profile_step.py", "P", "--model", head64_dir, "--torch-profile", "2",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    steps, wall, parts = r["steps"], r["wall_s"], r["parts_s"]
    # P: 64 prompts on one prefix, 32 greedy tokens each; the decode steps run the 64 rows together
    # (a prompt that waits a step for its shared block starts one step late), and the two profiled
    # steps are left out of the columns
    assert steps["decode"] >= 25
    assert 62 * steps["decode"] <= r["tokens"]["decode"] <= 64 * steps["decode"]
    assert steps["all"] - steps["decode"] >= 1  # the prompts' steps
    for kind in ("all", "decode"):
        assert all(v >= 0 for v in parts[kind].values()), parts[kind]
        assert 0.5 * wall[kind] < sum(parts[kind].values()) <= wall[kind] * 1.001
    assert "| whole step |" in done.stdout and "page faults per decode step" in done.stdout
    names = {op["name"] for op in r["torch_profile"]["ops"]}
    if cpu.available():
        assert {"kernel::gemm_f32", "kernel::greedy_pick"} <= names, names
