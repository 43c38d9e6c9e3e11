"""Reasoning parsers (``reasoning_parser``: qwen3, deepseek_r1, gpt_oss): each completion split into
``reasoning`` and ``text`` by vLLM's rules; a JSON schema that constrains the answer and not the
thinking, greedy and beam, against transformers ``generate`` with a logits processor that applies
the grammar after ``</think>``; the thinking budget forcing ``</think>``; refusals."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.reasoning import make_parser
from batchgen.tiny import make_model
from tests.api.test_structured import EOS, GrammarProcessor, allow_only_token, hf_generate

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
SPEC = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
# Qwen3's template shape: the thinking variant (Qwen3-2507 "Thinking") opens <think> in the
# generation prompt; enable_thinking=False closes an empty block there, as Qwen3's own template does.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's: the generation prompt ends inside <think>.
R1_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)


def make_reasoning_model(path, template: str) -> str:
    """A tiny Qwen3 whose tokenizer has <think> and </think> (ids 384, 385 of a vocabulary of 400)."""
    from transformers import AutoTokenizer

    make_model(path, "qwen3", seed=7, vocab_size=400, tokenizer_vocab=384)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [384, 385]
    tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reasoning")
    return {
        "qwen3": make_reasoning_model(root / "qwen3", QWEN3_TEMPLATE),
        "deepseek_r1": make_reasoning_model(root / "r1", R1_TEMPLATE),
    }


# -- the split, against vLLM's rules on the text ------------------------------------------------------
def vllm_split(parser: str, text: str) -> tuple[str | None, str | None]:
    """vLLM's extract_reasoning on a completion's text: the start tag dropped when present; without
    an end tag all reasoning (deepseek_r1) or all answer (qwen3); an empty answer is None."""
    head, tag, tail = text.partition("<think>")
    text = tail if tag else head
    if "</think>" not in text:
        return (text, None) if parser == "deepseek_r1" else (None, text)
    reasoning, _, answer = text.partition("</think>")
    return reasoning, answer or None


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_split_follows_vllms_rules(models, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[name])
    parser = make_parser(name, tok)
    words = [[384], [385], tok("ab", add_special_tokens=False)["input_ids"], tok(" c", add_special_tokens=False)["input_ids"]]
    for n in range(0, 5):
        for parts in itertools.product(words, repeat=n):
            ids = [t for p in parts for t in p]
            got = parser.split(ids, lambda x: tok.decode(x))
            want = vllm_split(name, tok.decode(ids))
            assert got == (want[0], want[1]), (ids, tok.decode(ids))


# -- generation against transformers ----------------------------------------------------------------
class ReasoningGrammarProcessor(GrammarProcessor):
    """The oracle: a completion is inside its reasoning until its first </think>; with a budget B,
    the token after B reasoning tokens is </think>; after it, the JSON grammar (rebuilt per row from
    the answer's tokens) and then EOS only."""

    def __init__(self, compiled, prompt_len: int, budget: int, end: int) -> None:
        super().__init__(compiled, prompt_len)
        self.budget, self.end = budget, end

    def fill_row(self, mask: torch.Tensor, row: int, ids: list[int]) -> None:
        if self.end in ids:
            super().fill_row(mask, row, ids[ids.index(self.end) + 1 :])
        elif len(ids) >= self.budget:
            allow_only_token(mask, row, self.end)
        # else: thinking, every token allowed (the mask's default)


def hf_reasoning(path: str, llm: LLM, prompt: list[int], width: int, budget: int, max_new: int):
    compiled = llm.engine.structured.compile(SPEC)
    return hf_generate(path, prompt, width, max_new, ReasoningGrammarProcessor(compiled, len(prompt), budget, 385))


CONVERSATIONS = [[{"role": "user", "content": "is the cat on the mat?"}], [{"role": "user", "content": "a b"}]]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_schema_holds_for_the_answer_not_the_reasoning(models, name):
    """Greedy and beams (widths 1 and 3) with a thinking budget of 5 and a JSON schema: the tokens
    equal transformers' under the oracle processor; each answer validates against the schema; each
    reasoning is the 5 free tokens before the forced </think>."""
    path = models[name]
    llm = LLM(path, dtype="float32", device="cpu", reasoning_parser=name, debug_checks=True)
    tok = llm.get_tokenizer()
    budget, max_new = 5, 40
    greedy = SamplingParams(temperature=0, max_tokens=max_new, structured_outputs=SPEC, thinking_token_budget=budget)
    validated = 0
    for conv in CONVERSATIONS:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        outs = [llm.generate([prompt], greedy)[0]] + [
            llm.generate([prompt], BeamSearchParams(beam_width=w, max_tokens=max_new, structured_outputs=SPEC,
                                                    thinking_token_budget=budget))[0] for w in (1, 3)
        ]
        for width, out in zip((0, 1, 3), outs, strict=True):
            want, scores = hf_reasoning(path, llm, prompt, width, budget, max_new)
            assert [c.token_ids for c in out.outputs] == want, (name, width)
            for c, s in zip(out.outputs, scores, strict=True):
                assert s is None or abs(c.score - s) < 1e-4
                assert c.token_ids[budget] == 385 and 385 not in c.token_ids[:budget]
                assert c.reasoning == tok.decode(c.token_ids[:budget], skip_special_tokens=True)
                if c.finish_reason == "stop":
                    jsonschema.validate(json.loads(c.text), SCHEMA)
                    validated += 1
                assert c.text == tok.decode([t for t in c.token_ids[budget + 1 :] if t != EOS], skip_special_tokens=True)
    assert validated >= 4, "the test needs answers that end within max_tokens"


def test_enable_thinking_false_constrains_from_the_start(models):
    """Qwen3 with enable_thinking=False: the template closes an empty think block, so the whole
    completion is the answer (reasoning None) and the grammar applies from its first token."""
    path = models["qwen3"]
    llm = LLM(path, dtype="float32", device="cpu", reasoning_parser="qwen3")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SPEC)
    out = llm.chat(CONVERSATIONS[0], params, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt.endswith("<think>\n</think>\n\n")
    c = out.outputs[0]
    assert c.reasoning is None and 385 not in c.token_ids
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_unfinished_thinking(models):
    """No </think> within max_tokens: deepseek_r1 calls it all reasoning, qwen3 all answer."""
    for name in ("deepseek_r1", "qwen3"):
        llm = LLM(models[name], dtype="float32", device="cpu", reasoning_parser=name)
        c = llm.chat(CONVERSATIONS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
        assert 385 not in c.token_ids
        whole = llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert (c.reasoning, c.text) == ((whole, "") if name == "deepseek_r1" else (None, whole))


def test_samples_fork_their_reasoning_state(models):
    """n=4 sampled completions with a budget of 3: each forks the prompt's state and ends its
    reasoning after exactly 3 tokens."""
    llm = LLM(models["deepseek_r1"], dtype="float32", device="cpu", reasoning_parser="deepseek_r1")
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=30, thinking_token_budget=3, structured_outputs=SPEC)
    for c in llm.chat(CONVERSATIONS[0], params)[0].outputs:
        assert c.token_ids[3] == 385 and 385 not in c.token_ids[:3]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_refusals(models, llama_dir):
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, gpt_oss, qwen3"):
        LLM(models["qwen3"], reasoning_parser="qwen")
    with pytest.raises(ValueError, match="the tokenizer has no '<think>' or '</think>' token"):
        LLM(llama_dir, reasoning_parser="qwen3")
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        llm.generate(["a"], SamplingParams(thinking_token_budget=4))
    with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
        SamplingParams(thinking_token_budget=-1)


def test_gpt_oss_split_through_openai_harmony():
    """gpt-oss's channels parsed by openai-harmony: analysis is the reasoning, final the answer.
    Needs harmony's o200k vocabulary (downloaded, or TIKTOKEN_ENCODINGS_BASE offline)."""
    harmony = pytest.importorskip("openai_harmony")
    try:
        parser = make_parser("gpt_oss", None)
    except ValueError as e:
        pytest.skip(str(e))
    enc = parser.encoding
    ids = enc.encode(
        "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>",
        allowed_special="all",
    )
    assert parser.split(list(ids), lambda x: enc.decode(x)) == ("think hard", "42")
    cut = enc.encode("<|channel|>analysis<|message|>still thinking", allowed_special="all")
    assert parser.split(list(cut), lambda x: enc.decode(x)) == ("still thinking", None)
    assert harmony is not None
