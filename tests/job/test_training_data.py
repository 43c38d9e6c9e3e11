"""Jobs that make training data, each a real job in a process of its own: per-token log-probabilities
(``generation.logprobs`` / ``prompt_logprobs``) written as int32 / float32 Arrow columns and equal
to transformers'; shards cut by the bytes those columns hold; ``task: score`` over a continuation
column (a text, or a list of texts scored together; chat rows scored as the assistant's turn),
equal to transformers and resumed exactly after a SIGKILL; the reasoning split with the chat
template's arguments per job and per row, in Parquet and in the OpenAI batch format."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from tests.api.test_reasoning import R1_TEMPLATE, make_reasoning_model
from tests.job.helpers import killed_after_first_shard_then_rerun, read_output, run_job, write_config
from tests.oracle import hf_model

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@torch.no_grad()
def hf_logsoftmax(path: str, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_columns_equal_transformers(tmp_path, llama_dir):
    prompts = ["the cat sat", "a b c d e f", "on the mat"]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "prompt": prompts}), data)
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                          {**GREEDY, "logprobs": 3, "prompt_logprobs": 2})
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    shard = next((tmp_path / "out").glob("part-*.parquet"))
    schema = pq.read_schema(shard)
    lp_type = schema.field("completions").type.value_type.field("logprobs").type
    assert lp_type.field("token_ids").type == pa.list_(pa.int32())
    assert lp_type.field("logprobs").type == pa.list_(pa.float32())
    assert lp_type.field("top_logprobs").type == pa.list_(pa.list_(pa.float32()))
    assert schema.field("prompt_logprobs").type == lp_type
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for row in read_output(tmp_path / "out"):
        prompt = tok(row["prompt"])["input_ids"]
        c = row["completions"][0]
        want = hf_logsoftmax(llama_dir, prompt + c["token_ids"])
        lp = c["logprobs"]
        assert lp["token_ids"] == c["token_ids"]
        for i, t in enumerate(c["token_ids"]):  # position len(prompt) - 1 + i predicts token i
            row_lp = want[len(prompt) - 1 + i]
            vals, ids = row_lp.topk(3)
            assert abs(lp["logprobs"][i] - float(row_lp[t])) < 1e-4
            assert lp["top_token_ids"][i] == ids.tolist()
            assert torch.allclose(torch.tensor(lp["top_logprobs"][i]), vals, atol=1e-4)
            assert lp["ranks"][i] == int((row_lp > row_lp[t]).sum()) + 1
        plp = row["prompt_logprobs"]
        assert plp["token_ids"] == prompt[1:]
        for j, t in enumerate(prompt[1:]):
            assert abs(plp["logprobs"][j] - float(want[j, t])) < 1e-4
            assert plp["top_token_ids"][j] == want[j].topk(2).indices.tolist()


def test_long_rows_with_top_20_are_cut_into_shards_by_bytes(tmp_path, llama_dir):
    """Rows of 200 tokens with k = 20 (about 70 KB each of log-probabilities) and max_shard_mb 0.5:
    the writer cuts a shard at 0.5 MB, long before rows_per_shard (1000) rows."""
    n = 30
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(n)), "prompt": [f"w{i} the cat" for i in range(n)]}), data)
    config = write_config(tmp_path, llama_dir, {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                          {"temperature": 0, "max_tokens": 200, "ignore_eos": True, "logprobs": 20},
                          output={"max_shard_mb": 0.5})
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    rows = read_output(tmp_path / "out")
    assert len(rows) == n and len(shards) >= 3, len(shards)
    for shard in shards[:-1]:
        assert pq.ParquetFile(shard).metadata.num_rows <= 10
    assert all(len(r["completions"][0]["logprobs"]["top_token_ids"][5]) == 20 for r in rows)


def score_rows():
    return [
        {"id": 0, "prompt": "the cat sat on the", "cands": ["mat", " mat", " hat and a dog"]},
        {"id": 1, "prompt": "a b c", "cands": [" d"]},
        {"id": 2, "prompt": "x", "cands": []},  # bad row: no continuation
        {"id": 3, "prompt": "one two three four five six seven", "cands": [" eight", " nine ten", " 11"]},
    ]


def test_score_job_equals_transformers_and_resumes_after_sigkill(tmp_path, llama_dir):
    rows = score_rows() * 1
    rows += [{"id": 10 + i, "prompt": f"w{i} the cat", "cands": [" sat", " ran away", " is"]} for i in range(24)]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    inp = {"path": str(data), "prompt_column": "prompt", "id_column": "id", "continuation_column": "cands"}
    config = write_config(tmp_path, llama_dir, inp, {"logprobs": 1}, task="score",
                          engine={"dtype": "float32", "max_num_seqs": 2, "max_model_len": 256},
                          output={"rows_per_shard": 3})
    out = tmp_path / "out"
    partial, res, killed = killed_after_first_shard_then_rerun(config, out)
    assert res.returncode == 0, res.stderr
    got = {r["id"]: r for r in read_output(out)}
    assert len(read_output(out)) == len(rows) == len(got), "a row missing or written twice"
    assert 0 < partial < len(rows) or killed == 0
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for row in rows:
        result = got[row["id"]]
        if not row["cands"]:
            assert result["scores"] is None and "continuation_column" not in result["error"]
            assert result["error"].startswith("cands: continuations must be"), result["error"]
            continue
        assert result["error"] is None, result["error"]
        prompt = tok(row["prompt"])["input_ids"]
        assert result["num_prompt_tokens"] == len(prompt)
        for cand, s in zip(row["cands"], result["scores"], strict=True):
            whole = tok(row["prompt"] + cand)["input_ids"]
            assert s["token_ids"] == whole[len(prompt):]
            want = hf_logsoftmax(llama_dir, prompt + s["token_ids"])
            per_token = [float(want[len(prompt) - 1 + i, t]) for i, t in enumerate(s["token_ids"])]
            assert abs(s["logprob"] - sum(per_token)) < 1e-4 and s["num_tokens"] == len(per_token)
            assert s["logprobs"]["logprobs"] == pytest.approx(per_token, abs=1e-4)
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["rows_failed"] >= 0


def test_score_job_chat_rows_score_the_assistant_turn(tmp_path, llama_dir):
    """A chat row's continuation is the assistant's turn after the template's generation prompt;
    one text per row (chosen) and the per-row chat_template_kwargs are taken."""
    conv = [{"role": "user", "content": "hi there"}]
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": conv, "chosen": "hello you"}) + "\n")
    config = write_config(tmp_path, llama_dir, {"path": str(data), "messages_column": "messages",
                                                "continuation_column": "chosen"}, {}, task="score")
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    (row,) = read_output(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    (s,) = row["scores"]
    assert s["token_ids"] == tok(text + "hello you", add_special_tokens=False)["input_ids"][len(prompt):]
    want = hf_logsoftmax(llama_dir, prompt + s["token_ids"])
    assert abs(s["logprob"] - sum(float(want[len(prompt) - 1 + i, t]) for i, t in enumerate(s["token_ids"]))) < 1e-4
    assert "logprobs" not in row["scores"][0]


def test_score_job_config_refusals(tmp_path, llama_dir):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "c": ["b"]}), data)
    inp = {"path": str(data), "prompt_column": "prompt", "continuation_column": "c"}
    res = run_job(write_config(tmp_path, llama_dir, inp, {"temperature": 0}, task="score"))
    assert res.returncode == 2 and "a scoring job takes logprobs, chat_template_kwargs; drop temperature" in res.stderr
    res = run_job(write_config(tmp_path, llama_dir, {**inp, "continuation_column": None}, {}, task="score"))
    assert res.returncode == 2 and "input.continuation_column: required with task: score" in res.stderr
    res = run_job(write_config(tmp_path, llama_dir, inp, {}, task="rank"))
    assert res.returncode == 2 and "task: must be one of generate, score" in res.stderr
    res = run_job(write_config(tmp_path, llama_dir, inp, {"reasoning_parser": "r1"}))
    assert res.returncode == 2 and "reasoning_parser must be one of deepseek_r1, gpt_oss, qwen3" in res.stderr
    res = run_job(write_config(tmp_path, llama_dir, {**inp, "continuation_column": None}, {"thinking_token_budget": 8}))
    assert res.returncode == 2 and "generation.thinking_token_budget: needs generation.reasoning_parser" in res.stderr


def test_reasoning_job_with_template_kwargs_per_job_and_row(tmp_path):
    """deepseek_r1 on an R1-style template: each completion's reasoning and text in their columns;
    a row's chat_template_kwargs reach the template (here a variable the template prints); the
    OpenAI batch output carries reasoning_content as vLLM's server does."""
    template = R1_TEMPLATE.replace("<|Assistant|>", "<|Assistant|>{{ style | default('plain') }}")
    model = make_reasoning_model(tmp_path / "m", template)
    rows = [
        {"id": 0, "messages": [{"role": "user", "content": "the cat"}], "params": None},
        {"id": 1, "messages": [{"role": "user", "content": "the cat"}],
         "params": json.dumps({"chat_template_kwargs": {"style": "brief"}})},
    ]
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    gen = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "thinking_token_budget": 4,
           "reasoning_parser": "deepseek_r1", "chat_template_kwargs": {"style": "long"}}
    inp = {"path": str(data), "messages_column": "messages", "id_column": "id", "params_column": "params"}
    res = run_job(write_config(tmp_path, model, inp, gen))
    assert res.returncode == 0, res.stderr
    got = {r["id"]: r for r in read_output(tmp_path / "out")}
    tok = AutoTokenizer.from_pretrained(model)
    for rid, style in ((0, "long"), (1, "brief")):
        text = tok.apply_chat_template(rows[rid]["messages"], tokenize=False, add_generation_prompt=True, style=style)
        assert got[rid]["num_prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
        c = got[rid]["completions"][0]
        assert c["token_ids"][4] == 385
        assert c["reasoning"] == tok.decode(c["token_ids"][:4], skip_special_tokens=True)
        assert c["text"] == tok.decode(c["token_ids"][5:], skip_special_tokens=True)
    assert got[0]["num_prompt_tokens"] != got[1]["num_prompt_tokens"]

    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": rows[0]["messages"], "max_tokens": 12, "temperature": 0,
                                          "ignore_eos": True, "thinking_token_budget": 4, "logprobs": True,
                                          "top_logprobs": 2}}) + "\n")
    config = write_config(tmp_path, model, {"path": str(batch)}, {"reasoning_parser": "deepseek_r1", "logprobs": 2,
                                                               "chat_template_kwargs": {"style": "long"}},
                          name="openai.yaml", output={"path": str(tmp_path / "oai"), "format": "openai"})
    res = run_job(config)
    assert res.returncode == 0, res.stderr
    line = json.loads(next((tmp_path / "oai").glob("part-*.jsonl")).read_text().splitlines()[0])
    choice = line["response"]["body"]["choices"][0]
    assert choice["message"]["reasoning_content"] == got[0]["completions"][0]["reasoning"]
    content = choice["logprobs"]["content"]
    assert len(content) == 12 and len(content[0]["top_logprobs"]) == 2
