"""Structured outputs against the oracle: transformers ``generate`` with the same grammar (xgrammar)
as a logits processor. Greedy and beam search (widths 1, 3, 4) under a JSON schema, a regex and a
choice list give the oracle's tokens and scores, also under a tiny pool that preempts (recompute and
swap), with chunked prefill and with prefix caching; sampled completions validate against their
schema where unconstrained ones never do; a seeded constrained request draws the same tokens alone,
in a batch and after preemption; bad specs are refused naming the prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.params import StructuredOutputsParams
from tests.oracle import hf_model

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-c]{2,5}\.(x|yz)"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
}
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
EOS = 2
MAX_NEW = 40


class GrammarProcessor:
    """The oracle's logits processor: each row's matcher rebuilt from its generated tokens (robust
    to beam search reordering its rows), its mask applied to the scores transformers passes: the
    logits in greedy search, the log-probabilities in beam search."""

    def __init__(self, compiled, prompt_len: int) -> None:
        self.compiled, self.prompt_len = compiled, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = xgr.allocate_token_bitmask(input_ids.shape[0], scores.shape[-1])
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            self.fill_row(mask, row, ids)
        xgr.apply_token_bitmask_inplace(scores, mask, vocab_size=scores.shape[-1])
        return scores

    def fill_row(self, mask: torch.Tensor, row: int, ids: list[int]) -> None:
        """Row ``row`` of ``mask``: what the grammar allows after ``ids`` (EOS only once it ended)."""
        matcher = xgr.GrammarMatcher(self.compiled, override_stop_tokens=[EOS])
        for t in ids:
            if matcher.is_terminated():
                break
            assert matcher.accept_token(t), (ids, t)
        if matcher.is_terminated():
            allow_only_token(mask, row, EOS)
        else:
            matcher.fill_next_token_bitmask(mask, row)


def allow_only_token(mask: torch.Tensor, row: int, token: int) -> None:
    mask[row] = 0
    mask[row, token // 32] = 1 << (token % 32)


_ORACLE: dict = {}


def oracle(path: str, llm: LLM, kind: str, prompt: list[int], width: int):
    """transformers' tokens (and beam scores) under ``SPECS[kind]``: greedy for width 0, else beam
    search of that width."""
    key = (path, kind, tuple(prompt), width)
    if key not in _ORACLE:
        compiled = llm.engine.structured.compile(SPECS[kind])
        _ORACLE[key] = hf_generate(path, prompt, width, MAX_NEW, GrammarProcessor(compiled, len(prompt)))
    return _ORACLE[key]


def hf_generate(path: str, prompt: list[int], width: int, max_new: int, processor) -> tuple[list, list]:
    """transformers ``generate`` under ``processor``: greedy for width 0, else beam search of that
    width; (each completion's tokens, each beam's score or None)."""
    from transformers import LogitsProcessorList

    kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=EOS,
                  logits_processor=LogitsProcessorList([processor]), return_dict_in_generate=True, output_scores=True)
    if width:
        kwargs.update(num_beams=width, num_return_sequences=width, length_penalty=1.0, early_stopping=False)
    with torch.no_grad():
        g = hf_model(path).generate(torch.tensor([prompt]), **kwargs)
    seqs = []
    for row in g.sequences[:, len(prompt) :].tolist():
        while len(row) > 1 and row[-1] == EOS and row[-2] == EOS:
            row.pop()  # padding of a finished hypothesis
        seqs.append(row)
    return seqs, (g.sequences_scores.tolist() if width > 1 else [None] * len(seqs))


ENGINES = {
    "roomy": dict(num_kv_blocks=256),
    "recompute": dict(num_kv_blocks=28, block_size=8, preemption_mode="recompute", max_num_batched_tokens=64),
    "swap": dict(num_kv_blocks=28, block_size=8, preemption_mode="swap", swap_space_gb=0.05),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=6),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_and_beams_match_transformers_under_each_grammar(llama_dir, engine):
    llm = LLM(llama_dir, dtype="float32", device="cpu", debug_checks=True, **ENGINES[engine])
    for kind, spec in SPECS.items():
        greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, structured_outputs=spec)
        beams = {w: BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, structured_outputs=spec) for w in (1, 3, 4)}
        # every request of a grammar in one call: they run in the same batches and share prefixes
        requests = [(p, 0, greedy) for p in PROMPTS] + [(p, w, bp) for p in PROMPTS for w, bp in beams.items()]
        outs = llm.generate([p for p, _, _ in requests], [params for _, _, params in requests])
        for (prompt, width, _), out in zip(requests, outs, strict=True):
            want, scores = oracle(llama_dir, llm, kind, prompt, width)
            label = f"{engine} {kind} width {width} prompt of {len(prompt)}"
            assert [c.token_ids for c in out.outputs] == want, label
            for c, s in zip(out.outputs, scores, strict=True):
                assert s is None or abs(c.score - s) < 1e-4, (label, c.score, s)
    stats = llm.stats()
    if engine in ("recompute", "swap"):
        assert stats["num_preemptions"] > 0, stats
    if engine == "swap":
        assert stats["num_swap_outs"] > 0, stats
    assert stats["grammar_compiles"] == 3 and stats["grammar_cache_hits"] > 0


def test_sampled_completions_follow_their_schema(llama_dir):
    """n=4 at temperature 1 on random weights: every completion that stops parses and validates;
    the same requests unconstrained never validate (so the test can tell)."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=256)
    prompts = ["the cat sat", "a dog", "w1 w2 w3", "hello there"]
    constrained = SamplingParams(n=4, temperature=1.0, max_tokens=80, seed=3, structured_outputs=SPECS["json"])
    stopped = 0
    for out in llm.generate(prompts, constrained):
        for c in out.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCHEMA)
                stopped += 1
            assert c.token_ids[-1] == EOS or c.finish_reason == "length"
    assert stopped >= 12
    free = SamplingParams(n=4, temperature=1.0, max_tokens=80, seed=3)
    for out in llm.generate(prompts, free):
        for c in out.outputs:
            with pytest.raises((ValueError, jsonschema.ValidationError)):
                jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_seeded_constrained_request_draws_the_same_tokens_anywhere(llama_dir):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=50, seed=11, structured_outputs=SPECS["json"])
    alone = LLM(llama_dir, dtype="float32", num_kv_blocks=256).generate(["the cat sat"], params)[0]
    others = [SamplingParams(n=2, temperature=0.7, max_tokens=30, seed=i) for i in range(4)]
    crowd = LLM(llama_dir, dtype="float32", num_kv_blocks=256).generate(
        ["w1 w2", "the cat sat", "hello", "a b c", "x"], [others[0], params, *others[1:]]
    )[1]
    tight = LLM(llama_dir, dtype="float32", num_kv_blocks=24, block_size=8, preemption_mode="recompute")
    squeezed = tight.generate(["w1 w2", "the cat sat", "hello", "a b c", "x"], [others[0], params, *others[1:]])[1]
    assert tight.stats()["num_preemptions"] > 0
    want = [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in crowd.outputs] == want == [c.token_ids for c in squeezed.outputs]


def test_logprobs_stay_the_raw_models(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    prompt = [1, 40, 41, 42, 43]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, seed=1, logprobs=1,
                                                structured_outputs=SPECS["regex"]))[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(llama_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    want = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids))
    assert abs(out.cumulative_logprob - want) < 2e-3


def test_bad_specs_are_refused_naming_the_prompt(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    ok = SamplingParams(max_tokens=4)
    cases = [
        (StructuredOutputsParams(json={"type": "objectt"}), "prompt 1: structured_outputs: invalid JSON schema"),
        (StructuredOutputsParams(regex="a(b"), "prompt 1: structured_outputs: invalid regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "prompt 1: structured_outputs: invalid grammar"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], [ok, SamplingParams(max_tokens=4, structured_outputs=spec)])
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="needs an end token"):
        llm.generate(["a"], BeamSearchParams(beam_width=2, ignore_eos=True, structured_outputs=SPECS["choice"]))
    out = llm.generate(["a"], SamplingParams(max_tokens=3, structured_outputs=SPECS["json"]))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3  # cut inside the structure
