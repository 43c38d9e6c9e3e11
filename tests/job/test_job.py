"""Real jobs in subprocesses: every input format, bad rows, config errors, resume after SIGKILL at
random points (every id exactly once, completions equal to an uninterrupted run), refusal of a
changed config, and the OpenAI batch format in and out."""

from __future__ import annotations

import json
import random
import signal
import time

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from tests.job.helpers import read_output, run_job, start_job, write_config

ROWS = [
    {"id": f"r{i}", "prompt": p, "extra": i}
    for i, p in enumerate(
        [
            "hello world",
            "the cat sat",
            "",
            None,
            "once upon a time there was",
            "x" * 400,
            "two plus two",
            "fox",
        ]
    )
]
BAD = {"r2": "prompt is empty", "r3": "prompt is null", "r5": "max_model_len"}


def check_rows(rows, id_key="id"):
    assert sorted(r[id_key] for r in rows) == sorted(r["id"] for r in ROWS)
    for r in rows:
        if r[id_key] in BAD:
            assert BAD[r[id_key]] in r["error"] and not r["completions"]
        else:
            assert r["error"] is None, r
            assert len(r["completions"]) == 2 and r["num_generated_tokens"] == 2 * 4
            assert r["extra"] == int(r[id_key][1:])
            assert r["num_prompt_tokens"] > 0


GEN = {"n": 2, "temperature": 0.8, "max_tokens": 4, "seed": 0, "ignore_eos": True}


@pytest.mark.parametrize("fmt", ["parquet", "parquet-dir", "parquet-glob", "feather", "jsonl", "hf"])
def test_input_formats_and_bad_rows(tmp_path, llama_dir, fmt):
    table = pa.Table.from_pylist(ROWS)
    if fmt == "parquet":
        path = tmp_path / "in.parquet"
        pq.write_table(table, path)
    elif fmt in ("parquet-dir", "parquet-glob"):
        (tmp_path / "in").mkdir()
        pq.write_table(table.slice(0, 3), tmp_path / "in" / "a.parquet")
        pq.write_table(table.slice(3), tmp_path / "in" / "b.parquet")
        path = tmp_path / "in" if fmt == "parquet-dir" else tmp_path / "in" / "*.parquet"
    elif fmt == "feather":
        path = tmp_path / "in.feather"
        feather.write_feather(table, path)
    elif fmt == "jsonl":
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    else:
        from datasets import Dataset

        path = tmp_path / "hf_ds"
        Dataset.from_list(ROWS).save_to_disk(str(path))
    config = write_config(
        tmp_path, llama_dir, {"path": str(path), "prompt_column": "prompt", "id_column": "id"}, GEN
    )
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    assert "rows ok / failed (this run)  5 / 3" in res.stdout
    check_rows(read_output(tmp_path / "out"))
    manifest = json.loads((tmp_path / "out" / ".batchgen" / "manifest.json").read_text())
    assert sum(manifest["shards"].values()) == len(ROWS) and manifest["fingerprint"]["generation"] == GEN
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["rows_ok"] == 5 and report["rows_failed"] == 3 and report["generated_tokens"] == 40


def test_config_errors_exit_2_with_one_message(tmp_path, llama_dir):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), data)
    config = write_config(
        tmp_path,
        llama_dir,
        {"path": str(data), "prompt_column": "text", "colour": 1},
        {"temperature": -1},
        bogus=3,
    )
    res = run_job(config)
    assert res.returncode == 2
    for needle in (
        "bogus: unknown top-level key",
        "input.colour: unknown key",
        "temperature must be a finite number >= 0",
        "input.prompt_column: column 'text' is not in the data",
    ):
        assert needle in res.stderr, res.stderr
    missing = write_config(
        tmp_path,
        str(tmp_path / "no-model"),
        {"path": str(tmp_path / "nothing.parquet"), "prompt_column": "p"},
        {},
        name="m.yaml",
    )
    res = run_job(missing)
    assert res.returncode == 2 and "does not exist" in res.stderr and "nothing found at" in res.stderr


def _kill_and_resume(tmp_path, config, kills, rng):
    partial = []
    for _ in range(kills):
        proc = start_job(config)
        # wait (as long as the job runs) until this run has written something, then kill it at a
        # random moment
        before = len(list((tmp_path / "out").glob("part-*"))) if (tmp_path / "out").exists() else 0
        while proc.poll() is None:
            if len(list((tmp_path / "out").glob("part-*"))) > before:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))
        still_running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if still_running:
            partial.append(len(read_output(tmp_path / "out")))
    # the kills landed while the job was working, and the shards written survived them
    assert len(partial) == kills and partial == sorted(partial) and partial[-1] < 600, partial
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    return res


@pytest.mark.parametrize(
    "generation",
    [
        {"n": 2, "temperature": 1.0, "top_p": 0.9, "max_tokens": 24, "seed": 7, "ignore_eos": True},
        {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
    ],
    ids=["seeded", "greedy"],
)
def test_sigkill_at_random_points_then_resume(tmp_path, llama_dir, generation):
    """Half the rows start with one of three shared templates (prefix-aware admission reorders
    them), some are exact duplicates (computed once when greedy)."""
    rng = random.Random(hash(str(generation)) & 0xFFFF)
    words = ["cat", "dog", "the", "a", "fox", "sat"]
    templates = [" ".join(rng.choice(words) for _ in range(24)) + " " for _ in range(3)]
    rows = [
        {
            "id": i,
            "prompt": (templates[i % 3] if i % 2 else "")
            + " ".join(rng.choice(words) for _ in range(rng.randint(1, 30))),
        }
        for i in range(600)
    ]
    for i in range(100, 600, 50):
        rows[i + 1]["prompt"] = rows[i]["prompt"]
    rows[17]["prompt"] = ""
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id"}
    out_opts = {"rows_per_shard": 7, "flush_seconds": 0.5}
    slow = {"engine": {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256}}  # long enough to kill
    ref_cfg = write_config(
        tmp_path / "ref" if (tmp_path / "ref").mkdir() is None else tmp_path,
        llama_dir,
        spec,
        generation,
        output=out_opts,
    )
    assert run_job(ref_cfg).returncode == 0
    ref = {r["id"]: r for r in read_output(tmp_path / "ref" / "out")}

    work = tmp_path / "killed"
    work.mkdir()
    config = write_config(work, llama_dir, spec, generation, output=out_opts, **slow)
    res = _kill_and_resume(work, config, kills=3, rng=rng)
    got = read_output(work / "out")
    ids = [r["id"] for r in got]
    assert sorted(ids) == list(range(600)), "every id exactly once"
    assert "resumed" in res.stdout
    for r in got:
        want = ref[r["id"]]["completions"] or []
        have = r["completions"] or []
        # equal tokens and text; log-probabilities equal up to float rounding (batch composition differs)
        assert [(c["token_ids"], c["text"], c["finish_reason"]) for c in have] == [
            (c["token_ids"], c["text"], c["finish_reason"]) for c in want
        ], r["id"]
        for a, b in zip(have, want):
            assert abs(a["cumulative_logprob"] - b["cumulative_logprob"]) < 1e-4
        assert r["error"] == ref[r["id"]]["error"]
    assert ref[17]["error"] == "prompt is empty"


def test_changed_config_is_refused_unless_overwrite(tmp_path, llama_dir):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), data)
    config = write_config(
        tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"}, GEN
    )
    assert run_job(config).returncode == 0
    again = run_job(config)
    assert again.returncode == 0 and "resumed: 8 rows were already done" in again.stdout
    assert len(read_output(tmp_path / "out")) == 8
    res = run_job(config, "--set", "generation.max_tokens=5")
    assert res.returncode == 2 and "generation.max_tokens: 4 -> 5" in res.stderr
    res = run_job(config, "--set", "generation.max_tokens=5", "--overwrite")
    assert res.returncode == 0
    assert all(r["num_generated_tokens"] == 10 for r in read_output(tmp_path / "out") if not r["error"])


def test_messages_column_and_row_overrides(tmp_path, llama_dir):
    rows = [
        {"id": 0, "messages": [{"role": "user", "content": "hi"}], "params": {"max_tokens": 3}},
        {
            "id": 1,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}],
            "params": {"max_tokens": 5},
        },
        {"id": 2, "messages": [], "params": {"max_tokens": 2}},
        {"id": 3, "messages": [{"role": "user", "content": "x"}], "params": {"max_tokens": -1}},
    ]
    data = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = write_config(
        tmp_path,
        llama_dir,
        {"path": str(data), "messages_column": "messages", "id_column": "id", "params_column": "params"},
        {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
    )
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    out = {r["id"]: r for r in read_output(tmp_path / "out")}
    assert out[0]["num_generated_tokens"] == 3 and out[1]["num_generated_tokens"] == 5
    assert "messages must be a non-empty list" in out[2]["error"]
    assert "max_tokens" in out[3]["error"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = tok.apply_chat_template(rows[1]["messages"], tokenize=False, add_generation_prompt=True)
    assert out[1]["num_prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])


def test_openai_batch_format_in_and_out(tmp_path, llama_dir):
    reqs = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hello there", "max_tokens": 3, "temperature": 0},
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 2,
            },
        },
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": ""}},
    ]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    config = write_config(
        tmp_path, llama_dir, {"path": str(data)}, {"ignore_eos": True}, output={"format": "openai"}
    )
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for f in sorted((tmp_path / "out").glob("part-*.jsonl")) for line in f.open()]
    by_id = {x["custom_id"]: x for x in lines}
    assert set(by_id) == {"a", "b", "c"}
    assert by_id["a"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert by_id["a"]["response"]["body"]["object"] == "text_completion"
    assert by_id["b"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert by_id["b"]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert by_id["c"]["response"] is None and "prompt is empty" in by_id["c"]["error"]["message"]
