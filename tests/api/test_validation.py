"""Bad input gets a ValueError naming the parameter and value, before anything enters the engine;
the engine keeps working afterwards."""

from __future__ import annotations

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "n must be"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(tempreature=1.0), "unknown sampling parameter 'tempreature'.*temperature"),
        (dict(presence_penalty=3.0), "presence_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_any_work(llm):
    ok = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], ok)
    with pytest.raises(ValueError, match="prompt 0: .*token id 99999 is outside the vocabulary"):
        llm.generate([[1, 99999]], ok)
    with pytest.raises(ValueError, match="prompt 0: prompt has 80 tokens; .*max_model_len.* is 64"):
        llm.generate([[5] * 80], ok)
    with pytest.raises(ValueError, match="prompt 0: prompt is empty"):
        llm.generate([[]], ok)
    with pytest.raises(ValueError, match="stop_token_ids has token id 5000"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="2 parameter sets for 1 prompts"):
        llm.generate(["a"], [ok, ok])
    assert not llm.engine.has_unfinished()
    # the engine still works
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_generation_stops_at_the_model_context(llm):
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_unknown_engine_setting(llama_dir):
    with pytest.raises(ValueError, match="unknown engine setting 'blok_size'"):
        LLM(llama_dir, blok_size=16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(llama_dir, block_size=12)


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("preemption_mode", "swapp", "one of auto, recompute, swap"),
        ("swap_space_gb", 0, "> 0"),
        ("linear_backend", "mkl", "one of auto, cpu, onednn, torch"),
        ("block_size", 12, "one of 8, 16, 32, 64, 128"),
    ],
)
def test_bad_engine_settings_name_the_setting(llama_dir, key, value, rule):
    with pytest.raises(ValueError, match=f"engine setting {key} must be {rule}, got {value!r}"):
        LLM(llama_dir, **{key: value})


def test_a_host_pool_that_cannot_be_allocated_names_the_setting(llama_dir):
    with pytest.raises(ValueError, match=r"swap_space_gb=1000000000\.0: cannot allocate the host pool"):
        LLM(llama_dir, preemption_mode="swap", swap_space_gb=1e9)


def test_a_request_that_slips_past_validation_fails_alone_and_the_engine_stays_usable(llama_dir, monkeypatch):
    """Validation keeps requests that cannot fit out; if one gets in anyway, it alone gets an error
    (no RuntimeError mid-run, no endless empty steps), the rest of the call completes, and later
    calls work."""
    llm = LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=2)
    alone = llm.generate([[7, 8, 9]], params)[0].outputs[0].token_ids
    monkeypatch.setattr(llm.engine, "validate", lambda ids, params: None)
    big, small = llm.generate([[5] * 60, [7, 8, 9]], params)
    assert "cannot be scheduled in a pool of 4 KV blocks" in big.error and not big.outputs
    assert small.error is None and small.outputs[0].token_ids == alone
    monkeypatch.undo()
    assert llm.generate([[7, 8, 9]], params)[0].outputs[0].token_ids == alone
    assert llm.engine.bm.num_free_blocks == 4


@pytest.mark.parametrize("params", [
    SamplingParams(n=4, max_tokens=18, ignore_eos=True),
    SamplingParams(n=3, max_tokens=9, ignore_eos=True),
    BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=True),
])
@pytest.mark.parametrize("prompt_len", [16, 21])
def test_the_pool_a_request_needs_alone_is_exact(llama_dir, params, prompt_len):
    """A pool of exactly the need stated by validation runs the request (n samples reach it); one
    block less is refused before anything runs, with a message naming the need and the pool."""
    probe = LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=256, block_size=8)
    need = probe.engine.blocks_needed_alone(prompt_len, params)
    prompt = [(5 * i) % 300 + 3 for i in range(prompt_len)]
    llm = LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=need, block_size=8, debug_checks=True)
    out = llm.generate([prompt], params)[0]
    assert out.error is None and len(out.outputs) == params.group_size
    assert llm.stats()["num_preemptions"] == 0
    # samples each hold their own tail at the end; beams may still share part of theirs
    peak = llm.stats()["peak_blocks_used"]
    assert peak == need if isinstance(params, SamplingParams) else peak <= need
    small = LLM(llama_dir, dtype="float32", device="cpu", num_kv_blocks=need - 1, block_size=8)
    with pytest.raises(ValueError, match=rf"prompt 0: request needs {need} KV blocks .* the pool has {need - 1}"):
        small.generate([prompt], params)
