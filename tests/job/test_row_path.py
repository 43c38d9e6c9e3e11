"""A row never ends the job: a property test over the job's whole row path (reading, ids, chat
templates, tokenization, per-row parameters, writing), in every input format, with random types
and arbitrary text in every column. Each generated dataset runs as a real job, in this process, on
one tiny model loaded once, and again after every other shard was deleted (a rerun after a crash).
Every input row must come out exactly once (by ``row_index``), as an output row or an error row
whose message names the field at fault, and the output must read back with the input's columns. The search is seeded (``derandomize``) so CI is deterministic;
``tests/job/fuzz_jobs.py`` runs the same strategies over 100,000 rows and more."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from hypothesis import HealthCheck, given, settings

from batchgen.config import EngineConfig
from batchgen.engine.engine import LLMEngine
from batchgen.job.config import validate
from batchgen.job.runner import JobRunner
from tests.job.row_strategies import Dataset, datasets

ENGINE = {"dtype": "float32", "max_model_len": 96, "num_kv_blocks": 96, "max_num_seqs": 16}
GENERATION = {"temperature": 0, "max_tokens": 2}
# what an error may start with besides the row's own columns: the engine's checks of a request
ENGINE_CHECKS = ("prompt has", "prompt token id", "prompt is empty", "request needs", "stop_token_ids")


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(llama_dir, **ENGINE))


def run_dataset(
    ds: Dataset, folder: Path, model: str, engine: LLMEngine, resume: bool = False
) -> tuple[list[dict], int, dict]:
    """Write ``ds``, run it as a job, return (output rows, rows expected, the job's input section).
    ``resume``: then delete every other shard and run the job again, as a rerun after a crash."""
    if folder.exists():
        shutil.rmtree(folder)
    inp, expected = ds.write(folder / "in")
    out_fmt = "openai" if ds.fmt == "openai" else "parquet"
    cfg = validate({
        "model": model,
        "engine": ENGINE,
        "input": inp,
        "generation": GENERATION,
        "output": {"path": str(folder / "out"), "rows_per_shard": 16, "format": out_fmt},
        "run": {"progress": False, "max_rows_in_flight": 8, "lookahead_rows": 16},
    })
    for attempt in range(2 if resume else 1):
        if attempt:
            for shard in sorted((folder / "out").glob("part-*"))[::2]:
                shard.unlink()
        try:
            JobRunner(cfg, engine=engine).run()
        finally:  # a failed job leaves requests behind: the next example starts on an empty engine
            for rid in list(engine._groups):
                engine.abort_request(rid)
    if out_fmt == "openai":
        rows = [json.loads(line) for p in sorted((folder / "out").glob("part-*.jsonl"))
                for line in p.read_text().split("\n") if line.strip()]
    else:
        rows = pads.dataset(str(folder / "out"), format="parquet").to_table().to_pylist()
    return rows, expected, inp


def check_output(ds: Dataset, rows: list[dict], expected: int, inp: dict) -> None:
    positions = sorted(r["row_index"] for r in rows)
    assert positions == list(range(expected)), f"{len(rows)} output rows for {expected} input rows"
    fields = [inp.get(k) for k in ("prompt_column", "messages_column", "params_column", "id_column") if inp.get(k)]
    fields += ["body", "custom_id", "in.jsonl line", "row"]
    named = re.compile("^(" + "|".join(re.escape(f) for f in fields + list(ENGINE_CHECKS)) + ")")
    for r in rows:
        error = r["error"]["message"] if ds.fmt == "openai" and r["error"] else r["error"]
        if error is None:
            choices = r["response"]["body"]["choices"] if ds.fmt == "openai" else r["completions"]
            assert choices, r
        else:
            assert isinstance(error, str) and named.match(error), f"error names no field: {error!r}"
    if ds.fmt != "openai":
        columns = set(rows[0]) if rows else set()
        inputs = {inp.get("prompt_column"), inp.get("messages_column"), inp.get("id_column"), inp.get("params_column")}
        assert inputs - {None} <= columns, (inputs, columns)
        assert {"completions", "num_prompt_tokens", "num_generated_tokens", "error", "row_index"} <= columns


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(ds=datasets())
def test_every_row_comes_out_once(ds, engine, llama_dir, tmp_path):
    rows, expected, inp = run_dataset(ds, tmp_path / "job", llama_dir, engine, resume=True)
    check_output(ds, rows, expected, inp)
