"""Jobs reading from and writing to object storage: a real S3 server (SeaweedFS, scripts/fixtures/s3server.py)
on 127.0.0.1, the real clients (pyarrow's S3 filesystem, boto3) over HTTP, real jobs in processes
of their own.

Rows equal to the same job on local files (Parquet, JSONL and OpenAI batch input; Parquet and
OpenAI output), SIGKILL then rerun, the server killed mid-job and started again, two jobs on one
output prefix (together, staggered, a lease left behind live or expired), bad credentials, a
missing bucket and a read-only user, ``batchgen verify s3://``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import storage
from tests.job.helpers import finish_job, run_job, start_job, write_config
from tests.job.test_faults import make_rows

GEN = {"n": 2, "temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
ENGINE = {"engine": {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256}}


@pytest.fixture
def s3(s3_server):
    return s3_server


def upload(server, bucket: str, key: str, data: bytes) -> str:
    server.client().put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def openai_rows(n: int) -> list[dict]:
    return [
        {"custom_id": f"r{r['id']}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": r["prompt"], "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 2}}
        for r in make_rows(n)
    ]


def bucket_rows(server, bucket: str, prefix: str) -> list[dict]:
    """The output rows under ``s3://bucket/prefix``, read back with the server's admin client."""
    rows: list[dict] = []
    client = server.client()
    for key in server.keys(bucket, prefix.rstrip("/") + "/"):
        name = key.rsplit("/", 1)[1]
        if not name.startswith("part-") or "/.batchgen/" in key:
            continue
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        if name.endswith(".parquet"):
            rows.extend(pq.read_table(io.BytesIO(data)).to_pylist())
        else:
            rows.extend(json.loads(line) for line in data.decode().splitlines() if line.strip())
    return rows


def local_rows(out: Path) -> list[dict]:
    rows: list[dict] = []
    for shard in sorted(out.glob("part-*")):
        if shard.suffix == ".parquet":
            rows.extend(pq.read_table(shard).to_pylist())
        else:
            rows.extend(json.loads(line) for line in shard.read_text().splitlines() if line.strip())
    return rows


def key_of(row: dict) -> str:
    return str(row.get("custom_id", row.get("id")))


def comparable(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for r in rows:
        r = dict(r)
        if isinstance(r.get("response"), dict):  # OpenAI output: ids and timestamps differ per run
            body = r["response"].get("body", {})
            r = {"custom_id": r["custom_id"], "choices": body.get("choices"), "usage": body.get("usage")}
        out[key_of(r)] = r
    return out


def s3_config(tmp: Path, input_spec: dict, out_uri: str, name: str = "job.yaml", **more) -> Path:
    cfg = write_config(tmp, "MODEL", input_spec, GEN, name=name, **{**ENGINE, **more})
    text = cfg.read_text().replace(str(tmp / "out"), out_uri)
    cfg.write_text(text)
    return cfg


def with_model(config: Path, model: str) -> Path:
    config.write_text(config.read_text().replace("model: MODEL", f"model: {model}"))
    return config


def test_the_server_honours_conditional_writes(s3):
    """The lease rests on If-None-Match: * and If-Match (412 otherwise): checked on the server the
    tests use, so that a server without them cannot pass the lease tests by accident."""
    bucket = s3.new_bucket()
    client = s3.client()
    first = client.put_object(Bucket=bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(Exception, match="PreconditionFailed|412"):
        client.put_object(Bucket=bucket, Key="k", Body=b"2", IfNoneMatch="*")
    with pytest.raises(Exception, match="PreconditionFailed|412"):
        client.put_object(Bucket=bucket, Key="k", Body=b"3", IfMatch='"0000"')
    client.put_object(Bucket=bucket, Key="k", Body=b"4", IfMatch=first["ETag"])
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"4"


@pytest.mark.parametrize(
    ("fmt", "out_format"),
    [("parquet", "parquet"), ("jsonl", "parquet"), ("openai", "openai")],
)
def test_input_from_and_output_to_a_bucket_equal_the_job_on_local_files(tmp_path, llama_dir, s3, fmt, out_format):
    n = 10
    bucket = s3.new_bucket()
    if fmt == "parquet":  # two files under a prefix, read as one dataset
        rows = make_rows(n)
        (tmp_path / "in").mkdir()
        for i, part in enumerate((rows[:6], rows[6:])):
            data = parquet_bytes(part)
            (tmp_path / "in" / f"{i}.parquet").write_bytes(data)
            upload(s3, bucket, f"in/{i}.parquet", data)
        local_in, remote_in = str(tmp_path / "in"), f"s3://{bucket}/in/"
        spec = {"prompt_column": "prompt", "id_column": "id"}
    elif fmt == "jsonl":
        data = jsonl_bytes(make_rows(n))
        (tmp_path / "in.jsonl").write_bytes(data)
        local_in, remote_in = str(tmp_path / "in.jsonl"), upload(s3, bucket, "in/prompts.jsonl", data)
        spec = {"prompt_column": "prompt", "id_column": "id"}
    else:
        data = jsonl_bytes(openai_rows(n))
        (tmp_path / "batch.jsonl").write_bytes(data)
        local_in, remote_in = str(tmp_path / "batch.jsonl"), upload(s3, bucket, "in/batch.jsonl", data)
        spec = {}
    output = {"format": out_format, "rows_per_shard": 4}
    local = with_model(s3_config(tmp_path, {"path": local_in, **spec}, str(tmp_path / "out"), "local.yaml", output=output), llama_dir)
    remote = with_model(s3_config(tmp_path, {"path": remote_in, **spec}, f"s3://{bucket}/runs/r1", "remote.yaml", output=output), llama_dir)
    res = run_job(local)
    assert res.returncode == 0, res.stderr
    res = run_job(remote, env=s3.env())
    assert res.returncode == 0, res.stderr
    expected, got = comparable(local_rows(tmp_path / "out")), comparable(bucket_rows(s3, bucket, "runs/r1"))
    assert len(expected) == n and got == expected
    keys = s3.keys(bucket, "runs/r1/")
    assert "runs/r1/.batchgen/manifest.json" in keys and "runs/r1/.batchgen/report.json" in keys
    assert "runs/r1/.batchgen/lease" not in keys  # released at the end
    # the rerun has nothing to do, and verify reads the bucket
    res = run_job(remote, env=s3.env())
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr
    from tests.job.helpers import CliProcess

    check = CliProcess(["verify", f"s3://{bucket}/runs/r1", "--config", str(remote)], tmp_path, s3.env())
    out, err = check.communicate(timeout=600)
    assert check.returncode == 0 and "every row exactly once" in out, out + err


def start_remote(tmp_path, llama_dir, s3, n: int, name: str = "job.yaml", **output):
    bucket = s3.new_bucket()
    remote_in = upload(s3, bucket, "in/prompts.parquet", parquet_bytes(make_rows(n)))
    config = with_model(
        s3_config(tmp_path, {"path": remote_in, "prompt_column": "prompt", "id_column": "id"}, f"s3://{bucket}/out",
                  name, output={"rows_per_shard": 3, **output}),
        llama_dir,
    )
    return bucket, config


def shards_in(s3, bucket: str) -> list[str]:
    return [k for k in s3.keys(bucket, "out/") if k.rsplit("/", 1)[1].startswith("part-")]


def wait_for(predicate, proc, what: str) -> None:
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{err}")
        time.sleep(0.05)


def assert_exactly_once(s3, bucket: str, n: int) -> list[dict]:
    rows = bucket_rows(s3, bucket, "out")
    ids = sorted(r["id"] for r in rows)
    assert ids == list(range(n)), ids
    assert all(r["error"] is None for r in rows)
    return rows


def test_sigkill_after_the_first_shard_then_a_rerun_writes_every_row_once(tmp_path, llama_dir, s3):
    n = 60
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    proc = start_job(config, env=s3.env())
    wait_for(lambda: shards_in(s3, bucket), proc, "the first shard")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(bucket_rows(s3, bucket, "out"))
    assert 0 < partial < n
    assert "out/.batchgen/lease" in s3.keys(bucket, "out/")  # left behind by the killed job ...
    res = run_job(config, env=s3.env())  # ... and taken over at once: its holder is gone from this machine
    assert res.returncode == 0, res.stderr
    rows = assert_exactly_once(s3, bucket, n)
    # equal to an uninterrupted run (sampling is seeded per row)
    bucket2, config2 = start_remote(tmp_path, llama_dir, s3, n, "whole.yaml")
    assert run_job(config2, env=s3.env()).returncode == 0
    assert comparable(rows) == comparable(assert_exactly_once(s3, bucket2, n))


def test_the_server_killed_mid_job_and_started_again(tmp_path, llama_dir, s3):
    """The job retries with backoff and finishes, or exits 1 with one line; the rerun is exact."""
    n = 30
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    proc = start_job(config, env=s3.env())
    wait_for(lambda: shards_in(s3, bucket), proc, "the first shard")
    s3.kill()
    s3.start()
    out, err = finish_job(proc, f"s3://{bucket}/out", env=s3.env())
    if proc.returncode != 0:
        assert proc.returncode == 1, err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, err
        res = run_job(config, env=s3.env())
        assert res.returncode == 0, res.stderr
    assert_exactly_once(s3, bucket, n)


def test_two_jobs_on_one_prefix_together_and_staggered(tmp_path, llama_dir, s3):
    n = 100  # the winner still runs while the other reads its lease
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    together = [start_job(config, env=s3.env()) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in together]
    codes = sorted(p.returncode for p in together)
    assert codes == [0, 2], results
    refused = next(err for p, (_, err) in zip(together, results, strict=True) if p.returncode == 2)
    assert "another batchgen job is writing to s3://" in refused, refused
    assert_exactly_once(s3, bucket, n)
    res = run_job(config, env=s3.env())
    assert res.returncode == 0 and "nothing to do" in res.stdout

    n = 200  # enough rows that the first job is still writing when the second one starts
    bucket, config = start_remote(tmp_path, llama_dir, s3, n, "staggered.yaml")
    first = start_job(config, env=s3.env())
    wait_for(lambda: shards_in(s3, bucket), first, "the first shard")
    second = run_job(config, env=s3.env())
    assert second.returncode == 2 and f"pid {first.pid} on" in second.stderr, second.stderr
    first.send_signal(signal.SIGKILL)  # then the rerun finishes the rows
    first.wait()
    res = run_job(config, env=s3.env())
    assert res.returncode == 0, res.stderr
    assert_exactly_once(s3, bucket, n)


def test_a_lease_from_another_machine_is_refused_while_it_lives_and_taken_over_once_expired(tmp_path, llama_dir, s3):
    n = 6
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    lease = {"owner": "x", "host": "another-machine", "pid": 4242, "lease_seconds": 60}
    client = s3.client()
    client.put_object(Bucket=bucket, Key="out/.batchgen/lease", Body=json.dumps({**lease, "expires": time.time() + 600}))
    res = run_job(config, env=s3.env())
    assert res.returncode == 2 and "pid 4242 on another-machine" in res.stderr, res.stderr
    assert not shards_in(s3, bucket)
    client.put_object(Bucket=bucket, Key="out/.batchgen/lease", Body=json.dumps({**lease, "expires": time.time() - 1}))
    res = run_job(config, env=s3.env())
    assert res.returncode == 0, res.stderr
    assert_exactly_once(s3, bucket, n)


def test_a_job_whose_lease_is_taken_over_stops_writing_with_one_line(tmp_path, llama_dir, s3):
    """Another writer replaces the lease while the job runs: the job's next renewal (If-Match on its
    own ETag) fails, it writes nothing more and exits 1 with one line; the rerun, once that lease
    has expired, completes every row once."""
    n = 300
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    config.write_text(config.read_text() + "storage: {lease_seconds: 3}\n")  # renewed every second
    proc = start_job(config, env=s3.env())
    wait_for(lambda: shards_in(s3, bucket), proc, "the first shard")
    other = {"owner": "x", "host": "another-machine", "pid": 4242, "lease_seconds": 60, "expires": time.time() + 600}
    s3.client().put_object(Bucket=bucket, Key="out/.batchgen/lease", Body=json.dumps(other))
    out, err = finish_job(proc, f"s3://{bucket}/out", env=s3.env())
    assert proc.returncode == 1, err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "was taken over by another job" in errors[0], err
    assert json.loads(s3.client().get_object(Bucket=bucket, Key="out/.batchgen/lease")["Body"].read())["owner"] == "x"
    written = len(bucket_rows(s3, bucket, "out"))
    assert written < n
    s3.client().put_object(Bucket=bucket, Key="out/.batchgen/lease", Body=json.dumps({**other, "expires": time.time() - 1}))
    res = run_job(config, env=s3.env())
    assert res.returncode == 0, res.stderr
    assert_exactly_once(s3, bucket, n)


@pytest.mark.parametrize("case", ["no credentials", "wrong secret", "missing bucket", "read-only output"])
def test_credentials_and_permissions_are_refused_before_the_model_loads(tmp_path, llama_dir, s3, case):
    bucket, config = start_remote(tmp_path, llama_dir, s3, 4)
    env = s3.env()
    if case == "no credentials":
        env = {**env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
               "AWS_CONFIG_FILE": "/nonexistent"}
        expect = "no credentials"
    elif case == "wrong secret":
        env = {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        expect = "credentials were refused"
    elif case == "missing bucket":
        config.write_text(config.read_text().replace(f"s3://{bucket}/out", "s3://no-such-bucket-here/out"))
        expect = "bucket 'no-such-bucket-here' does not exist"
    else:
        env = s3.env("reader")  # may read the input, may not write
        expect = "access denied"
    res = run_job(config, env=env)
    errors = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2, res.stderr
    assert any(expect in x for x in errors), res.stderr
    assert "Traceback" not in res.stderr and "not-the-secret" not in res.stderr + res.stdout
    assert not shards_in(s3, bucket) and "model" not in res.stdout


def test_a_public_bucket_is_read_with_storage_anonymous(tmp_path, llama_dir, s3):
    """``storage.anonymous: true``: unsigned requests, which the server allows on its public bucket
    only; the same job without it and without credentials is refused with one line."""
    from scripts.fixtures.s3server import PUBLIC_BUCKET

    client = s3.client()
    if PUBLIC_BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=PUBLIC_BUCKET)
    uri = upload(s3, PUBLIC_BUCKET, "anon/prompts.parquet", parquet_bytes(make_rows(4)))
    config = with_model(
        s3_config(tmp_path, {"path": uri, "prompt_column": "prompt", "id_column": "id"}, str(tmp_path / "out"),
                  storage={"anonymous": True, "endpoint_url": s3.endpoint}),
        llama_dir,
    )
    no_credentials = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                      "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1"}
    res = run_job(config, env=no_credentials)
    assert res.returncode == 0, res.stderr
    assert sorted(r["id"] for r in local_rows(tmp_path / "out")) == [0, 1, 2, 3]
    config.write_text(config.read_text().replace("anonymous: true", "anonymous: false"))
    res = run_job(config, "--overwrite", env=no_credentials)
    assert res.returncode == 2 and "no credentials" in res.stderr, res.stderr


def test_secrets_in_a_uri_are_redacted():
    assert storage.redact("s3://AKIA123:secret@bucket/k") == "s3://***@bucket/k"
    assert "sekrit" not in storage.redact("https://host/x?X-Amz-Signature=sekrit&a=1")
    assert "tok" not in storage.redact("az://c/p?sig=tok")


def test_credentials_in_a_uri_are_refused_and_never_printed(tmp_path, llama_dir):
    pq.write_table(pa.Table.from_pylist(make_rows(2)), tmp_path / "x.parquet")
    for spec, out in (({"path": "s3://AKIAKEY:topsecret@bkt/in/"}, str(tmp_path / "o1")),
                      ({"path": str(tmp_path / "x.parquet")}, "s3://AKIAKEY:topsecret@bkt/out")):
        config = with_model(s3_config(tmp_path, {**spec, "prompt_column": "prompt"}, out), llama_dir)
        res = run_job(config)
        assert res.returncode == 2 and "credentials in a URI are not read" in res.stderr, res.stderr
        assert "topsecret" not in res.stderr + res.stdout and "s3://***@bkt/" in res.stderr


def test_a_job_names_a_scheme_it_cannot_write(tmp_path, llama_dir):
    config = with_model(s3_config(tmp_path, {"path": str(tmp_path / "x.parquet"), "prompt_column": "prompt"}, "gs://b/out"), llama_dir)
    pq.write_table(pa.Table.from_pylist(make_rows(2)), tmp_path / "x.parquet")
    res = run_job(config)
    assert res.returncode == 2 and "gs:// can be read (input.path) but not written" in res.stderr, res.stderr


def test_the_manifest_and_report_name_no_secret(tmp_path, llama_dir, s3):
    bucket, config = start_remote(tmp_path, llama_dir, s3, 3)
    res = run_job(config, env=s3.env())
    assert res.returncode == 0, res.stderr
    client = s3.client()
    secret = s3.env()["AWS_SECRET_ACCESS_KEY"]
    for key in s3.keys(bucket, "out/.batchgen/"):
        assert secret not in client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert secret not in res.stdout + res.stderr
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != secret  # the tests pass credentials to jobs only


def test_other_schemes_are_read_through_fsspec(tmp_path):
    """A scheme pyarrow has no native filesystem for goes through fsspec (here its in-memory one):
    listing a prefix and a glob, detecting the format, reading Parquet and JSONL rows."""
    import fsspec

    from batchgen.job.config import InputConfig
    from batchgen.job.source import detect_format, input_files, iter_rows

    fs = fsspec.filesystem("memory")
    rows = make_rows(5)
    fs.pipe("/bg-test/in/a.parquet", parquet_bytes(rows[:3]))
    fs.pipe("/bg-test/in/b.parquet", parquet_bytes(rows[3:]))
    fs.pipe("/bg-test/j/rows.jsonl", jsonl_bytes(rows))
    files = input_files("memory://bg-test/in/")
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.parquet", "b.parquet"]
    assert input_files("memory://bg-test/in/*.parquet") == files
    assert detect_format(InputConfig(path="memory://bg-test/in/"), files) == "parquet"
    got = [r for batch in iter_rows(files, "parquet", 2) for r in batch]
    assert [r["id"] for r in got] == list(range(5))
    files = input_files("memory://bg-test/j/rows.jsonl")
    assert detect_format(InputConfig(path=files[0]), files) == "jsonl"
    assert [r["prompt"] for batch in iter_rows(files, "jsonl", 2) for r in batch] == [r["prompt"] for r in rows]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 replicas of one core each need 2 CPUs")
def test_replicas_of_one_job_write_one_bucket(tmp_path, llama_dir, s3):
    """``run.replicas: 2`` on an S3 output: each replica a worker with its own lease and names, every
    row once, every lease released, the replicas' reports summed."""
    n = 12
    bucket, config = start_remote(tmp_path, llama_dir, s3, n)
    res = run_job(config, "--set", "run.replicas=2", env=s3.env())
    assert res.returncode == 0, res.stderr
    assert_exactly_once(s3, bucket, n)
    keys = s3.keys(bucket, "out/")
    assert {k.split("/")[-1].split("-of-")[0] for k in keys if "/part-" in k} == {"part-00000", "part-00001"}
    assert not [k for k in keys if "/lease" in k]
    report = json.loads(s3.client().get_object(Bucket=bucket, Key="out/.batchgen/report.json")["Body"].read())
    assert report["rows_in_output"] == n and len(report["engine"]["replicas"]) == 2
