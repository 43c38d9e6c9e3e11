"""Habits of vLLM's offline ``LLM`` that batchgen accepts with vLLM's names and shapes:
``sampling_params=``, prompt dicts, ``chat``, ``beam_search``, ``get_tokenizer``, and the engine
keywords that map onto batchgen's (with clear refusals for those that do not)."""

from __future__ import annotations

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=128)


def ids_of(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_sampling_params_keyword_and_prompt_dicts(llm):
    want = llm.generate(["the cat", [5, 6, 7]], GREEDY)
    got = llm.generate([{"prompt": "the cat"}, {"prompt_token_ids": [5, 6, 7]}], sampling_params=GREEDY)
    assert ids_of(got) == ids_of(want)
    assert llm.generate({"prompt": "the cat"}, sampling_params=GREEDY)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="params or sampling_params"):
        llm.generate(["x"], GREEDY, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "x"}], GREEDY)
    assert llm.get_tokenizer() is llm.tokenizer


def test_chat_applies_the_template(llm):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    want = llm.generate([tok(text, add_special_tokens=False)["input_ids"]], GREEDY)
    one = llm.chat(conv, GREEDY)
    both = llm.chat([conv, [{"role": "user", "content": "yo"}]], GREEDY)
    assert ids_of(one) == ids_of(want) == ids_of(both[:1]) and one[0].prompt == text
    assert len(both) == 2 and both[1].outputs[0].token_ids


def test_beam_search_has_vllms_shape(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    want = llm.generate(["the quick brown fox"], params)[0]
    got = llm.beam_search(["the quick brown fox"], params)[0]
    assert [s.tokens for s in got.sequences] == [want.prompt_token_ids + c.token_ids for c in want.outputs]
    assert [s.score for s in got.sequences] == [c.score for c in want.outputs]
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(["x"], GREEDY)


def test_vllm_engine_keywords(llama_dir):
    llm = LLM(llama_dir, swap_space=0.5, enforce_eager=True, tokenizer=llama_dir, tensor_parallel_size=1,
              trust_remote_code=False, num_kv_blocks=16)
    assert llm.config.swap_space_gb == 0.5 and llm.config.cuda_graphs is False and llm.config.tokenizer is None
    with pytest.raises(ValueError, match="tensor_parallel_size=2: batchgen runs one engine per device"):
        LLM(llama_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        LLM(llama_dir, trust_remote_code=True)


def test_logprobs_are_vllm_logprob_objects(llm, llama_dir):
    import torch

    from batchgen import Logprob
    from tests.oracle import hf_model

    prompt = llm.get_tokenizer()("the cat sat")["input_ids"]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4, seed=3, logprobs=3))[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(llama_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    tok = llm.get_tokenizer()
    for step, (tid, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = logits[len(prompt) - 1 + step]
        sampled = d[tid]
        assert isinstance(sampled, Logprob) and sampled.logprob == float(sampled)
        assert sampled.rank == int((row > row[tid]).sum()) + 1
        top = sorted((v for t, v in d.items() if v.rank <= 3), key=lambda v: v.rank)
        assert [v.rank for v in top][:3] == [1, 2, 3][: len(top)] and all(a >= b for a, b in zip(top, top[1:]))
        assert all(v.decoded_token == tok.decode([t]) for t, v in d.items())


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=5, num_kv_blocks=6, block_size=8)],
                         ids=["whole", "chunked-and-preempted"])
def test_prompt_logprobs_match_a_transformers_forward_pass(llama_dir, engine):
    """Every prompt token's log-probability (and its rank, and the top 2) as transformers gives
    them, also when the prompt is prefilled in chunks of 5 tokens under preemption, and when a
    request with the same prefix ran before (no prefix-cache hit may skip a position)."""
    import torch

    from tests.oracle import hf_model

    llm = LLM(llama_dir, dtype="float32", device="cpu", debug_checks=True, **engine)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (23, 17, 30)]
    llm.generate([prompts[0]], GREEDY)  # caches the first prompt's blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, [params, params, GREEDY])
    assert outs[2].prompt_logprobs is None
    for prompt, out in zip(prompts[:2], outs[:2], strict=True):
        with torch.no_grad():
            logits = hf_model(llama_dir)(torch.tensor([prompt])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            entry = out.prompt_logprobs[t]
            assert abs(entry[prompt[t]] - float(logp[t - 1, prompt[t]])) < 1e-4, t
            assert entry[prompt[t]].rank == int((logits[t - 1] > logits[t - 1, prompt[t]]).sum()) + 1
            best = logp[t - 1].topk(2).indices.tolist()
            assert all(b in entry and entry[b].rank == r + 1 for r, b in enumerate(best)), t
    if "num_kv_blocks" in engine:
        assert llm.stats()["num_preemptions"] > 0
