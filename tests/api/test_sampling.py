"""Sampling: log-probabilities against transformers, n > 1 forks, seeds independent of the batch,
truncation (top-k / top-p / min-p), penalties, stop conditions and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.oracle import hf_greedy, hf_logprob, hf_model

_rng = random.Random(1)
PROMPTS = [[_rng.randrange(3, 384) for _ in range(n)] for n in (3, 17, 40)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", device="cpu", debug_checks=True, seed=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_n4_cumulative_logprob_matches_transformers_and_siblings_differ(model_dirs, arch):
    path = model_dirs[arch]
    llm = LLM(path, dtype="float32", device="cpu", debug_checks=True, num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=3))
    for prompt, out in zip(PROMPTS, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        seqs = [tuple(c.token_ids) for c in out.outputs]
        assert len(set(seqs)) > 1, "siblings should differ"
        for c in out.outputs:
            assert abs(c.cumulative_logprob - hf_logprob(path, prompt, c.token_ids)) < 1e-3
    stats = llm.stats()
    # the prompt was prefilled once and forked: copies happen only for the shared partial block
    assert stats["cow_copies"] > 0
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


def test_seeded_request_is_independent_of_the_batch(llm):
    target = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], target)[0].outputs[0].token_ids
    others = [[_rng.randrange(3, 384) for _ in range(_rng.randrange(1, 60))] for _ in range(64)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=_rng.randrange(1, 20), n=_rng.choice([1, 2]))
        for _ in others
    ]
    outs = llm.generate(others[:30] + [PROMPTS[1]] + others[30:], params[:30] + [target] + params[30:])
    assert outs[30].outputs[0].token_ids == alone
    # and again under preemption pressure with a small pool
    small = LLM(llm.config.model, dtype="float32", device="cpu", num_kv_blocks=24, block_size=8)
    outs = small.generate(others[:30] + [PROMPTS[1]] + others[30:], params[:30] + [target] + params[30:])
    assert small.stats()["num_preemptions"] > 0
    assert outs[30].outputs[0].token_ids == alone
    # and with swap preemption: every request's tokens equal the recompute run's
    swap = LLM(
        llm.config.model,
        dtype="float32",
        device="cpu",
        num_kv_blocks=24,
        block_size=8,
        preemption_mode="swap",
        swap_space_gb=0.01,
        debug_checks=True,
    )
    seeded = [
        p if p.seed is not None else SamplingParams(temperature=1.0, max_tokens=p.max_tokens, n=p.n, seed=i)
        for i, p in enumerate(params[:30] + [target] + params[30:])
    ]
    ref = small.generate(others[:30] + [PROMPTS[1]] + others[30:], seeded)
    got = swap.generate(others[:30] + [PROMPTS[1]] + others[30:], seeded)
    assert swap.stats()["num_swap_outs"] > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert swap.engine.bm.num_free_blocks == swap.engine.bm.num_blocks


def test_unseeded_requests_differ_and_seeds_differ(llm):
    a = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert a[0].outputs[0].token_ids != a[1].outputs[0].token_ids
    s1 = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=12, seed=1, ignore_eos=True))
    s2 = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=12, seed=2, ignore_eos=True))
    assert s1[0].outputs[0].token_ids != s2[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "params",
    [
        dict(top_k=1),
        dict(top_p=1e-6),
        dict(min_p=1.0),
    ],
)
def test_truncation_to_one_token_is_greedy(llm, llama_dir, params):
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, **params))
    for prompt, o in zip(PROMPTS, out):
        assert o.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 8)


def test_sampled_frequencies_follow_the_model_distribution(llm, llama_dir):
    prompt = PROMPTS[0]
    with torch.no_grad():
        probs = torch.softmax(hf_model(llama_dir)(torch.tensor([prompt])).logits[0, -1] / 1.5, -1)
    n = 600
    out = llm.generate([prompt], SamplingParams(n=n, temperature=1.5, max_tokens=1, ignore_eos=True, seed=0))[
        0
    ]
    counts = torch.bincount(
        torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=probs.shape[0]
    ).float()
    top = probs.topk(3).indices
    for t in top:
        p = float(probs[t])
        assert abs(counts[t] / n - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3


def test_top_k_samples_only_from_the_top_k(llm, llama_dir):
    prompt = PROMPTS[2]
    with torch.no_grad():
        top3 = set(hf_model(llama_dir)(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    out = llm.generate([prompt], SamplingParams(n=50, temperature=5.0, top_k=3, max_tokens=1, seed=1))[0]
    firsts = {c.token_ids[0] for c in out.outputs}
    assert firsts <= top3 and len(firsts) > 1


def test_repetition_penalty_matches_transformers(llm, llama_dir):
    model = hf_model(llama_dir)
    for prompt in PROMPTS:
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        got = (
            llm.generate(
                [prompt],
                SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8, ignore_eos=True),
            )[0]
            .outputs[0]
            .token_ids
        )
        assert got == ref


@torch.no_grad()
def test_presence_and_frequency_penalties_follow_their_definition(llm, llama_dir):
    model = hf_model(llama_dir)
    prompt = PROMPTS[1]
    ids: list[int] = []
    for _ in range(10):
        logits = model(torch.tensor([prompt + ids])).logits[0, -1].clone()
        for t in set(ids):
            logits[t] -= 0.7 * ids.count(t) + 1.1
        ids.append(int(logits.argmax()))
    got = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=10, frequency_penalty=0.7, presence_penalty=1.1, ignore_eos=True
        ),
    )[0].outputs[0]
    assert got.token_ids == ids


def test_stop_token_ids_min_tokens_and_eos(llm, llama_dir):
    prompt = PROMPTS[1]
    ref = hf_greedy(llama_dir, prompt, 12)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[
        0
    ].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_tok])
    )[0].outputs[0]
    assert len(out.token_ids) == 12 and stop_tok not in out.token_ids
    # EOS ends a completion and is kept in token_ids (vLLM), unless ignore_eos
    eos_prompt = None
    for p in ([_rng.randrange(3, 384) for _ in range(8)] for _ in range(200)):
        r = hf_greedy(llama_dir, p, 12)
        if 2 in r:
            eos_prompt, eos_ref = p, r
            break
    assert eos_prompt is not None
    out = llm.generate([eos_prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == eos_ref[: eos_ref.index(2) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_stop_strings(llm, llama_dir):
    prompt = PROMPTS[2]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    kept = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=16, stop=stop, ignore_eos=True, include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_logprobs_are_the_raw_model_distribution(llm, llama_dir):
    prompt = PROMPTS[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.8, max_tokens=4, logprobs=3, seed=5, ignore_eos=True)
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(llama_dir)(torch.tensor([prompt + out.token_ids])).logits[0], -1)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(prompt) - 1 + i]
        assert tok in entry and abs(entry[tok] - float(row[tok])) < 1e-4
        top = row.topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-4
    assert abs(sum(out.logprobs[i][t] for i, t in enumerate(out.token_ids)) - out.cumulative_logprob) < 1e-4


def test_unused_slot_statistic_equals_a_count_over_every_held_block(llama_dir):
    """``unused_slots_in_held_blocks_at_peak`` is computed from each sequence's tail blocks only;
    it must equal the count over every slot of every held block (n=3 siblings share blocks, one
    request hits another's cached prefix)."""
    llm = LLM(llama_dir, dtype="float32", device="cpu", block_size=8)
    eng = llm.engine
    prefix = [random.Random(5).randrange(3, 384) for _ in range(19)]
    eng.add_request("a", prefix, SamplingParams(n=3, max_tokens=30, ignore_eos=True, seed=1))
    eng.add_request("b", prefix[:16] + [4, 5], SamplingParams(max_tokens=30, ignore_eos=True, seed=2))
    for step in range(12):
        eng.step()
        live = [s for g in eng.scheduler.running for s in g.seqs if s.status.name != "FINISHED"]
        fill: dict[int, int] = {}
        for s in live:
            for i, b in enumerate(eng.bm.table(s.seq_id)):
                fill[b] = max(fill.get(b, 0), min(8, s.num_computed_tokens - i * 8))
        brute = eng.bm.num_used_blocks * 8 - sum(max(f, 0) for f in fill.values())
        eng._stats.values["peak_physical_kv_slots"] = 0  # force the statistic to be taken now
        eng._stats.note_kv_usage(live, eng.bm)
        assert eng._stats.values["unused_slots_in_held_blocks_at_peak"] == brute, step
