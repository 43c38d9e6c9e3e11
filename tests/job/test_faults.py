"""A job under faults, tried as a user would: real jobs, each a process of its own, on a tiny model.

SIGTERM / SIGINT mid-job (finished rows flushed, one line, exit 128 + signal, resumable), a full
disk and a read-only output directory (a small tmpfs), an input truncated while the job reads it,
two jobs on one output directory (and the workers of a sharded job sharing one), and the rerun of
a finished job (its manifest stays true).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.job.helpers import (
    ROOT,
    CliProcess,
    finish_job,
    read_output,
    rows_done,
    run_job,
    start_job,
    write_config,
)

GEN = {"n": 2, "temperature": 1.0, "max_tokens": 24, "seed": 3, "ignore_eos": True}
SLOW = {"engine": {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256}}


def make_rows(n: int) -> list[dict]:
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    return [{"id": i, "prompt": " ".join(words[(i * 7 + k) % 8] for k in range(1 + i % 13))} for i in range(n)]


def parquet_input(tmp: Path, n: int) -> dict:
    path = tmp / "in.parquet"
    pq.write_table(pa.Table.from_pylist(make_rows(n)), path)
    return {"path": str(path), "prompt_column": "prompt", "id_column": "id"}


def wait_until(predicate, proc: CliProcess | None = None, what: str = "") -> None:
    """Wait for ``predicate`` as long as the job is alive: a slow machine makes this slow, not red."""
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{err}")
        time.sleep(0.05)


def engine_running(out: Path, manifest: str = ".batchgen/manifest.json"):
    """The manifest is written once the model has loaded: from then on rows flow."""
    return lambda: (out / manifest).exists()


def shard_rows_on_disk(out: Path) -> dict[str, int]:
    return {p.name: pq.ParquetFile(p).metadata.num_rows for p in sorted(out.glob("part-*.parquet"))}


def assert_every_id_once(out: Path, n: int) -> list[dict]:
    rows = read_output(out)
    ids = sorted(r["id"] for r in rows)
    assert ids == list(range(n)), f"{len(ids)} rows for {n} ids; duplicated or missing"
    return rows


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_finished_rows_and_exits_with_one_line(tmp_path, llama_dir, sig):
    n = 300
    # shards would otherwise be written only every 1,000 rows or 60 s: nothing before the signal
    config = write_config(
        tmp_path, llama_dir, parquet_input(tmp_path, n), GEN,
        output={"rows_per_shard": 1000, "flush_seconds": 3600}, **SLOW,
    )
    proc = start_job(config, progress_lines=True)
    out = tmp_path / "out"
    wait_until(lambda: rows_done(proc) > 0, proc, "a row finished")  # the job's own progress line
    assert not list(out.glob("part-*")), "a shard was written before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    saved = len(read_output(out))
    assert 0 < saved < n
    assert f"interrupted by {sig.name}: {saved} rows saved" in err and "rerun the same command to resume" in err
    # it stopped where it was: the rows in flight were dropped, not run to their end
    assert re.search(r"\(([1-9]\d*) unfinished dropped\)", err), err
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    assert manifest["shards"] == shard_rows_on_disk(out)

    res = run_job(config)
    assert res.returncode == 0, res.stderr
    assert f"resumed: {saved} rows were already done" in res.stdout
    assert_every_id_once(out, n)


def test_a_second_signal_exits_at_once_and_the_job_still_resumes(tmp_path, llama_dir):
    n = 200
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, n), GEN,
                          output={"rows_per_shard": 7, "flush_seconds": 0.5}, **SLOW)
    proc = start_job(config)
    out = tmp_path / "out"
    wait_until(engine_running(out), proc, "the model loaded")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    assert_every_id_once(out, n)


def test_a_signal_as_rows_start_to_flow_stops_the_reader_and_writer_threads(tmp_path, llama_dir):
    """SIGTERM the moment the model has loaded, in this process: ``run`` raises ``JobInterrupted``
    only after its reader and writer threads have ended. A thread left inside pyarrow or the
    tokenizer while the interpreter exits aborts the process (SIGABRT) instead of exiting 143."""
    import threading

    from batchgen.job.lifecycle import JobInterrupted
    from batchgen.job.preflight import load_job_config
    from batchgen.job.runner import JobRunner

    n = 2000  # far more than one engine-full: the job is still running when the signal comes
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, n), GEN,
                          output={"rows_per_shard": 7, "flush_seconds": 0.5}, run={"progress": False}, **SLOW)
    out = tmp_path / "out"
    loaded = engine_running(out)

    def signal_once_loaded() -> None:
        wait_until(loaded)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_once_loaded, daemon=True)
    sender.start()
    with pytest.raises(JobInterrupted) as stopped:
        JobRunner(load_job_config(config)).run()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    left = [t.name for t in threading.enumerate() if t.name.startswith("batchgen-")]
    assert not left, f"threads still running after the job returned: {left}"
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    assert manifest["shards"] == shard_rows_on_disk(out)
    assert 0 <= len(read_output(out)) < n


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here: {res.stderr.decode().strip()}")


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs for the output directory (needs root, which CI and the dev machines have)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    path = tmp_path / "fs"
    _mount_tmpfs(path, "96k")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_fails_with_one_line_and_the_next_run_completes(tmp_path, llama_dir, tmpfs):
    n = 120
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, n), GEN,
                          output={"path": str(tmpfs / "out"), "rows_per_shard": 4})
    res = run_job(config)
    out = tmpfs / "out"
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"error: cannot write {out}/" in res.stderr and "No space left on device" in res.stderr
    # the manifest lists only shards that are on disk (the shards are what resume trusts)
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    on_disk = shard_rows_on_disk(out)
    assert 0 < len(on_disk) < n / 4
    assert manifest["shards"].items() <= on_disk.items()
    assert not list(out.rglob(".*.tmp")), "a failed write left its temp file"
    # room again; what a crash mid-write would leave behind is cleaned by the next run
    subprocess.run(["mount", "-o", "remount,size=16m", str(tmpfs)], check=True)
    (out / ".part-000999.parquet.tmp").write_bytes(b"x")
    (out / ".batchgen" / ".manifest.json.tmp").write_bytes(b"x")
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    assert_every_id_once(out, n)
    assert not list(out.rglob(".*.tmp"))
    assert json.loads((out / ".batchgen" / "manifest.json").read_text())["shards"] == shard_rows_on_disk(out)


def test_a_read_only_output_fails_with_one_line(tmp_path, llama_dir, tmpfs):
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, 8), GEN,
                          output={"path": str(tmpfs / "out")})
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    res = run_job(config)
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Read-only file system" in res.stderr, res.stderr
    assert str(tmpfs / "out") in res.stderr


def test_an_input_truncated_mid_run_fails_clearly_and_a_rerun_completes(tmp_path, llama_dir):
    n = 400
    rows = make_rows(n)
    data = tmp_path / "in.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    data.write_text(text)
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id", "batch_rows": 16}
    config = write_config(tmp_path, llama_dir, spec, GEN, output={"rows_per_shard": 10, "flush_seconds": 0.5},
                          **SLOW)
    proc = start_job(config)
    out = tmp_path / "out"
    wait_until(engine_running(out), proc, "the model loaded")
    with open(data, "r+") as f:  # cut it mid-line, as a copy still in progress would
        f.truncate(len(text) // 3 + 5)
    _, err = finish_job(proc, out)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and f"input file {data} changed while the job was reading it" in err, err
    written = read_output(out)
    assert all(r["error"] is None for r in written), "a row of the changing input reached the output"
    assert len({r["id"] for r in written}) == len(written)

    data.write_text(text)  # the input restored
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    rows_out = assert_every_id_once(out, n)
    assert all(r["error"] is None for r in rows_out)


def test_rows_without_an_id_are_known_by_their_position(tmp_path, llama_dir):
    """Malformed JSONL lines get an error row carrying their input position; a rerun skips them."""
    lines = [json.dumps({"id": 0, "prompt": "the cat"}), "{not json", json.dumps({"id": 2, "prompt": "a dog"}), "[1, 2"]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                          GEN)
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    rows = read_output(tmp_path / "out")
    bad = sorted((r["row_index"], r["error"]) for r in rows if r["error"])
    assert [pos for pos, _ in bad] == [1, 3] and all("invalid JSON" in e for _, e in bad), bad
    again = run_job(config)
    assert again.returncode == 0 and "resumed: 4 rows were already done" in again.stdout
    assert len(read_output(tmp_path / "out")) == 4


def test_a_second_job_on_the_same_output_is_refused(tmp_path, llama_dir):
    n = 400  # enough rows that the first job is still writing when the second one starts
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, n), GEN,
                          output={"rows_per_shard": 5, "flush_seconds": 0.5}, **SLOW)
    first = start_job(config)
    out = tmp_path / "out"
    wait_until(engine_running(out), first, "the model loaded")
    second = run_job(config)
    assert second.returncode == 2, second.stderr
    assert "another batchgen job is writing to this output directory" in second.stderr
    assert f"locked by pid {first.pid}" in second.stderr
    _, err = finish_job(first, out)
    assert first.returncode == 0, err
    assert_every_id_once(out, n)


def test_workers_of_a_sharded_job_share_a_directory_but_not_an_index(tmp_path, llama_dir):
    n = 160
    spec = parquet_input(tmp_path, n)
    # two workers on one machine: a thread each, as two OpenMP pools on the same cores slow each other
    engine = {**SLOW["engine"], "num_threads": 1}
    config = write_config(tmp_path, llama_dir, spec, GEN, output={"rows_per_shard": 4, "flush_seconds": 0.5}, engine=engine)
    out = tmp_path / "out"
    workers = [start_job(config, "--set", f"run.shard={i}/2") for i in range(2)]
    wait_until(engine_running(out, ".batchgen/manifest-00000-of-00002.json"), workers[0], "worker 0 loaded")
    same = run_job(config, "--set", "run.shard=0/2")
    assert same.returncode == 2 and "another worker of shard 0/2 is running" in same.stderr, same.stderr
    whole = run_job(config)
    assert whole.returncode == 2 and "another batchgen job is writing to this output directory" in whole.stderr, whole.stderr
    for w in workers:
        _, err = finish_job(w, out)
        assert w.returncode == 0, err
    assert_every_id_once(out, n)
    for i in range(2):
        manifest = json.loads((out / ".batchgen" / f"manifest-{i:05d}-of-00002.json").read_text())
        assert sum(manifest["shards"].values()) == n // 2
        assert all(name.startswith(f"part-{i:05d}-of-00002-") for name in manifest["shards"])


def test_the_rerun_of_a_finished_job_keeps_its_manifest_and_report(tmp_path, llama_dir):
    config = write_config(tmp_path, llama_dir, parquet_input(tmp_path, 12), GEN, output={"rows_per_shard": 5})
    assert run_job(config).returncode == 0
    out = tmp_path / "out"
    before = json.loads((out / ".batchgen" / "manifest.json").read_text())["shards"]
    report = (out / ".batchgen" / "report.json").read_text()
    assert before == shard_rows_on_disk(out) and sum(before.values()) == 12
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    assert "nothing to do: all rows are in the output (resumed: 12 rows were already done)" in res.stdout
    assert json.loads((out / ".batchgen" / "manifest.json").read_text())["shards"] == before
    assert (out / ".batchgen" / "report.json").read_text() == report, "the real run's report was replaced"


def test_an_engine_error_on_one_request_becomes_that_rows_error(tmp_path, llama_dir, monkeypatch):
    """If the engine gives up on one request (here: validation bypassed for a prompt that can never
    fit the pool), that row gets an error and the job goes on."""
    from batchgen.engine.engine import LLMEngine
    from batchgen.job.preflight import load_job_config
    from batchgen.job.runner import JobRunner

    rows = [{"id": 0, "prompt": "the cat"}, {"id": 1, "prompt": "the quick brown fox " * 20}, {"id": 2, "prompt": "a"}]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = write_config(
        tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
        {"temperature": 0, "max_tokens": 3}, engine={"dtype": "float32", "block_size": 8, "num_kv_blocks": 4},
        run={"progress": False},
    )
    monkeypatch.setattr(LLMEngine, "validate", lambda self, ids, params: None)
    report = JobRunner(load_job_config(config)).run()
    assert report.rows_ok == 2 and report.rows_failed == 1
    out = {r["id"]: r for r in read_output(tmp_path / "out")}
    assert "cannot be scheduled in a pool of 4 KV blocks" in out[1]["error"]
    assert out[0]["error"] is None and out[2]["error"] is None and out[0]["completions"]


def test_once_the_commit_gate_is_shut_no_other_process_adds_a_shard(tmp_path):
    """The Ray driver's guarantee that its last manifest lists every shard: a process inside its
    commit when ``stop`` is called finishes it first; one that commits after drops its shard,
    leaving neither the shard nor its temp file."""
    from batchgen.job.sink import ShardSink
    from batchgen.job.store import LocalStore, ShardDropped
    from batchgen.job.store.local import DirectoryGate as CommitGate

    meta = tmp_path / ".batchgen"
    meta.mkdir()
    gate = CommitGate(meta)
    gate.open()
    writer = subprocess.Popen(  # holds the gate (as a replica renaming a shard) for a second
        [sys.executable, "-c", (
            "import sys, time; from pathlib import Path; from batchgen.job.store.local import DirectoryGate as CommitGate\n"
            "out = Path(sys.argv[1]); gate = CommitGate(out / '.batchgen')\n"
            "with gate.commit(out / 'part-ray-000001.parquet'):\n"
            "    (out / 'started').touch(); time.sleep(1.0); (out / 'part-ray-000001.parquet').write_bytes(b'x')\n"
        ), str(tmp_path)],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.01)
    gate.stop()  # waits for the commit in progress
    assert (tmp_path / "part-ray-000001.parquet").exists()
    assert writer.wait(timeout=60) == 0
    sink = ShardSink(LocalStore(str(tmp_path)), "parquet", "id", prefix="part-ray", clean=False, gate=gate)
    with pytest.raises(ShardDropped):
        sink.write([{"id": "a", "prompt": "p", "error": None}], None, index=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".batchgen", "part-ray-000001.parquet", "started"]
    gate.open()  # a rerun opens it again
    sink.write([{"id": "a", "prompt": "p", "error": None}], None, index=2)
    assert (tmp_path / "part-ray-000002.parquet").exists()
