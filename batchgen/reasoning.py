"""Reasoning parsers: a reasoning model's completion split into its thinking and its answer, with
vLLM's parser names and rules.

- ``deepseek_r1``: ``<think> ... </think> answer``. The start tag may be in the prompt (the chat
  template opens it) or absent: everything before ``</think>`` is reasoning, and a completion that
  never closes it is all reasoning (the answer is None).
- ``qwen3``: the same tags, but a completion without ``</think>`` is all answer (Qwen3 with
  ``enable_thinking=False`` writes no reasoning; its template puts an empty think block in the
  prompt).
- ``gpt_oss``: the harmony format's channels, parsed by ``openai-harmony`` (the format's own
  package): the ``analysis`` channel is the reasoning, the ``final`` channel the answer.

Each sequence of a request keeps a ``ReasoningState`` while it generates: whether it is inside its
reasoning, and how many reasoning tokens it wrote. The engine uses it twice. A structured output's
grammar sees only the tokens after the reasoning ended (the answer is constrained, the thinking is
free). And with ``thinking_token_budget`` (vLLM's name), once that many reasoning tokens are
written the parser's end sequence is forced, one token per step, and the answer follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReasoningState:
    """One sequence's place in its reasoning (copied when the sequence forks)."""

    inside: bool  # the next token is part of the reasoning
    tokens: int = 0  # reasoning tokens written so far
    ended: bool = False  # the reasoning ended (or never started): the grammar applies
    forcing: list[int] = field(default_factory=list)  # the rest of a forced end sequence
    tail: list[int] = field(default_factory=list)  # the last tokens, to match multi-token tags

    def copy(self) -> ReasoningState:
        return ReasoningState(self.inside, self.tokens, self.ended, list(self.forcing), list(self.tail))


class ReasoningParser:
    """Reasoning delimited by a start and an end tag, each a token sequence (one token for the
    think tags)."""

    name = ""
    starts_inside = False  # with no tag in the prompt, the completion begins inside its reasoning
    unclosed_is_reasoning = True  # a completion that never ends its reasoning is all reasoning

    def __init__(self, start: list[int], end: list[int], force: list[int] | None = None) -> None:
        self.start, self.end = start, end
        self.force = force or end  # what a spent thinking budget forces

    def state(self, prompt_ids: Sequence[int], budget: int | None = None) -> ReasoningState:
        """The state after the prompt: inside when the prompt's last tag opens a reasoning block
        (a template that starts the thinking), or with no tag when the parser says so. A budget of
        0 forces the end at once."""
        last_start = _last_index(prompt_ids, self.start)
        last_end = _last_index(prompt_ids, self.end)
        if last_start is None and last_end is None:
            inside = self.starts_inside
        else:
            inside = last_start is not None and (last_end is None or last_start > last_end)
        state = ReasoningState(inside=inside, ended=not inside and last_end is not None)
        if inside and budget is not None and budget <= 0:
            state.forcing = list(self.force)
        return state

    def advance(self, state: ReasoningState, token: int, budget: int | None) -> bool:
        """Take one generated token; True when it belongs to the reasoning (the grammar must not
        see it), False for an answer token."""
        if state.forcing and token == state.forcing[0]:
            state.forcing.pop(0)
        state.tail = (state.tail + [token])[-max(len(self.start), len(self.end)) :]
        if state.inside:
            state.tokens += 1
            if _ends_with(state.tail, self.end):
                state.inside, state.ended, state.forcing = False, True, []
            elif budget is not None and state.tokens >= budget and not state.forcing:
                state.forcing = list(self._rest_of_force(state.tail))
            return True
        if not state.ended and _ends_with(state.tail, self.start):
            state.inside = True
            if budget is not None and budget <= 0:
                state.forcing = list(self.force)
            return True
        if not state.ended:
            state.ended = True  # the answer began without reasoning
        return False

    def _rest_of_force(self, tail: list[int]) -> list[int]:
        """The forced sequence, less what the tail already wrote of it."""
        force = self.force
        for k in range(min(len(force), len(tail)), 0, -1):
            if tail[-k:] == force[:k]:
                return force[k:]
        return force

    def split(self, token_ids: list[int], decode: Callable[[list[int]], str]) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a completion's tokens."""
        start = _first_index(token_ids, self.start)
        rest = token_ids if start is None else token_ids[start + len(self.start) :]  # the start tag dropped
        end = _first_index(rest, self.end)
        if end is None:
            text = decode(rest)
            return (text, None) if self.unclosed_is_reasoning else (None, text)
        return decode(rest[:end]), decode(rest[end + len(self.end) :]) or None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    unclosed_is_reasoning = False


class GptOssParser(ReasoningParser):
    """gpt-oss's harmony format. The answer starts with ``<|channel|>final<|message|>``; a spent
    thinking budget forces ``<|end|><|start|>assistant<|channel|>final<|message|>``. The split is
    ``openai-harmony``'s own parse of the completion's tokens."""

    name = "gpt_oss"
    starts_inside = True

    def __init__(self, tokenizer: Any) -> None:
        harmony = _harmony()
        try:
            self.encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as e:  # noqa: BLE001 - harmony's own error type
            raise ValueError(
                f"reasoning_parser gpt_oss: openai-harmony cannot load its vocabulary ({e}); offline, set "
                "TIKTOKEN_ENCODINGS_BASE to a directory holding o200k_base.tiktoken"
            ) from None
        self.harmony = harmony
        enc = self.encoding

        def ids(text: str) -> list[int]:
            return list(enc.encode(text, allowed_special="all"))

        super().__init__(ids("<|channel|>analysis<|message|>"), ids("<|channel|>final<|message|>"),
                         ids("<|end|><|start|>assistant<|channel|>final<|message|>"))

    def split(self, token_ids: list[int], decode: Callable[[list[int]], str]) -> tuple[str | None, str | None]:
        h = self.harmony
        parser = h.StreamableParser(self.encoding, role=h.Role.ASSISTANT)
        for t in token_ids:
            try:
                parser.process(t)
            except Exception:  # noqa: BLE001 - a completion cut short inside a header
                break
        reasoning: list[str] = []
        answer: list[str] = []
        for message in parser.messages:
            text = "".join(c.text for c in message.content if hasattr(c, "text"))
            (answer if message.channel == "final" else reasoning).append(text)
        if parser.current_content:
            (answer if parser.current_channel == "final" else reasoning).append(parser.current_content)
        return ("".join(reasoning) or None), ("".join(answer) or None)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)}


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(PARSERS))


def make_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser ``name`` for ``tokenizer``; ``ValueError`` for an unknown name, or a tokenizer
    without the parser's tags."""
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(parser_names())}, got {name!r}")
    cls = PARSERS[name]
    if cls is GptOssParser:
        return GptOssParser(tokenizer)
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in ("<think>", "</think>") if tag not in vocab]
    if missing:
        raise ValueError(
            f"reasoning_parser {name}: the tokenizer has no {' or '.join(repr(m) for m in missing)} token; "
            "this parser is for models that think between <think> and </think>"
        )
    return cls([vocab["<think>"]], [vocab["</think>"]])


def _harmony():
    try:
        import openai_harmony
    except ImportError:
        raise ValueError(
            "reasoning_parser gpt_oss needs the openai-harmony package: pip install openai-harmony "
            "(or batchgen's 'reasoning' extra)"
        ) from None
    return openai_harmony


def _ends_with(seq: list[int], pattern: list[int]) -> bool:
    return bool(pattern) and len(seq) >= len(pattern) and seq[-len(pattern) :] == pattern


def _first_index(seq: Sequence[int], pattern: list[int]) -> int | None:
    n, head = len(pattern), pattern[0]
    for i in range(len(seq) - n + 1):
        if seq[i] == head and list(seq[i : i + n]) == pattern:
            return i
    return None


def _last_index(seq: Sequence[int], pattern: list[int]) -> int | None:
    n, head = len(pattern), pattern[0]
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == head and list(seq[i : i + n]) == pattern:
            return i
    return None
