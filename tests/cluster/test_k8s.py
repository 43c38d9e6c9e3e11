"""The Kubernetes manifests under jobs/k8s: they are objects of the right kinds (checked against
the ``kubernetes`` client's models), and the Indexed Job's exact command, run by one process per
index with ``JOB_COMPLETION_INDEX`` set (one of them SIGKILLed and rerun), writes every input row
exactly once, which ``batchgen verify`` confirms; verify names the ids of a deleted or a
duplicated shard."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from kubernetes.client import ApiClient

from batchgen.cli import main
from tests.job.helpers import ROOT

K8S = ROOT / "jobs" / "k8s"
N_ROWS = 60


def as_model(obj: dict, kind: str):
    """``obj`` as the client's model ``kind``; a misspelled or misplaced key would be dropped by the
    model, so the round trip must give ``obj`` back."""
    model = ApiClient().deserialize(json.dumps(obj), kind, "application/json")
    assert ApiClient().sanitize_for_serialization(model) == obj, f"keys the {kind} model does not know"
    return model


def test_the_indexed_job_manifest_is_an_indexed_batch_job():
    doc = yaml.safe_load((K8S / "indexed-job.yaml").read_text())
    job = as_model(doc, "V1Job")
    assert job.kind == "Job" and job.api_version == "batch/v1"
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 4
    command = " ".join(job.spec.template.spec.containers[0].command)
    assert "python -m batchgen job" in command and "run.shard=${JOB_COMPLETION_INDEX}/4" in command
    assert job.spec.template.spec.restart_policy == "Never"


def test_the_rayjob_manifest_is_a_kuberay_job_with_valid_pod_templates():
    doc = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayJob")  # a CRD: no client model
    assert set(doc["spec"]) <= {
        "entrypoint",
        "shutdownAfterJobFinishes",
        "ttlSecondsAfterFinished",
        "rayClusterSpec",
    }
    assert (
        "python -m batchgen job" in doc["spec"]["entrypoint"]
        and "run.executor=ray" in doc["spec"]["entrypoint"]
    )
    cluster = doc["spec"]["rayClusterSpec"]
    as_model(cluster["headGroupSpec"]["template"], "V1PodTemplateSpec")
    for group in cluster["workerGroupSpecs"]:
        as_model(group["template"], "V1PodTemplateSpec")
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.fixture
def indexed_job(tmp_path, llama_dir):
    """The volume /data of the manifest, as a directory: model, input, config."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(llama_dir, data / "model")
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    rows = [{"prompt": " ".join(words[(i * 3 + k) % 8] for k in range(1 + i % 9))} for i in range(N_ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), data / "in.parquet")
    config = {
        "model": str(data / "model"),
        "input": {"path": str(data / "in.parquet"), "prompt_column": "prompt"},
        "output": {"path": str(data / "out"), "rows_per_shard": 3, "flush_seconds": 0.5},
        "generation": {"n": 2, "temperature": 1.0, "max_tokens": 16, "seed": 1, "ignore_eos": True},
        "engine": {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 128},
    }
    (data / "job.yaml").write_text(yaml.safe_dump(config))
    doc = yaml.safe_load((K8S / "indexed-job.yaml").read_text())
    container = doc["spec"]["template"]["spec"]["containers"][0]
    command = [part.replace("/data", str(data)) for part in container["command"]]
    return data, command, doc["spec"]["completions"]


def start_pod(command: list[str], index: int, data: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        **(extra_env or {}),
        "JOB_COMPLETION_INDEX": str(index),  # what Kubernetes sets in each pod of an Indexed Job
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # its `python`
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.Popen(
        command, env=env, cwd=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_indexed_job_command_with_a_pod_killed_and_rerun_covers_every_row_once(indexed_job, capsys):
    data, command, n = indexed_job
    out = data / "out"
    pods = {i: start_pod(command, i, data) for i in range(n)}
    victim = pods[1]
    end = time.monotonic() + 600
    while not list(out.glob("part-00001-of-00004-*.parquet")) and victim.poll() is None:
        assert time.monotonic() < end
        time.sleep(0.05)
    victim.kill()  # the pod of index 1 dies mid-job (SIGKILL: nothing runs after)
    victim.wait()
    pods[1] = start_pod(command, 1, data)  # Kubernetes starts a new pod for the index
    for i, pod in pods.items():
        _, err = pod.communicate(timeout=600)
        assert pod.returncode == 0, f"index {i}: {err[-2000:]}"
    assert sorted(p.name for p in (out / ".batchgen").glob("manifest*")) == [
        f"manifest-{i:05d}-of-00004.json" for i in range(4)
    ]
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    assert "every row exactly once" in capsys.readouterr().out
    combined = json.loads((out / ".batchgen" / "report.json").read_text())
    assert combined["workers"] == 4 and combined["verify"]["ok"] and combined["rows_in_output"] == N_ROWS

    # a lost shard: verify fails and names its rows
    shard = sorted(out.glob("part-00002-of-00004-*.parquet"))[0]
    lost = [str(v) for v in sorted(pq.read_table(shard, columns=["row_index"]).column(0).to_pylist())]
    moved = shard.rename(data / shard.name)
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out
    assert f"missing {len(lost)} ids: {', '.join(lost)}" in report
    moved.rename(shard)
    # a shard written twice (a worker's copy under another name): verify names the ids and shards
    copy = out / "part-00003-of-00004-000099.parquet"
    source = sorted(out.glob("part-00003-of-00004-*.parquet"))[0]
    shutil.copy(source, copy)
    twice = pq.read_table(source, columns=["row_index"]).column(0).to_pylist()
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out
    assert f"duplicated {len(twice)} ids: {twice[0]} in {source.name}, {copy.name}" in report
    assert not json.loads((out / ".batchgen" / "report.json").read_text())["verify"]["ok"]


def _docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text())}


@pytest.mark.parametrize("name", ["indexed-job-s3.yaml", "rayjob-s3.yaml"])
def test_the_bucket_manifests_need_no_shared_volume(name):
    """The bucket variants: a ConfigMap with the job's config (s3:// input and output, storage keys
    the config knows), credentials from a Secret, and no PersistentVolumeClaim anywhere."""
    from dataclasses import fields

    from batchgen.storage import StorageOptions

    docs = _docs(name)
    config = yaml.safe_load(as_model(docs["ConfigMap"], "V1ConfigMap").data["job.yaml"])
    assert config["input"]["path"].startswith("s3://") and config["output"]["path"].startswith("s3://")
    assert set(config["storage"]) <= {f.name for f in fields(StorageOptions)}
    if name.startswith("indexed"):
        job = as_model(docs["Job"], "V1Job")
        assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 4
        pods = [job.spec.template]
    else:
        cluster = docs["RayJob"]["spec"]["rayClusterSpec"]
        assert "run.executor=ray" in docs["RayJob"]["spec"]["entrypoint"]
        pods = [as_model(cluster["headGroupSpec"]["template"], "V1PodTemplateSpec")]
        pods += [as_model(g["template"], "V1PodTemplateSpec") for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert not any(v.persistent_volume_claim for v in pod.spec.volumes or [])
        for container in pod.spec.containers:
            assert [e.secret_ref.name for e in container.env_from] == ["batchgen-s3"]


def test_the_bucket_indexed_job_with_a_pod_killed_covers_every_row_once(tmp_path, llama_dir, s3_server):
    """The S3 Indexed Job's exact command, one process per index, against a real S3 server, the
    model by hub id from a locally built cache (offline): pod 1 SIGKILLed mid-job and started
    again; then ``batchgen verify s3://`` finds every row exactly once."""
    from tests.test_hub import cache_repo

    docs = _docs("indexed-job-s3.yaml")
    config = yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"])
    bucket = s3_server.new_bucket()
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    rows = [{"id": i, "prompt": " ".join(words[(i * 3 + k) % 8] for k in range(1 + i % 9))} for i in range(N_ROWS)]
    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    s3_server.client().put_object(Bucket=bucket, Key="prompts/part-0.parquet", Body=buf.getvalue().to_pybytes())
    config["input"]["path"] = config["input"]["path"].replace("my-bucket", bucket)
    config["output"]["path"] = out = config["output"]["path"].replace("my-bucket", bucket)
    config["output"].update(rows_per_shard=3, flush_seconds=0.5)
    config["generation"] = {"n": 2, "temperature": 1.0, "max_tokens": 16, "seed": 1, "ignore_eos": True}
    config["engine"] = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 128}
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "job.yaml").write_text(yaml.safe_dump(config))
    cache = tmp_path / "hub"
    cache_repo(cache, config["model"], llama_dir, "c0ffee" * 6 + "c0ff")
    container = docs["Job"]["spec"]["template"]["spec"]["containers"][0]
    command = [part.replace("/etc/batchgen", str(etc)) for part in container["command"]]
    env = {**s3_server.env(), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def start(index: int) -> subprocess.Popen:
        return start_pod(command, index, tmp_path, env)

    def shards(index: int) -> list[str]:
        return [k for k in s3_server.keys(bucket, "runs/r1/") if f"/part-{index:05d}-of-00004-" in k]

    pods = {i: start(i) for i in range(4)}
    end = time.monotonic() + 600
    while not shards(1) and pods[1].poll() is None:
        assert time.monotonic() < end
        time.sleep(0.05)
    pods[1].kill()
    pods[1].wait()
    pods[1] = start(1)  # the index's next pod (on this machine: the dead pod's lease is taken over at once)
    for i, pod in pods.items():
        _, err = pod.communicate(timeout=600)
        assert pod.returncode == 0, f"index {i}: {err[-2000:]}"
    check = subprocess.run(
        [sys.executable, "-m", "batchgen", "verify", out, "--config", str(etc / "job.yaml")],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )
    assert check.returncode == 0 and "every row exactly once" in check.stdout, check.stdout + check.stderr
    leases = [k for k in s3_server.keys(bucket, "runs/r1/.batchgen/") if "/lease" in k]
    assert leases == []  # every pod released its lease
