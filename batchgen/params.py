"""Generation parameters: ``SamplingParams`` (vLLM names and meanings) and ``BeamSearchParams``
(transformers ``generate(num_beams=...)`` semantics).

Both validate on construction and raise ``ValueError`` naming the bad field and value, so a bad
request never reaches the engine. Unknown field names are rejected the same way (with a suggestion).
"""

from __future__ import annotations

import difflib
import json as _json
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

EarlyStopping = Literal[True, False, "never"]


class _Params:
    """Keyword-only construction with a ValueError (not a TypeError) for unknown names."""

    _kind: ClassVar[str] = "params"

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Build from a mapping (a job config, a row override); unknown keys raise ``ValueError``."""
        return cls(**values)

    @classmethod
    def _check_names(cls, values: dict[str, Any]) -> None:
        """Raise one ValueError naming every unknown key, each with a suggestion when one is close."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = []
        for key in values:
            if key not in names:
                hint = difflib.get_close_matches(key, sorted(names), n=1)
                unknown.append(repr(key) + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        if unknown:
            what = "parameter" if len(unknown) == 1 else "parameters"
            raise ValueError(
                f"unknown {cls._kind} {what} {', '.join(unknown)}; allowed: {', '.join(sorted(names))}"
            )


def _reject_unknown_names(cls):
    """Make the dataclass ``__init__`` raise ValueError (naming the key) for unknown keywords."""
    init = cls.__init__

    def __init__(self, **kwargs):
        cls._check_names(kwargs)
        init(self, **kwargs)

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    return cls


def _check(cond: bool, name: str, value: Any, rule: str) -> None:
    if not cond:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_budget(value: Any) -> None:
    _check(value is None or (_is_int(value) and value >= 0), "thinking_token_budget", value,
           "an integer >= 0 or None")


def _check_token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    ids = list(ids)
    for t in ids:
        _check(_is_int(t) and t >= 0, name, ids, "a list of non-negative token ids")
    return ids


@_reject_unknown_names
@dataclass(kw_only=True)
class StructuredOutputsParams(_Params):
    """vLLM's ``StructuredOutputsParams``: constrain a request's output to exactly one of a JSON
    schema (``json``: a dict or its JSON text), a regular expression (``regex``), one of several
    strings (``choice``), an EBNF / GBNF grammar (``grammar``), or any JSON object
    (``json_object=True``). ``disable_any_whitespace``: JSON without free whitespace between its
    tokens. The grammar is compiled by xgrammar once per distinct text (``batchgen/engine/structured.py``);
    a schema, pattern or grammar that does not compile is a ``ValueError`` when the request is made."""

    _kind: ClassVar[str] = "structured output"
    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # vLLM's: there is one backend here, never a fallback

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                + (f"got {', '.join(given)}" if given else "got none")
            )
        if self.json is not None:
            _check(isinstance(self.json, (dict, str)), "json", self.json, "a JSON schema (a dict or its text)")
            if isinstance(self.json, str):
                try:
                    _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"json must be a JSON schema; its text does not parse: {e}") from None
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex", self.regex,
               "a non-empty pattern")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "grammar",
               self.grammar, "a non-empty EBNF grammar")
        if self.choice is not None:
            _check(
                isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                "choice", self.choice, "a non-empty list of non-empty strings",
            )
            self.choice = list(self.choice)
        _check(self.json_object in (None, True, False), "json_object", self.json_object, "a bool")
        for name in ("disable_any_whitespace", "disable_fallback"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar: the kind, its text (a schema's keys sorted), and
        the whitespace setting."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = _json.dumps(_json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif self.kind == "choice":
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace)


def _structured(value: Any) -> StructuredOutputsParams | None:
    """``structured_outputs`` as given: None, the params object, or a mapping of its fields (a job
    config's or a row's)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams.from_dict(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
    raise ValueError(
        f"structured_outputs must be StructuredOutputsParams or a mapping of its fields, got {type(value).__name__}"
    )


@_reject_unknown_names
@dataclass(kw_only=True)
class SamplingParams(_Params):
    """Sampling parameters with vLLM's names and meanings.

    ``temperature=0`` means greedy. ``seed`` makes a request sample the same tokens whatever else is
    in the batch. ``logprobs=k`` returns, for each generated token, the ``k`` most likely tokens'
    log-probabilities plus the sampled one's. Log-probabilities are those of the model's raw
    distribution (before temperature, penalties and truncation), as vLLM reports by default.
    """

    _kind: ClassVar[str] = "sampling"

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its log-probability and the top ones
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # with the engine's reasoning parser: once this many reasoning tokens are written, the end of
    # the reasoning is forced and the answer follows (vLLM's name)
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check_budget(self.thinking_token_budget)
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 means greedy)",
        )
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        # vLLM also accepts -1 for "no top-k"; 0 means the same here.
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k, "an integer >= 0 (0: disabled)")
        if self.top_k == -1:
            self.top_k = 0
        _check(
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"
        )
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "an integer >= 1 or None",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "an integer >= 0",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", self.stop, "a list of non-empty strings")
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name, value, "an integer >= 0 or None")
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -2 <= v <= 2, name, v, "in [-2, 2]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        self.structured_outputs = _structured(self.structured_outputs)

    @property
    def group_size(self) -> int:
        return self.n


@_reject_unknown_names
@dataclass(kw_only=True)
class BeamSearchParams(_Params):
    """Beam search with the semantics of transformers ``generate(num_beams=k, do_sample=False)``.

    ``length_penalty`` divides a hypothesis's summed log-probability by its *generated* length to
    that power (transformers; vLLM's ``LLM.beam_search`` counts the prompt too). ``early_stopping``
    is True (stop once ``beam_width`` hypotheses are finished), False (stop when the heuristic says
    no running beam can beat the finished ones) or ``"never"`` (the canonical, exhaustive rule).
    """

    _kind: ClassVar[str] = "beam search"

    beam_width: int = 4
    max_tokens: int = 16
    num_return_sequences: int | None = None
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None  # as SamplingParams'

    def __post_init__(self) -> None:
        _check_budget(self.thinking_token_budget)
        _check(
            _is_int(self.beam_width) and self.beam_width >= 1,
            "beam_width",
            self.beam_width,
            "an integer >= 1",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        _check(
            _is_int(self.num_return_sequences) and 1 <= self.num_return_sequences <= self.beam_width,
            "num_return_sequences",
            self.num_return_sequences,
            f"an integer in [1, beam_width={self.beam_width}]",
        )
        _check(
            _is_number(self.length_penalty),
            "length_penalty",
            self.length_penalty,
            "a number",
        )
        _check(
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never",
            "early_stopping",
            self.early_stopping,
            'one of True, False, "never"',
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        self.structured_outputs = _structured(self.structured_outputs)

    @property
    def group_size(self) -> int:
        return self.beam_width


@_reject_unknown_names
@dataclass(kw_only=True)
class ScoreParams(_Params):
    """Score given continuations of one prompt: each continuation's log-probability under the model
    (``LLM.score_continuations``). ``continuations``: token ids, one non-empty list per
    continuation. ``logprobs``: None for the totals only; k >= 0 for each continuation token's
    log-probability and rank with its top k alternatives (as ``SamplingParams.logprobs``).

    The continuations fork from the prompt after its prefill, copy-on-write, as the n samples of a
    request do: the prompt is computed once whatever the number of continuations."""

    _kind: ClassVar[str] = "score"

    continuations: list[list[int]] = field(default_factory=list)
    logprobs: int | None = None

    # what the engine reads of every kind of parameters: no stop tokens, no grammar, no sampling
    structured_outputs: ClassVar[None] = None
    thinking_token_budget: ClassVar[None] = None
    stop_token_ids: ClassVar[tuple[int, ...]] = ()
    ignore_eos: ClassVar[bool] = True
    n: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check(
            isinstance(self.continuations, (list, tuple)) and len(self.continuations) > 0,
            "continuations", self.continuations, "a non-empty list of continuations",
        )
        conts = []
        for i, ids in enumerate(self.continuations):
            ids = _check_token_ids(f"continuations[{i}]", ids)
            _check(len(ids) > 0, f"continuations[{i}]", ids, "non-empty (at least one token)")
            conts.append(ids)
        self.continuations = conts
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs", self.logprobs, "an integer >= 0 or None",
        )

    @property
    def group_size(self) -> int:
        return len(self.continuations)

    @property
    def max_tokens(self) -> int:
        """The longest continuation: the most tokens any of its sequences adds to the prompt."""
        return max(len(c) for c in self.continuations)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: a PEFT LoRA adapter directory, named ``lora_name`` and identified by
    ``lora_int_id`` (>= 1; 0 is the base model). Requests with the same id use the same adapter;
    the id is mixed into the prefix cache's block hashes."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.lora_name, str) and bool(self.lora_name), "lora_name", self.lora_name, "a non-empty string")
        _check(_is_int(self.lora_int_id) and self.lora_int_id >= 1, "lora_int_id", self.lora_int_id, "an integer >= 1")
        _check(isinstance(self.lora_path, str) and bool(self.lora_path), "lora_path", self.lora_path, "an adapter directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


# any request's parameters: a sampling, a beam-search or a scoring request
RequestParams = SamplingParams | BeamSearchParams | ScoreParams
