"""``run.replicas``: one local job on several engines, each a sharded worker pinned to its CPUs.

The plan (CPUs per replica) from a fake NUMA tree and quotas; then real jobs, each a process of its
own, as 2 replicas of 1 core: the rows equal one engine's, every row once after a SIGKILL of the
job and a rerun, a SIGTERM saving the finished rows, and a rerun with another replica count refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.job.config import ConfigError
from batchgen.job.local_replicas import Replica, machine_plan, plan_replicas
from tests.job.helpers import read_output, run_job, start_job, write_config

N = 48
TWO_CPUS = len(os.sched_getaffinity(0)) >= 2
needs_two = pytest.mark.skipif(not TWO_CPUS, reason="2 replicas of one core each need 2 CPUs")


def test_auto_is_one_replica_per_numa_node_in_the_mask():
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert plan_replicas("auto", list(range(8)), None, nodes) == [Replica((0, 1, 2, 3), 0), Replica((4, 5, 6, 7), 1)]
    # a quota of 4 CPUs on both nodes: 2 CPUs on each
    assert plan_replicas("auto", list(range(8)), 3.5, nodes) == [Replica((0, 1), 0), Replica((4, 5), 1)]
    # a mask on one node: one replica
    assert plan_replicas("auto", [4, 5, 6], None, nodes) == [Replica((4, 5, 6), 1)]
    assert plan_replicas("auto", [0, 1], None, {}) == [Replica((0, 1), None)]


def test_a_count_splits_the_cpus_node_by_node():
    nodes = {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}  # interleaved numbering, as on many two-socket servers
    assert plan_replicas(2, list(range(8)), None, nodes) == [Replica((0, 2, 4, 6), 0), Replica((1, 3, 5, 7), 1)]
    assert [r.cpus for r in plan_replicas(3, list(range(8)), None, nodes)] == [(0, 2, 4), (6, 1, 3), (5, 7)]
    assert [r.node for r in plan_replicas(3, list(range(8)), None, nodes)] == [0, None, 1]
    with pytest.raises(ConfigError, match="run.replicas: 3 replicas need a CPU each, but this job may use 2"):
        plan_replicas(3, list(range(8)), 1.5, nodes)


@needs_two
def test_the_machine_plan_reads_the_numa_tree(tmp_path, monkeypatch):
    a, b = sorted(os.sched_getaffinity(0))[:2]
    for node, cpu in ((0, a), (1, b)):
        (tmp_path / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"sys/devices/system/node/node{node}/cpulist").write_text(f"{cpu}\n")
    monkeypatch.setenv("BATCHGEN_SYSTEM_ROOT", str(tmp_path))
    assert machine_plan("auto") == [Replica((a,), 0), Replica((b,), 1)]


def make_rows() -> list[dict]:
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    rows = []
    for i in range(N):
        params = [{"n": 2, "temperature": 1.0}, {"temperature": 0.0}, {"beam_width": 2, "max_tokens": 8}][i % 3]
        prompt = " ".join(words[(i * 5 + k) % 8] for k in range(1 + i % 11))
        rows.append({"id": i, "prompt": "" if i == 7 else prompt, "params": json.dumps(params)})
    return rows


def config(tmp: Path, model: str, replicas: int | str, **more) -> Path:
    pq.write_table(pa.Table.from_pylist(make_rows()), tmp / "in.parquet")
    spec = {"path": str(tmp / "in.parquet"), "prompt_column": "prompt", "id_column": "id", "params_column": "params"}
    run = {"replicas": replicas, **more.pop("run", {})}
    return write_config(tmp, model, spec, {"max_tokens": 12, "seed": 1}, run=run, **more)


def by_id(out: Path) -> dict[int, dict]:
    rows = read_output(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a row written twice"
    return {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory, llama_dir) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("one_engine")
    res = run_job(config(tmp, llama_dir, 1, output={"rows_per_shard": 5}))
    assert res.returncode == 0, res.stderr
    return by_id(tmp / "out")


def assert_same_rows(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(N))
    for i, w in want.items():
        g = got[i]
        assert g["error"] == w["error"], i
        if w["error"] is None:
            assert [c["token_ids"] for c in g["completions"]] == [c["token_ids"] for c in w["completions"]], i
            for x, y in zip(g["completions"], w["completions"], strict=True):
                assert x["cumulative_logprob"] == pytest.approx(y["cumulative_logprob"], abs=1e-4)


@needs_two
def test_two_replicas_of_one_core_write_what_one_engine_writes(tmp_path, llama_dir, one_engine):
    res = run_job(config(tmp_path, llama_dir, 2, output={"rows_per_shard": 5}))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    assert_same_rows(by_id(out), one_engine)
    assert {p.name.split("-of-")[0] for p in out.glob("part-*")} == {"part-00000", "part-00001"}
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["rows_ok"] + report["rows_failed"] == N and report["rows_in_output"] == N
    placed = report["engine"]["replicas"]
    assert [len(r["cpus"]) for r in placed] == [1, 1] and placed[0]["cpus"] != placed[1]["cpus"]
    for i in range(2):  # each worker ran one thread, and says why
        worker = json.loads((out / ".batchgen" / f"report-{i:05d}-of-00002.json").read_text())
        assert worker["engine"]["num_threads"] == 1 and worker["engine"]["num_threads_reason"] == "OMP_NUM_THREADS=1"
    assert "batchgen job report" in res.stdout and f"rows in output (failed)      {N} (1)" in res.stdout


@needs_two
def test_another_replica_count_on_the_same_output_is_refused(tmp_path, llama_dir):
    cfg = config(tmp_path, llama_dir, 2, output={"rows_per_shard": 5})
    assert run_job(cfg).returncode == 0
    res = run_job(cfg, "--set", "run.replicas=1")  # the default path: one engine
    assert res.returncode == 2 and "2 workers" in res.stderr, res.stderr
    res = run_job(cfg, "--set", "run.replicas=1", "--set", "run.shard=0/3")  # a worker of a 3-worker job
    assert res.returncode == 2 and "2 workers" in res.stderr, res.stderr
    res = run_job(cfg, "--set", "run.replicas=2")  # the same count: nothing to do, no model loaded
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr
    assert len(read_output(tmp_path / "out")) == N


def _locks_free(out: Path) -> bool:
    for lock in (out / ".batchgen").glob("lock*"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return True


@needs_two
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_job_stopped_after_its_first_shard_resumes_every_row_once(tmp_path, llama_dir, one_engine, sig):
    cfg = config(tmp_path, llama_dir, 2, output={"rows_per_shard": 2})
    out = tmp_path / "out"
    proc = start_job(cfg)
    while proc.poll() is None and not list(out.glob("part-*")):
        pass
    proc.send_signal(sig)
    _, err = proc.communicate()
    if sig == signal.SIGTERM and proc.returncode != 0:
        assert proc.returncode == 128 + sig, err
        assert len(err.strip().splitlines()) == 1 and "rerun the same command to resume" in err, err
    while not _locks_free(out):  # the replicas die with the job (SIGKILL) or save and exit (SIGTERM)
        pass
    partial = len(read_output(out))
    res = run_job(cfg)
    assert res.returncode == 0, res.stderr
    assert 0 < partial
    assert_same_rows(by_id(out), one_engine)
