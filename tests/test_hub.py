"""Models, tokenizers and LoRA adapters by hub id, from a Hugging Face cache built here in the layout
huggingface_hub reads offline (``models--ORG--NAME/refs/main``, ``snapshots/HASH/`` files linked to
``blobs/``): the API and a job load the cached snapshot through ``huggingface_hub``; a revision
picks another snapshot; a job's fingerprint names the commit, so a moved branch refuses a resume;
an id that is not cached gets one line naming it. No hub is reached (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import LLM, LoRARequest, SamplingParams
from batchgen.model.loader import ModelLoadError
from tests.job.helpers import read_output, run_job, write_config

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["the cat sat", "a b c"]


def cache_repo(cache: Path, repo: str, source: str, commit: str, refs: tuple[str, ...] = ("main",)) -> None:
    """``source``'s files as snapshot ``commit`` of ``repo`` in the cache at ``cache``, named by ``refs``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(Path(source).iterdir()):
        if f.is_file():
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, model_dirs, adapters):
    """A cache with org/tiny (llama at main, qwen2 at tag v2) and org/adapter (a rank-4 LoRA),
    which huggingface_hub reads in this process and in the jobs' processes."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache_repo(cache, "org/tiny", model_dirs["llama"], COMMIT_A)
    cache_repo(cache, "org/tiny", model_dirs["qwen2"], COMMIT_B, refs=("v2",))
    cache_repo(cache, "org/adapter", adapters["r4"], "c" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_llm_by_hub_id_and_revision(hub_cache, model_dirs):
    by_id = LLM("org/tiny", dtype="float32")
    assert by_id.engine.model_revision == COMMIT_A and by_id.config.model.endswith(f"snapshots/{COMMIT_A}")
    assert tokens(by_id.generate(PROMPTS, GREEDY)) == tokens(LLM(model_dirs["llama"], dtype="float32").generate(PROMPTS, GREEDY))
    for revision in ("v2", COMMIT_B):
        other = LLM("org/tiny", revision=revision, dtype="float32")
        assert other.engine.model_revision == COMMIT_B
        assert tokens(other.generate(PROMPTS, GREEDY)) == tokens(LLM(model_dirs["qwen2"], dtype="float32").generate(PROMPTS, GREEDY))
    tok_by_id = LLM(model_dirs["llama"], tokenizer="org/tiny", dtype="float32")
    assert tok_by_id.config.tokenizer.endswith(COMMIT_A)


def test_lora_adapter_by_hub_id(hub_cache, llama_dir, adapters):
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    by_id = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, "org/adapter"))
    by_path = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("b", 2, adapters["r4"]))
    assert tokens(by_id) == tokens(by_path)


def test_ids_not_in_the_cache_get_one_line(hub_cache, llama_dir):
    with pytest.raises(ModelLoadError, match=r"model 'org/none' is not a directory and not in the Hugging Face cache \(.*hub\), and HF_HUB_OFFLINE is set: download it where the hub is reachable \(hf download org/none\)"):
        LLM("org/none")
    with pytest.raises(ModelLoadError, match="model 'org/tiny' at revision 'v3' is not a directory and not in the Hugging Face cache"):
        LLM("org/tiny", revision="v3")
    with pytest.raises(ModelLoadError, match="is a local directory; a revision .* applies to hub ids only"):
        LLM(llama_dir, revision="main")


def test_job_by_hub_id_records_the_commit_and_refuses_a_moved_branch(hub_cache, tmp_path, model_dirs):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0, 1], "prompt": PROMPTS}), data)
    gen = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    inp = {"path": str(data), "prompt_column": "prompt", "id_column": "id"}
    res = run_job(write_config(tmp_path, "org/tiny", inp, gen))
    assert res.returncode == 0, res.stderr
    local = write_config(tmp_path, model_dirs["llama"], inp, gen, name="local.yaml", output={"path": str(tmp_path / "local")})
    assert run_job(local).returncode == 0
    by_id = {r["id"]: r["completions"][0]["token_ids"] for r in read_output(tmp_path / "out")}
    assert by_id == {r["id"]: r["completions"][0]["token_ids"] for r in read_output(tmp_path / "local")}
    fingerprint = json.loads((tmp_path / "out" / ".batchgen" / "manifest.json").read_text())["fingerprint"]
    assert fingerprint["model"] == "org/tiny" and fingerprint["model_revision"] == COMMIT_A

    # main now points at other weights: a resume would mix two models' rows
    (hub_cache / "models--org--tiny" / "refs" / "main").write_text(COMMIT_B)
    res = run_job(write_config(tmp_path, "org/tiny", inp, gen))
    assert res.returncode == 2 and "model_revision" in res.stderr, res.stderr

    res = run_job(write_config(tmp_path, "org/none", inp, gen, name="none.yaml"))
    assert res.returncode == 2
    lines = [x for x in res.stderr.splitlines() if "org/none" in x]
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0], res.stderr
