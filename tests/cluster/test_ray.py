"""The Ray executor and the Ray Data processor on a local Ray (4 logical CPUs, 2 replicas of one
thread each), against the local executor on the same input: greedy, seeded sampling and beam rows
with bad rows among them; a replica killed mid-job; the driver SIGKILLed mid-job and rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from batchgen.job.lifecycle import JobIncomplete, JobInterrupted
from batchgen.job.preflight import load_job_config
from batchgen.job.ray_executor import RayJobRunner
from batchgen.job.runner import JobRunner
from batchgen.ray_data import build_processor
from tests.job.helpers import ROOT, write_config

N = 40
GEN = {"max_tokens": 12}  # rows carry their own parameters: sampling, greedy or beams
ENGINE = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 128}
RAY = {"num_replicas": 2, "cpus_per_replica": 1, "batch_rows": 6}


def make_rows() -> list[dict]:
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    rows = []
    for i in range(N):
        prompt = " ".join(words[(i * 5 + k) % 8] for k in range(1 + i % 11))
        params = [
            {"n": 2, "temperature": 1.0},  # seeded per row from its id
            {"temperature": 0.0},
            {"beam_width": 2, "max_tokens": 8},
            {"n": 2, "temperature": 0.8, "top_p": 0.7},
        ][i % 4]
        if i == 7:
            prompt = ""  # an empty prompt
        if i == 13:
            prompt = " ".join(["fox"] * 300)  # longer than max_model_len
        if i == 21:
            params = {"temperature": -1.0}  # an invalid parameter
        rows.append({"id": i, "prompt": prompt, "params": json.dumps(params)})
    return rows


@pytest.fixture(scope="module")
def ray_cluster(s3_server):
    # more logical CPUs than replicas: read tasks and the driver's iterator never wait for a replica;
    # the workers get the S3 server's credentials as a cluster's nodes get theirs (the environment)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": s3_server.env()})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory, llama_dir):
    """The input and config, and the local executor's output: the reference."""
    tmp = tmp_path_factory.mktemp("ray_job")
    pq.write_table(pa.Table.from_pylist(make_rows()), tmp / "in.parquet")
    spec = {
        "path": str(tmp / "in.parquet"),
        "prompt_column": "prompt",
        "id_column": "id",
        "params_column": "params",
    }
    config = write_config(tmp, llama_dir, spec, GEN, output={"rows_per_shard": 8}, ray=RAY)
    cfg = load_job_config(config, ["engine.max_model_len=128", "engine.max_num_seqs=8", "run.progress=false"])
    report = JobRunner(cfg).run()
    assert report.rows_failed == 3
    return tmp, config, by_id(Path(cfg.output.path))


def by_id(out: Path) -> dict[int, dict]:
    rows = pq.read_table(out).to_pylist() if any(out.glob("*.parquet")) else []
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id is in the output twice"
    return {r["id"]: r for r in rows}


def assert_same_rows(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(N))
    for i, w in want.items():
        g = got[i]
        assert g["error"] == w["error"], i
        assert g["row_index"] == w["row_index"] and g["prompt"] == w["prompt"]
        if w["error"] is not None:
            assert g["completions"] is None
            continue
        assert [c["token_ids"] for c in g["completions"]] == [c["token_ids"] for c in w["completions"]], i
        assert [c["finish_reason"] for c in g["completions"]] == [
            c["finish_reason"] for c in w["completions"]
        ]
        for a, b in zip(g["completions"], w["completions"], strict=True):
            assert a["cumulative_logprob"] == pytest.approx(b["cumulative_logprob"], abs=1e-4)


def ray_cfg(config: Path, out: Path, *sets: str):
    return load_job_config(
        config,
        ["run.executor=ray", f"output.path={out}", "run.progress=false", "engine.max_model_len=128", *sets],
    )


def test_the_ray_executor_writes_what_the_local_one_writes_and_resumes(ray_cluster, job):
    tmp, config, want = job
    out = tmp / "out-ray"
    report = RayJobRunner(ray_cfg(config, out)).run()
    assert_same_rows(by_id(out), want)
    assert (report.rows_ok, report.rows_failed, report.rows_in_output) == (N - 3, 3, N)
    assert sum(report.errors.values()) == 3 and any("prompt is empty" in e for e in report.errors)
    assert report.generated_tokens == sum(r["num_generated_tokens"] for r in want.values())
    names = sorted(p.name for p in out.glob("*.parquet"))
    assert names == [f"part-ray-{u:06d}.parquet" for u in range(7)]  # 40 rows in units of 6
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    assert sum(manifest["shards"].values()) == N
    saved = json.loads((out / ".batchgen" / "report.json").read_text())
    assert saved["rows_in_output"] == N and saved["engine"]["replicas"] in (1, 2)
    # a rerun finds every unit on disk: nothing to do, nothing written twice
    (out / "part-ray-000003.parquet").unlink()  # ... but one lost shard is made again
    again = RayJobRunner(ray_cfg(config, out)).run()
    assert again.rows_previously_done == N - 6 and again.rows_ok + again.rows_failed == 6
    assert_same_rows(by_id(out), want)


def test_broken_text_and_repeated_ids_are_error_rows_under_ray_too(ray_cluster, tmp_path, llama_dir):
    """A JSONL input with a lone surrogate escape, bytes that are not UTF-8, a line that is not JSON
    and a repeated id: under Ray each row comes out once, as the local executor writes it, and no
    task fails."""
    lines = [json.dumps({"id": f"r{i}", "prompt": f"w{i} w{i + 1}", "params": {"temperature": 0}}).encode()
             for i in range(10)]
    lines[2] = b'{"id": "r2", "prompt": "w9 \\ud800 w10"}'
    lines[4] = b'{"id": "r4", "prompt": "bytes \xff here"}'
    lines[6] = b"not json"
    lines[8] = b'{"id": "r1", "prompt": "a repeated id"}'
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id", "params_column": "params"}
    config = write_config(tmp_path, llama_dir, spec, {"max_tokens": 4, "temperature": 0}, ray=RAY)
    local = load_job_config(config, ["run.progress=false", f"output.path={tmp_path / 'local'}"])
    JobRunner(local).run()
    RayJobRunner(ray_cfg(config, tmp_path / "ray")).run()
    want = {r["row_index"]: r for r in pq.read_table(tmp_path / "local").to_pylist()}
    got = {r["row_index"]: r for r in pq.read_table(tmp_path / "ray").to_pylist()}
    assert sorted(got) == sorted(want) == list(range(10))
    for i, w in want.items():
        assert (got[i]["id"], got[i]["prompt"], got[i]["error"]) == (w["id"], w["prompt"], w["error"]), i
        assert [c["token_ids"] for c in got[i]["completions"] or []] == [c["token_ids"] for c in w["completions"] or []]
    assert want[2]["prompt"] == "w9 \ufffd w10" and want[2]["error"] is None
    assert want[4]["prompt"] == "bytes \ufffd here" and want[4]["error"] is None
    assert want[6]["error"].startswith("in.jsonl line 7: invalid JSON")
    assert want[8]["error"].startswith("id: duplicate id 'r1': row 1 has it too")


def test_sigterm_once_ray_has_started_saves_the_finished_units_and_a_rerun_completes(ray_cluster, job):
    """The manifest is written once Ray is up; a SIGTERM from then on (here: at once) stops the job.
    The manifest then lists every shard on disk, the units the replicas finished after the driver
    stopped reading included, and the rerun writes the rest."""
    tmp, config, want = job
    out = tmp / "out-ray-sigterm"
    manifest = out / ".batchgen" / "manifest.json"

    def signal_once_started() -> None:
        while not manifest.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_started, daemon=True).start()
    with pytest.raises(JobInterrupted, match="interrupted by SIGTERM: .* rerun the same command to resume"):
        RayJobRunner(ray_cfg(config, out)).run()
    shards = {p.name: pq.ParquetFile(p).metadata.num_rows for p in out.glob("part-*.parquet")}
    assert json.loads(manifest.read_text())["shards"] == shards
    again = RayJobRunner(ray_cfg(config, out)).run()
    saved = sum(shards.values())
    if saved == N:  # the replicas had finished every unit: the rerun finds nothing to do
        assert again.nothing_to_do == N
    else:
        assert again.rows_previously_done == saved
    assert_same_rows(by_id(out), want)


def test_the_processor_adds_the_output_columns_to_a_users_dataset(ray_cluster, job, llama_dir):
    _, _, want = job
    processor = build_processor(
        llama_dir,
        generation=GEN,
        engine=ENGINE,
        prompt_column="prompt",
        id_column="id",
        params_column="params",
        num_replicas=2,
        batch_rows=8,
    )
    rows = [{**r, "row_index": r["id"]} for r in make_rows()]
    ds = ray.data.from_items(rows).filter(lambda r: r["id"] != 39)  # a user's own step before
    got = {r["id"]: r for r in processor(ds).take_all()}
    want = {i: r for i, r in want.items() if i != 39}
    assert sorted(got) == sorted(want)
    for i, w in want.items():
        g = got[i]
        assert g["error"] == w["error"]
        if w["error"] is None:
            assert [list(c["token_ids"]) for c in g["completions"]] == [
                c["token_ids"] for c in w["completions"]
            ]
    with pytest.raises(ValueError, match="temperature"):
        build_processor(llama_dir, generation={"temperature": -2.0})
    with pytest.raises(ValueError, match="exactly one of prompt_column or messages_column"):
        build_processor(llama_dir, prompt_column=None)


def test_a_unit_that_cannot_be_read_ends_the_job_with_one_clear_error(ray_cluster, job, monkeypatch):
    """The input has fewer rows than counted (it shrank after the count): the last unit's read
    fails, the job ends with one line (JobIncomplete: exit 1 from the CLI) naming the cause, and a
    rerun completes the output."""
    tmp, config, want = job
    out = tmp / "out-short"
    monkeypatch.setattr(RayJobRunner, "_count_input_rows", lambda self: N + 5)
    with pytest.raises(JobIncomplete, match=r"RuntimeError: input unit \d+ should hold rows .* has no row 4[0-2];.*rows written to") as e:
        RayJobRunner(ray_cfg(config, out)).run()
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
    kept = len(by_id(out))
    assert f"the {kept} rows written" in str(e.value)
    monkeypatch.undo()  # the input as it is: the rerun completes what the failed run left
    RayJobRunner(ray_cfg(config, out)).run()
    assert_same_rows(by_id(out), want)


def test_ray_settings_are_checked_with_the_config(job):
    _, config, _ = job
    from batchgen.job.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_job_config(
            config,
            [
                "run.executor=ray",
                "run.shard=0/2",
                "ray.num_replicas=0",
                "ray.cpus_per_replica=-1",
                "ray.adress=x",
            ],
        )
    message = str(e.value)
    assert "a Ray job spreads its rows over its replicas itself" in message
    assert "ray.num_replicas and ray.batch_rows: must be >= 1" in message
    assert "ray.cpus_per_replica: must be > 0" in message and "did you mean 'address'" in message
    with pytest.raises(ConfigError, match="run.executor: must be one of local, ray"):
        load_job_config(config, ["run.executor=spark"])


def _replica_pids() -> list[int]:
    """Processes of the engine actors (Ray titles them after the map operator)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"MapBatches(JobReplica)" in cmdline:
                pids.append(int(proc.name))
    return pids


def _wait(predicate, what: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_killed_engine_actor_is_restarted_and_every_row_is_written_once(ray_cluster, job):
    tmp, config, want = job
    out = tmp / "out-kill"
    runner = RayJobRunner(ray_cfg(config, out, "ray.batch_rows=3"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(report=runner.run()), daemon=True)
    thread.start()
    _wait(lambda: len(_replica_pids()) == 2 and any(out.glob("part-ray-*.parquet")), "the first shard")
    victim = _replica_pids()[0]
    os.kill(victim, signal.SIGKILL)  # the actor dies mid-job; Ray restarts it and retries its task
    thread.join(timeout=600)
    assert "report" in result, "the job did not finish after an engine actor was killed"
    assert not Path(f"/proc/{victim}").exists() or victim not in _replica_pids()
    assert_same_rows(by_id(out), want)
    assert result["report"].rows_in_output == N


def test_the_driver_killed_mid_job_and_rerun_writes_every_row_once(ray_cluster, job):
    tmp, config, want = job
    out = tmp / "out-driver"
    sets = ["--set", "run.executor=ray", "--set", f"output.path={out}", "--set", "ray.batch_rows=2"]
    sets += ["--set", f"ray.address={ray_cluster}", "--set", "engine.max_model_len=128"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "batchgen", "job", str(config), "--no-progress", *sets]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait(lambda: any(out.glob("part-ray-*.parquet")) or proc.poll() is not None, "the first shard")
    proc.kill()  # SIGKILL: no handler runs; the driver's actors die with it
    proc.wait()
    _wait(lambda: not _replica_pids(), "the dead driver's actors to end", timeout=120)
    first = {p.name for p in out.glob("part-ray-*.parquet")}
    assert first and len(first) < 20, "the driver should die mid-job"
    # the rerun: the same runner the command runs, here in the test's process to save a Ray start
    report = RayJobRunner(ray_cfg(config, out, "ray.batch_rows=2")).run()
    assert report.rows_previously_done == sum(pq.ParquetFile(out / name).metadata.num_rows for name in first)
    assert_same_rows(by_id(out), want)


def test_ray_reads_and_writes_a_bucket_with_an_engine_actor_killed(ray_cluster, job, s3_server, monkeypatch):
    """Input and output in object storage, 2 replicas, one SIGKILLed mid-job: every row once, equal
    to the local executor's, and ``batchgen verify s3://`` agrees."""
    from batchgen.job.verify import verify

    tmp, config, want = job
    for key, value in s3_server.env().items():  # the driver's credentials
        monkeypatch.setenv(key, value)
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="in/in.parquet", Body=(tmp / "in.parquet").read_bytes())
    cfg = ray_cfg(config, Path("unused"), "ray.batch_rows=3", f"input.path=s3://{bucket}/in/",
                  f"output.path=s3://{bucket}/out")
    runner = RayJobRunner(cfg)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(report=runner.run()), daemon=True)
    thread.start()

    def shards() -> list[str]:
        return [k for k in s3_server.keys(bucket, "out/") if "/part-ray-" in k]

    _wait(lambda: len(_replica_pids()) == 2 and shards(), "the first shard in the bucket")
    victim = _replica_pids()[0]
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=600)
    assert "report" in result, "the job did not finish after an engine actor was killed"
    client = s3_server.client()
    rows = [r for key in shards() for r in pq.read_table(pa.BufferReader(client.get_object(Bucket=bucket, Key=key)["Body"].read())).to_pylist()]
    got = {r["id"]: r for r in rows}
    assert len(got) == len(rows) == N
    assert_same_rows(got, want)
    check = verify(f"s3://{bucket}/out", str(config))  # the config's input: the same rows, on local disk
    assert check.ok and check.rows_in_output == N, check.render()
