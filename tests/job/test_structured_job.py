"""Structured outputs in jobs: a schema in ``generation``, and per-row constraints through the params
column (two schemas, a choice list, an invalid schema, an unconstrained row): every row follows its
own constraint, the bad row has an error naming it and the job goes on, the report counts rows cut
short inside their grammar; OpenAI batch lines map ``response_format`` onto the same."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.job.helpers import read_output, run_job, write_config

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_rows_with_their_own_constraints(tmp_path, llama_dir):
    def so(spec):
        return json.dumps({"structured_outputs": spec})

    rows = [
        {"id": "person", "prompt": "the cat", "params": so({"json": PERSON, "disable_any_whitespace": True})},
        {"id": "flag", "prompt": "a dog", "params": so({"json": FLAG, "disable_any_whitespace": True})},
        {"id": "choice", "prompt": "w1 w2", "params": so({"choice": ["alpha", "beta"]})},
        {"id": "bad", "prompt": "w3", "params": so({"json": {"type": "objectt"}})},
        {"id": "free", "prompt": "hello", "params": None},
        {"id": "short", "prompt": "w4", "params": json.dumps({"max_tokens": 3,
                                                              "structured_outputs": {"json": PERSON}})},
        {"id": "default", "prompt": "w5", "params": None},
    ]
    rows[-1]["params"] = json.dumps({"n": 2, "seed": 1})  # the generation's schema, two samples
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id", "params_column": "params"}
    generation = {"temperature": 1.0, "max_tokens": 60, "seed": 0}
    config = write_config(tmp_path, llama_dir, spec, generation)
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    out = {r["id"]: r for r in read_output(tmp_path / "out")}
    assert jsonschema.validate(json.loads(out["person"]["completions"][0]["text"]), PERSON) is None
    assert jsonschema.validate(json.loads(out["flag"]["completions"][0]["text"]), FLAG) is None
    assert out["choice"]["completions"][0]["text"] in ("alpha", "beta")
    assert out["bad"]["error"].startswith("params: structured_outputs: invalid JSON schema")
    assert out["free"]["error"] is None
    assert out["short"]["completions"][0]["finish_reason"] == "length"
    report = json.loads((tmp_path / "out/.batchgen/report.json").read_text())
    assert report["structured_cut_short"] == 1 and report["rows_failed"] == 1
    assert "structured rows cut short" in res.stdout

    # the whole job under one schema, from the generation section
    config = write_config(tmp_path, llama_dir, spec, {**generation, "structured_outputs": {"json": FLAG}},
                          name="flag.yaml", output={"path": str(tmp_path / "out2")})
    assert run_job(config).returncode == 0
    for row in read_output(tmp_path / "out2"):
        if row["error"] is None and row["id"] not in ("person", "flag", "choice", "short"):
            for c in row["completions"]:
                if c["finish_reason"] == "stop":
                    jsonschema.validate(json.loads(c["text"]), FLAG)


def test_openai_batch_response_format(tmp_path, llama_dir):
    body = {"prompt": "the cat", "max_tokens": 60, "temperature": 0}
    lines = [
        {"custom_id": "schema", "body": {**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}}}},
        {"custom_id": "object", "body": {**body, "response_format": {"type": "json_object"}}},
        {"custom_id": "text", "body": {**body, "max_tokens": 5, "response_format": {"type": "text"}}},
        {"custom_id": "wrong", "body": {**body, "response_format": {"type": "xml"}}},
    ]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps({"method": "POST", "url": "/v1/completions", **line}) + "\n" for line in lines))
    config = write_config(tmp_path, llama_dir, {"path": str(data)}, {"max_tokens": 8}, output={"format": "openai"})
    assert run_job(config).returncode == 0
    records = {}
    for shard in (tmp_path / "out").glob("part-*.jsonl"):
        for line in shard.read_text().splitlines():
            record = json.loads(line)
            records[record["custom_id"]] = record
    text = records["schema"]["response"]["body"]["choices"][0]["text"]
    jsonschema.validate(json.loads(text), FLAG)
    obj = records["object"]["response"]["body"]["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["text"]), dict)
    else:
        assert re.match(r"^\s*\{", obj["text"])
    assert records["text"]["error"] is None
    assert "response_format type must be text, json_object or json_schema" in records["wrong"]["error"]["message"]
