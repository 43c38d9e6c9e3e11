"""A job whose rows name LoRA adapters (``lora:`` and ``input.lora_column``): each row equals
transformers + peft with its adapter (null: the base model), a row naming an unknown adapter gets
an error and the job goes on, a SIGKILL mid-run resumes with every row exactly once, and a changed
adapter makes the resume refuse."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from tests.api.test_lora import oracle_greedy
from tests.job.helpers import (
    killed_after_first_shard_then_rerun,
    read_output,
    run_job,
    write_config,
)

pytest.importorskip("peft")

GEN = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
NAMES = [None, "r4", "r8", None, "r16", "nope"]


def _config(tmp_path, llama_dir, adapters, n):
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat"]
    rows = [
        {"id": i, "prompt": " ".join(words[(i * 5 + k) % 8] for k in range(2 + i % 9)), "adapter": NAMES[i % 6]}
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    inp = {"path": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id", "lora_column": "adapter"}
    config = write_config(
        tmp_path, llama_dir, inp, GEN,
        engine={"dtype": "float32", "max_num_seqs": 2, "max_model_len": 256},
        lora={"adapters": dict(adapters), "max_loras": 2},
        output={"rows_per_shard": 4},
    )
    return config, rows


def test_a_job_with_adapters_per_row_equals_peft_and_resumes_after_sigkill(tmp_path, llama_dir, adapters):
    n = 36
    config, rows = _config(tmp_path, llama_dir, adapters, n)
    out = tmp_path / "out"
    partial, res, killed = killed_after_first_shard_then_rerun(config, out)
    assert res.returncode == 0, res.stderr
    got = {r["id"]: r for r in read_output(out)}
    assert sorted(got) == list(range(n)) and len(read_output(out)) == n, "a row missing or written twice"
    assert 0 < partial < n or killed == 0
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for row in rows:
        result = got[row["id"]]
        if row["adapter"] == "nope":
            assert result["completions"] is None and "unknown adapter 'nope'" in result["error"]
            continue
        assert result["error"] is None, result["error"]
        path = None if row["adapter"] is None else adapters[row["adapter"]]
        want = oracle_greedy(llama_dir, path, tok(row["prompt"])["input_ids"], 8)
        assert result["completions"][0]["token_ids"] == want, row
    manifest = json.loads((out / ".batchgen" / "manifest.json").read_text())
    assert set(manifest["fingerprint"]["lora"]) == {"r4", "r8", "r16"}

    # a changed adapter is a changed config: the rerun refuses to mix its rows with the old ones
    weights = adapters["r4"] + "/adapter_model.safetensors"
    original = open(weights, "rb").read()
    try:
        with open(weights, "ab") as f:
            f.write(b" ")
        res = run_job(config)
        assert res.returncode != 0 and "lora" in res.stderr, res.stderr
    finally:
        open(weights, "wb").write(original)


def test_bad_lora_config_is_refused_before_the_model_loads(tmp_path, llama_dir, adapters):
    config, _ = _config(tmp_path, llama_dir, {"r4": adapters["r4"], "gone": str(tmp_path / "gone")}, 4)
    res = run_job(config)
    assert res.returncode == 2 and "lora.adapters.gone" in res.stderr and "does not exist" in res.stderr
    config, _ = _config(tmp_path, llama_dir, {"r16": adapters["r16"]}, 4)
    text = config.read_text().replace("max_loras: 2", "max_loras: 2\n  max_lora_rank: 8")
    config.write_text(text)
    res = run_job(config)
    assert res.returncode != 0 and "above max_lora_rank=8" in res.stderr, res.stderr


def test_a_ray_replica_runs_each_row_on_its_adapter(tmp_path, llama_dir, adapters):
    """The Ray executor's engine actor (``EngineReplica``, run here in-process) reads the same
    ``lora_column``: rows equal the oracle, the unknown adapter is that row's error."""
    from batchgen.job.preflight import load_job_config
    from batchgen.job.replicas import EngineReplica

    config, rows = _config(tmp_path, llama_dir, adapters, 12)
    replica = EngineReplica(load_job_config(config))
    _, out = replica.generate_rows(rows, [str(r["id"]) for r in rows])
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for row, result in zip(rows, out):
        if row["adapter"] == "nope":
            assert "unknown adapter 'nope'" in result["error"]
            continue
        path = None if row["adapter"] is None else adapters[row["adapter"]]
        assert result["completions"][0]["token_ids"] == oracle_greedy(llama_dir, path, tok(row["prompt"])["input_ids"], 8)
    assert replica.engine.stats()["lora_disk_loads"] == 3
