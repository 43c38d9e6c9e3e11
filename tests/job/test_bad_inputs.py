"""What a property test cannot cover, through ``python -m batchgen job`` as a user runs it: broken
text in a JSONL line (a lone surrogate escape, bytes that are not UTF-8) is that row's business and
the job goes on; a corrupt file among the inputs, a model directory without a tokenizer and an
output path that is a file are refused before any work (exit 2) with a message naming what is
wrong; a repeated id is an error row, and a rerun after the loss of a shard writes each row once."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from tests.job.helpers import read_output, run_job, write_config

GEN = {"temperature": 0, "max_tokens": 2}


def test_broken_text_in_one_line_does_not_end_the_job(tmp_path, llama_dir):
    lines = [
        b'{"id": "a", "prompt": "w1 w2"}',
        b'{"id": "b", "prompt": "w9 \\ud800 w10"}',  # valid JSON, not valid Unicode
        b'{"id": "c", "prompt": "emoji \\ud83d\\ude00 and \\u200f rtl \\u0000 nul"}',
        b'{"id": "d", "prompt": "bytes \xff\xfe here"}',  # not UTF-8
        b'{"id": "e\\udfff", "prompt": "a surrogate in the id"}',
        b"not json at all",
    ]
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"}, GEN)
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    rows = {r["row_index"]: r for r in read_output(tmp_path / "out")}
    assert sorted(rows) == list(range(6))
    assert rows[1]["prompt"] == "w9 \ufffd w10" and rows[1]["error"] is None and rows[1]["completions"]
    assert rows[2]["prompt"] == "emoji \U0001f600 and \u200f rtl \x00 nul" and rows[2]["error"] is None
    assert rows[3]["prompt"] == "bytes \ufffd\ufffd here" and rows[3]["error"] is None
    assert rows[4]["id"] == "e\ufffd" and rows[4]["error"] is None
    assert rows[5]["error"].startswith("in.jsonl line 6: invalid JSON")
    assert run_job(config).returncode == 0  # the rerun finds every row done, ids with U+FFFD included
    assert len(read_output(tmp_path / "out")) == 6


def test_a_parquet_text_column_with_bytes_that_are_not_utf8(tmp_path, llama_dir):
    """A file written without UTF-8 validation: the bad bytes read as U+FFFD, as in JSON Lines."""
    raw = pa.array([b"w1 w2", b"w3 \xff w4", None], pa.binary()).view(pa.string())
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": raw, "id": ["a", "b", "c"]}), data)
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"}, GEN)
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    rows = {r["id"]: r for r in read_output(tmp_path / "out")}
    assert rows["b"]["prompt"] == "w3 \ufffd w4" and rows["b"]["error"] is None and rows["b"]["completions"]
    assert rows["a"]["error"] is None and rows["c"]["error"] == "prompt is null"


def test_a_repeated_id_is_an_error_row_and_a_rerun_writes_each_row_once(tmp_path, llama_dir):
    rows = [{"id": i % 5, "prompt": f"w{i} w{i + 1}"} for i in range(12)] + [{"id": "#7", "prompt": "x y"}]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "id": str(r["id"])} for r in rows]), data)
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                          GEN, output={"rows_per_shard": 3}, run={"max_failed_fraction": 1.0})
    assert run_job(config).returncode == 0
    out = {r["row_index"]: r for r in read_output(tmp_path / "out")}
    assert sorted(out) == list(range(13))
    assert out[5]["error"] == "id: duplicate id '0': row 0 has it too; ids must be unique, they key resume"
    assert all(out[i]["error"] is None for i in (*range(5), 12)) and all(out[i]["error"] for i in range(5, 12))
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    for shard in shards[::2]:
        shard.unlink()
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    again = read_output(tmp_path / "out")
    assert sorted(r["row_index"] for r in again) == list(range(13))


def test_a_corrupt_input_file_is_refused_naming_it(tmp_path, llama_dir):
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["a b", "c d"]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not a parquet file")
    config = write_config(tmp_path, llama_dir, {"path": str(folder), "prompt_column": "prompt"}, GEN)
    res = run_job(config)
    assert res.returncode == 2 and "b.parquet" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_without_a_tokenizer_is_refused_before_it_loads(tmp_path, llama_dir):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b"]}), data)
    config = write_config(tmp_path, str(model), {"path": str(data), "prompt_column": "prompt"}, GEN)
    res = run_job(config)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"model: no tokenizer in '{model}': expected tokenizer.json or tokenizer_config.json" in res.stderr
    assert "engine.tokenizer" in res.stderr
    config = write_config(tmp_path, str(model), {"path": str(data), "prompt_column": "prompt"}, GEN,
                          name="with_tokenizer.yaml", engine={"dtype": "float32", "tokenizer": llama_dir})
    assert run_job(config).returncode == 0  # the tokenizer from another directory


def test_an_output_path_that_is_a_file_is_refused_with_the_config(tmp_path, llama_dir):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b"]}), data)
    blocker = tmp_path / "out"
    blocker.write_text("a file")
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt"}, GEN)
    res = run_job(config)
    assert res.returncode == 2 and f"output.path: '{blocker}' is not a directory" in res.stderr, res.stderr
    assert "invalid job config" in res.stderr


def test_a_row_key_the_output_cannot_hold_is_refused_not_dropped(tmp_path, llama_dir):
    """The output's columns follow the job's ``generation``: a row asking for ``logprobs`` /
    ``prompt_logprobs`` in a job without those columns gets an error naming the key (and the job's
    key that adds the column), not a silent drop; the rows of a job with them carry them."""
    data = tmp_path / "in.parquet"
    params = ['{"logprobs": 3}', None, '{"prompt_logprobs": 1}']
    pq.write_table(pa.table({"id": [0, 1, 2], "prompt": ["a b", "c d", "e f"], "params": params}), data)
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id", "params_column": "params"}
    config = write_config(tmp_path, llama_dir, spec, GEN, run={"max_failed_fraction": 1.0})
    assert run_job(config).returncode == 0
    out = {r["id"]: r for r in read_output(tmp_path / "out")}
    assert out[1]["error"] is None and "prompt_logprobs" not in out[1]
    assert out[0]["error"] == "params: logprobs: the job writes no logprobs column; set generation.logprobs in the job config for it"
    assert out[2]["error"].startswith("params: prompt_logprobs: the job writes no prompt_logprobs column")
    config = write_config(tmp_path, llama_dir, spec, {**GEN, "logprobs": 2, "prompt_logprobs": 0},
                          name="with.yaml", output={"path": str(tmp_path / "out2")})
    assert run_job(config).returncode == 0
    rows = {r["id"]: r for r in read_output(tmp_path / "out2")}
    assert all(r["error"] is None for r in rows.values())
    assert len(rows[0]["completions"][0]["logprobs"]["top_token_ids"][0]) == 3  # the row's own k
    assert len(rows[1]["completions"][0]["logprobs"]["top_token_ids"][0]) == 2
    assert len(rows[2]["prompt_logprobs"]["top_token_ids"][0]) == 1 and rows[0]["prompt_logprobs"]["top_token_ids"][0] == []


def test_openai_output_lines_survive_any_line_reader(tmp_path, llama_dir):
    """U+2028, U+2029 and NEL are legal unescaped in JSON, and line readers such as Python's
    str.splitlines split on them: the response lines escape them."""
    import json

    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"w{i} \u2028 w \u2029 w \x85 w", "max_tokens": 2, "temperature": 0}}
             for i in range(3)]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    config = write_config(tmp_path, llama_dir, {"path": str(data)}, GEN, output={"format": "openai"})
    assert run_job(config).returncode == 0
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((tmp_path / "out").glob("part-*.jsonl")))
    records = [json.loads(line) for line in text.splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["c0", "c1", "c2"]
    assert all(r["error"] is None for r in records)
