"""Prefix-aware admission (``admission_order="prefix"``, the default) and duplicate requests
computed once: results equal input-order admission, in ``LLM.generate`` and in jobs, while the
prefix cache is found far more often in a pool too small for every prefix at once."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.engine.admission import PrefixWindow, PromptBlockCounter, duplicate_key, prefix_order
from batchgen.job.preflight import load_job_config
from batchgen.job.runner import JobRunner
from tests.job.helpers import read_output, write_config

_rng = random.Random(16)
TEMPLATES = [[_rng.randrange(3, 384) for _ in range(48)] for _ in range(4)]  # three blocks of 16 each


def shuffled_prompts(rows: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [TEMPLATES[i % 4] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 12))] for i in range(rows)]
    prompts[5] = list(prompts[2])  # an exact duplicate
    prompts[9] = [7, 8, 9]  # no full block
    rng.shuffle(prompts)
    return prompts


# A pool of 12 blocks of 16: one template (3 blocks) and a few rows' own blocks, not all four.
SMALL_POOL = dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=12, max_num_seqs=4)

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    "seeded": SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=6, seed=5, ignore_eos=True),
    "beam": BeamSearchParams(beam_width=2, max_tokens=5),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_generate_in_prefix_order_equals_input_order(llama_dir, kind):
    prompts = shuffled_prompts(24, seed=1)
    runs = {}
    for order in ("input", "prefix"):
        llm = LLM(llama_dir, admission_order=order, debug_checks=True, **SMALL_POOL)
        outs = llm.generate(prompts, PARAMS[kind])
        runs[order] = (outs, llm.stats())
    for a, b in zip(runs["input"][0], runs["prefix"][0]):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            if kind == "beam":
                assert abs(x.score - y.score) < 1e-4
            else:
                assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-4
    computed = {order: stats["prompt_tokens_computed"] for order, (_, stats) in runs.items()}
    assert computed["prefix"] < 0.6 * computed["input"], computed
    assert runs["prefix"][1]["duplicate_requests_merged"] == 1  # deterministic in every kind here
    assert runs["input"][1]["duplicate_requests_merged"] == 0


def test_unseeded_sampling_duplicates_are_not_merged(llama_dir):
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    prompt = TEMPLATES[0] + [5, 6]
    outs = llm.generate([prompt, prompt], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert llm.stats()["duplicate_requests_merged"] == 0
    outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs})  # each its own id
    assert llm.stats()["duplicate_requests_merged"] == 1


def test_duplicate_keys_and_orders():
    greedy = SamplingParams(temperature=0, seed=1)
    assert duplicate_key([1, 2], greedy) == duplicate_key([1, 2], SamplingParams(temperature=0, seed=2))
    assert duplicate_key([1, 2], SamplingParams()) is None  # unseeded sampling: each its own draw
    assert duplicate_key([1], SamplingParams(seed=3)) != duplicate_key([1], SamplingParams(seed=4))
    assert duplicate_key([1], BeamSearchParams(beam_width=2)) is not None
    a, b = [1] * 16 + [2], [3] * 16 + [4]
    # rows without a full block or with an unshared first block keep their place; a group gathers
    # where it first appears, deeper shared blocks adjacent
    prompts = [a, [9], b, a[:16] + [5] * 16 + [1], [8], a[:16] + [6] * 16, a[:16] + [5] * 16 + [2]]
    assert prefix_order(prompts, 16) == [0, 3, 6, 5, 1, 2, 4]
    counter = PromptBlockCounter(16)
    for p in prompts:
        counter.add(p)
    # distinct full blocks: a's first, b's, [5]*16 after a, [6]*16 after a; partial tails 1+1+1+1+1+1
    assert counter.tokens == 4 * 16 + 6


def test_window_drains_a_prefix_and_never_starves_a_row():
    window: PrefixWindow[str] = PrefixWindow(block_size=4, capacity=6, is_cached=lambda h: False)
    x, y = [1, 1, 1, 1], [2, 2, 2, 2]
    for name, ids in [("x1", x + [7]), ("y1", y), ("lone", [5]), ("x2", x + [8]), ("y2", y + y), ("x3", x)]:
        window.add(name, ids)
    first = window.pop()
    assert first in ("x1", "x2", "x3")  # the largest group
    assert {window.pop(), window.pop()} == {"x1", "x2", "x3"} - {first}  # drained before another
    assert window.pop() in ("y1", "y2") and window.pop() in ("y1", "y2")
    assert window.pop() == "lone" and len(window) == 0
    # a row of no group waits at most ``capacity`` admissions while a group keeps arriving
    window.add("lone", [5])
    popped = []
    for i in range(20):
        window.add(f"x{i}", x + [i])
        popped.append(window.pop())
    assert "lone" in popped[:7]


@pytest.mark.parametrize(
    "generation",
    [
        {"temperature": 0, "max_tokens": 6},
        {"beam_width": 2, "max_tokens": 5},
        {"n": 2, "temperature": 1.0, "max_tokens": 6, "seed": 3},
    ],
    ids=["greedy", "beam", "sampled"],
)
def test_job_in_prefix_order_equals_input_order_and_reports_sharing(tmp_path, llama_dir, generation):
    """Text rows of four shuffled few-shot templates with bad rows and duplicates: the same rows
    with either order; prefix order computes far fewer prompt tokens (within 1.5x of each distinct
    block once). Deterministic duplicates are computed once and counted; sampled ones (a job seeds
    each row) are not merged and get their own completions."""
    rng = random.Random(3)
    words = ["cat", "dog", "the", "a", "fox", "sat", "on", "mat", "two", "plus"]
    templates = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(4)]
    rows = [{"id": i, "prompt": templates[i % 4] + " " + rng.choice(words) + " " + str(i)} for i in range(40)]
    rows[7]["prompt"] = ""  # a bad row
    rows[11]["prompt"] = rows[3]["prompt"]  # duplicates of a row
    rows[15]["prompt"] = rows[3]["prompt"]
    rng.shuffle(rows)
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    spec = {"path": str(data), "prompt_column": "prompt", "id_column": "id"}
    results, reports = {}, {}
    for order in ("input", "prefix"):
        work = tmp_path / order
        work.mkdir()
        engine = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 256, "num_kv_blocks": 16}
        config = write_config(work, llama_dir, spec, generation, engine={**engine, "admission_order": order})
        reports[order] = JobRunner(load_job_config(config)).run()
        results[order] = {r["id"]: r for r in read_output(work / "out")}
    assert sorted(results["prefix"]) == list(range(40))
    for rid, row in results["input"].items():
        other = results["prefix"][rid]
        assert row["error"] == other["error"]
        assert [c["token_ids"] for c in row["completions"] or []] == [
            c["token_ids"] for c in other["completions"] or []
        ], rid
    fast, slow = reports["prefix"].to_dict(), reports["input"].to_dict()
    sampled = "n" in generation
    same = results["prefix"][11]["completions"] == results["prefix"][3]["completions"]
    assert same != sampled
    assert fast["rows_deduplicated"] == (0 if sampled else 2) and slow["rows_deduplicated"] == 0
    assert fast["prompt_tokens_computed"] < 0.5 * slow["prompt_tokens_computed"], (fast, slow)
    assert fast["prompt_tokens_computed"] <= 1.5 * fast["prompt_tokens_perfect_order"]
    assert fast["prefix_cache_hit_rate"] > slow["prefix_cache_hit_rate"]
    assert "prompt tokens computed" in reports["prefix"].render()
