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


def test_printed_outputs_show_the_logprobs_as_vllm_prints_them(llm):
    """``print(request_output)`` (vLLM's ``llm_engine_example.py`` shows log-probabilities so): the
    lists of ``{token_id: Logprob(logprob=..., rank=..., decoded_token=...)}`` dicts, None first for
    the prompt's, built here from the values one by one."""
    from batchgen import Logprob

    tok = llm.get_tokenizer()
    prompt = tok("the cat sat")["input_ids"]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1))[0]

    def vllm_dict(d):
        return {t: Logprob(float(v), v.rank, tok.decode([t])) for t, v in d.items()}

    prompt_lists = [None] + [vllm_dict(d) for d in list(out.prompt_logprobs)[1:]]
    token_lists = [vllm_dict(d) for d in out.outputs[0].logprobs]
    assert repr(out.prompt_logprobs) == repr(prompt_lists)
    assert repr(out.outputs[0].logprobs) == repr(token_lists)
    printed = str(out)
    assert f"prompt_logprobs={prompt_lists!r}" in printed and f"logprobs={token_lists!r}" in printed
    assert "Logprob(logprob=" in printed and "TokenLogprobs(" not in printed


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


# -- vLLM's offline scripts, each as its example uses it, with only the import changed -------------


def test_engine_args_mirror_the_engine_config():
    """Every ``EngineConfig`` field is an ``EngineArgs`` field with the same default, so
    ``LLM(**asdict(EngineArgs(model=...)))`` is ``LLM(model)``."""
    from dataclasses import MISSING, fields

    from batchgen import EngineArgs
    from batchgen.config import EngineConfig

    args = {f.name: f.default for f in fields(EngineArgs)}
    for f in fields(EngineConfig):
        if f.name != "model":
            assert f.name in args and args[f.name] == f.default, f.name
            assert f.default is not MISSING


def test_generate_example_with_cli_engine_args(llama_dir):
    """vLLM's ``basic/generate.py``: EngineArgs.add_cli_args on an argument group, LLM(**vars(args)),
    get_default_sampling_params mutated in place; underscores and dashes both parse."""
    from batchgen import EngineArgs, FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(group)
    group.set_defaults(model=llama_dir)
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    args: dict = vars(
        parser.parse_args(
            ["--max_tokens", "4", "--temperature", "0", "--num-kv-blocks", "40", "--block_size", "8",
             "--no-enable-prefix-caching", "--dtype", "float32", "--disable-log-stats", "--max-model-len", "200"]
        )
    )
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    llm = LLM(**args)
    assert (llm.config.num_kv_blocks, llm.config.block_size, llm.config.enable_prefix_caching) == (40, 8, False)
    assert llm.config.max_model_len == 200 and llm.config.dtype == "float32"
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature = max_tokens, temperature
    outs = llm.generate(["Hello, my name is", "The capital of France is"], params)
    want = llm.generate(["Hello, my name is", "The capital of France is"],
                        SamplingParams(max_tokens=4, temperature=0))
    assert ids_of(outs) == ids_of(want) and all(len(o.outputs[0].token_ids) <= 4 for o in outs)
    assert EngineArgs.add_cli_args(FlexibleArgumentParser()) is not None  # returns the parser, as vLLM's


def test_llm_engine_example(llama_dir):
    """vLLM's ``llm_engine_example.py``: EngineArgs.from_cli_args, LLMEngine.from_engine_args, one
    request added per step, ``finished`` outputs. Each equals the same request through LLM.generate."""
    from batchgen import EngineArgs, FlexibleArgumentParser, LLMEngine

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", llama_dir, "--dtype", "float32", "--num-kv-blocks", "64"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    test_prompts = [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=5)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=5, seed=1)),
        ({"prompt": "What is the meaning of life?"},
         SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=5, seed=2)),
    ]
    want = LLM(llama_dir, dtype="float32", num_kv_blocks=64).generate(
        [p if isinstance(p, str) else p["prompt"] for p, _ in test_prompts], [sp for _, sp in test_prompts])
    finished = {}
    request_id = 0
    pending = list(test_prompts)
    while pending or engine.has_unfinished_requests():
        if pending:
            prompt, sampling_params = pending.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
    assert sorted(finished) == ["0", "1", "2"]
    assert [[c.token_ids for c in finished[str(i)].outputs] for i in range(3)] == ids_of(want)
    with pytest.raises(ValueError, match="EngineArgs.model is required"):
        LLMEngine.from_engine_args(EngineArgs())


def test_default_sampling_params_come_from_generation_config(llama_dir, tmp_path):
    import shutil

    from transformers import GenerationConfig

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7,
                     repetition_penalty=1.1).save_pretrained(model)
    llm = LLM(str(model), num_kv_blocks=16)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.repetition_penalty) == (0.6, 0.9, 20, 7, 1.1)
    assert LLM(str(model), num_kv_blocks=16, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    other = tmp_path / "gen"
    GenerationConfig(do_sample=True, temperature=0.3).save_pretrained(other)
    assert LLM(str(model), num_kv_blocks=16, generation_config=str(other)).get_default_sampling_params().temperature == 0.3
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(str(model), num_kv_blocks=16, generation_config=str(tmp_path)).get_default_sampling_params()


def test_chat_template_options(llm):
    """``chat_template=``, ``continue_final_message=`` and ``chat_template_kwargs=`` reach the
    template as transformers applies them."""
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
    text = tok.apply_chat_template(conv, tokenize=False, chat_template=template, continue_final_message=True)
    assert text.endswith("Hello th")
    want = llm.generate([tok(text, add_special_tokens=False)["input_ids"]], GREEDY)
    got = llm.chat(conv, GREEDY, chat_template=template, add_generation_prompt=False, continue_final_message=True)
    assert got[0].prompt == text and ids_of(got) == ids_of(want)
    shout = "{{ messages[0]['content'] | upper if loud else messages[0]['content'] }}"
    assert llm.chat(conv[:1], GREEDY, chat_template=shout, chat_template_kwargs={"loud": True})[0].prompt == "HI"
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(conv, GREEDY, continue_final_message=True)


def test_metrics_example(llama_dir):
    """vLLM's ``metrics.py``: every metric is a Counter, Gauge, Vector or Histogram, with the counts
    of the requests that ran."""
    from batchgen.metrics import Counter, Gauge, Histogram, Vector

    llm = LLM(llama_dir, disable_log_stats=False, num_kv_blocks=64)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=0))
    by_name = {}
    for metric in llm.get_metrics():
        assert isinstance(metric, (Counter, Gauge, Vector, Histogram)), metric
        by_name.setdefault(metric.name, []).append(metric)
    assert by_name["vllm:prompt_tokens"][0].value == 12
    assert by_name["vllm:generation_tokens"][0].value == sum(len(o.outputs[0].token_ids) for o in outs) == 18
    assert [m.value for m in by_name["vllm:request_success"]] == [3]
    assert by_name["vllm:request_success"][0].labels["finished_reason"] == "length"
    assert by_name["vllm:prefix_cache_hits"][0].value == llm.stats()["prefix_cache_hit_tokens"]
    assert by_name["vllm:num_requests_running"][0].value == 0 and by_name["vllm:kv_cache_usage_perc"][0].value == 0
    hist = by_name["vllm:request_generation_tokens"][0]
    assert (hist.count, hist.sum, hist.buckets["5"], hist.buckets["10"], hist.buckets["+Inf"]) == (3, 18, 0, 3, 3)


def test_profile_writes_a_torch_trace(llama_dir, tmp_path, monkeypatch):
    import json

    llm = LLM(llama_dir, num_kv_blocks=16, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "p")})
    llm.start_profile()
    llm.generate(["hello"], GREEDY)
    llm.stop_profile()
    traces = list((tmp_path / "p").glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name", "") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    monkeypatch.delenv("BATCHGEN_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="profiling is off"):
        LLM(llama_dir, num_kv_blocks=16).start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    env_llm = LLM(llama_dir, num_kv_blocks=16)
    env_llm.start_profile()
    env_llm.stop_profile()
    assert list((tmp_path / "env").glob("*.pt.trace.json"))


def test_vllm_keywords_ignored_warned_refused(llama_dir, recwarn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the no-effect ones and vLLM's defaults warn about nothing
        LLM(llama_dir, num_kv_blocks=16, disable_log_stats=False, served_model_name="x", max_logprobs=20,
            kv_cache_dtype="auto", enable_chunked_prefill=True, load_format="safetensors")
    with pytest.warns(UserWarning, match="kv_cache_dtype='fp8' is ignored: the KV cache has the model's dtype"):
        LLM(llama_dir, num_kv_blocks=16, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"unknown engine setting 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        LLM(llama_dir, max_num_seq=4)
    with pytest.raises(ValueError, match="engine setting max_loras must be an integer >= 1"):
        LLM(llama_dir, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="already queued or running"):
        engine = LLM(llama_dir, num_kv_blocks=16).engine
        engine.add_request("a", "hello", GREEDY)
        engine.add_request("a", "hello", GREEDY)
