"""The job command as a user meets it: config mistakes are config errors (exit 2, one message, no
traceback), an empty or mistyped input is named, a job whose rows mostly failed exits 1 with its
failures grouped by message, and ``--version``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.job.helpers import ROOT, run_job, write_config

GEN = {"temperature": 0, "max_tokens": 2}


def parquet(tmp_path, rows, name="in.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_bad_set_values_and_unknown_keys_are_config_errors(tmp_path, llama_dir):
    data = parquet(tmp_path, [{"prompt": "the cat"}])
    config = write_config(tmp_path, llama_dir, {"path": data, "prompt_colum": "prompt"}, GEN, output={"pth": 1})
    res = run_job(config, "--set", "input.batch_rows=abc")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    for needle in (
        "input.batch_rows: wrong type str",
        "input.prompt_colum: unknown key (did you mean 'prompt_column'?)",
        "output.pth: unknown key (did you mean 'path'?)",
    ):
        assert needle in res.stderr, res.stderr
    res = run_job(config, "--set", "generation.tempreture=1", "--set", "generation.topp=0.9")
    assert res.returncode == 2 and "unknown sampling parameters 'tempreture' (did you mean 'temperature'?)" in res.stderr
    assert "'topp' (did you mean 'top_p'?)" in res.stderr, res.stderr
    res = run_job(config, "--set", "generation.stop=[unclosed")
    assert res.returncode == 2 and "not valid YAML" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_an_empty_input_and_a_prompt_column_that_is_not_text_are_named(tmp_path, llama_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = write_config(tmp_path, llama_dir, {"path": str(empty), "prompt_column": "text"}, GEN)
    res = run_job(config)
    assert res.returncode == 2 and "holds no rows (the input is empty)" in res.stderr, res.stderr
    ints = parquet(tmp_path, [{"prompt": 1}, {"prompt": 2}], "ints.parquet")
    config = write_config(tmp_path, llama_dir, {"path": ints, "prompt_column": "prompt"}, GEN, name="i.yaml")
    res = run_job(config)
    assert res.returncode == 2 and "column 'prompt' holds int64, not text" in res.stderr, res.stderr


def test_a_job_whose_rows_mostly_failed_exits_1_with_errors_grouped(tmp_path, llama_dir):
    rows = [{"id": i, "prompt": "" if i % 4 else "the cat"} for i in range(8)]
    config = write_config(tmp_path, llama_dir, {"path": parquet(tmp_path, rows), "prompt_column": "prompt",
                                                "id_column": "id"}, GEN)
    res = run_job(config)
    assert res.returncode == 1, res.stderr
    assert "6 of 8 rows failed, more than run.max_failed_fraction (0.5)" in res.stderr
    assert "failed x 6" in res.stdout and "prompt is empty" in res.stdout
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["errors"] == {"prompt is empty": 6}
    # a higher limit lets the same output pass
    res = run_job(config, "--set", "run.max_failed_fraction=0.9")
    assert res.returncode == 0, res.stderr


def test_job_help_lists_the_config_keys():
    res = subprocess.run([sys.executable, "-m", "batchgen", "job", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0
    for needle in ("input:", "prompt_column", "output:", "rows_per_shard", "run:", "max_failed_fraction", "engine:",
                   "storage", "endpoint_url", "lease_seconds"):
        assert needle in res.stdout, res.stdout


def test_version():
    res = subprocess.run([sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    from batchgen import __version__

    assert res.returncode == 0 and res.stdout.strip() == f"batchgen {__version__}", res


def test_the_output_reads_as_one_dataset_with_each_reader(tmp_path, llama_dir):
    rows = [{"id": i, "prompt": "the cat" if i % 3 else ""} for i in range(9)]
    config = write_config(tmp_path, llama_dir, {"path": parquet(tmp_path, rows), "prompt_column": "prompt",
                                                "id_column": "id"}, GEN, output={"rows_per_shard": 4})
    assert run_job(config).returncode == 0
    out = tmp_path / "out"
    import datasets
    import pandas as pd
    import pyarrow.dataset as pads

    ds = datasets.load_dataset("parquet", data_dir=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert sorted(ds["id"]) == list(range(9))
    assert sorted(pd.read_parquet(out)["id"]) == list(range(9))
    assert pads.dataset(out, format="parquet").count_rows() == 9


def test_a_failed_start_leaves_no_manifest_and_the_corrected_run_goes_ahead(tmp_path, llama_dir):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((Path(llama_dir) / name).read_bytes())
    config = write_config(tmp_path, str(broken), {"path": parquet(tmp_path, [{"prompt": "the cat"}]),
                                                  "prompt_column": "prompt"}, GEN)
    res = run_job(config)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out" / ".batchgen" / "manifest.json").exists()
    res = run_job(config, "--set", f"model={llama_dir}")
    assert res.returncode == 0, res.stderr


def test_jsonl_output_schema_comes_from_every_line_of_the_input(tmp_path, llama_dir):
    """A malformed first line, a key that only a later line has, and a column whose values
    disagree in type: every shard has the same schema, with every input column and the id typed
    as in the input, and a rerun adds nothing."""
    import pandas as pd

    lines = ["{broken", json.dumps({"id": 1, "prompt": "the cat", "tag": 5})]
    lines += [json.dumps({"id": i, "prompt": "a dog", "tag": "x"}) for i in range(2, 6)]
    lines += [json.dumps({"id": 6, "prompt": "fox", "late": True, "tag": 7})]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                          GEN, output={"rows_per_shard": 2})
    assert run_job(config).returncode == 0
    out = tmp_path / "out"
    schemas = {pq.read_schema(p).to_string() for p in out.glob("part-*.parquet")}
    assert len(schemas) == 1 and len(list(out.glob("part-*.parquet"))) > 1
    table = pd.read_parquet(out)
    assert {"id", "prompt", "tag", "late", "row_index", "error"} <= set(table.columns)
    assert str(table["id"].dtype).startswith(("int", "Int", "float"))
    by_pos = {int(r.row_index): r for r in table.itertuples()}
    assert "invalid JSON" in by_pos[0].error and by_pos[6].late is True and by_pos[1].tag == "5"
    assert run_job(config).returncode == 0 and len(pd.read_parquet(out)) == 7


def test_relative_paths_are_read_from_the_working_directory_and_errors_say_so(tmp_path, llama_dir):
    (tmp_path / "jobs").mkdir()
    data = parquet(tmp_path, [{"prompt": "the cat"}])
    config = write_config(tmp_path / "jobs", "models/tiny", {"path": "data/in.parquet", "prompt_column": "prompt"},
                          GEN)
    res = run_job(config)  # started from the config's folder, where neither path exists
    assert res.returncode == 2
    assert f"model: directory 'models/tiny' does not exist (relative paths are read from the working directory, {tmp_path / 'jobs'})" in res.stderr
    assert "input.path: nothing found at 'data/in.parquet' (relative paths are read" in res.stderr
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(llama_dir)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.parquet").symlink_to(data)
    env_cwd = subprocess.run(
        [sys.executable, "-m", "batchgen", "job", str(config), "--no-progress", "--set", f"output.path={tmp_path / 'o'}"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert env_cwd.returncode == 0, env_cwd.stderr  # the same config from the folder the paths are relative to


def test_the_progress_bar_shows_tokens_rate_and_eta_while_rows_run(tmp_path, llama_dir):
    rows = [{"prompt": "the cat sat on the mat " * (1 + i % 5)} for i in range(48)]
    config = write_config(tmp_path, llama_dir, {"path": parquet(tmp_path, rows), "prompt_column": "prompt"},
                          {"n": 2, "temperature": 1.0, "max_tokens": 48, "seed": 1, "ignore_eos": True},
                          engine={"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256})
    res = subprocess.run([sys.executable, "-m", "batchgen", "job", str(config)], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    frames = res.stderr.replace("\r", "\n").splitlines()
    assert any("in flight" in f and "tok/s" in f and "ETA" in f for f in frames), res.stderr[-2000:]
    # the bar moves before any row finishes: 0 rows done, tokens already generated
    early = [f for f in frames if " 0/48 rows" in f and "in flight" in f]
    assert early and int(re.search(r"(\d+) tokens", early[-1]).group(1)) > 0, frames[:5]
