"""Results of ``LLM.generate``: one ``RequestOutput`` per prompt, each holding its completions."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length"]


class Logprob(float):
    """A log-probability that is also vLLM's ``Logprob``: ``.logprob``, ``.rank`` (1 = the most
    likely token under the raw model) and ``.decoded_token``. It compares and computes as the
    float it is, so ``{token_id: logprob}`` code keeps working."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


class _LazyList(Sequence):
    """A read-only sequence whose items are built on access (``_item``), that compares with, and
    concatenates to, plain lists of the same items."""

    __slots__ = ()

    def _item(self, i: int) -> Any:
        raise NotImplementedError

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._item(i % n)

    def __iter__(self) -> Iterator[Any]:
        return (self._item(i) for i in range(len(self)))

    def __add__(self, other: Sequence) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        """As vLLM prints its list of ``{token_id: Logprob}`` dicts (None for a first prompt token)."""
        return repr(list(self))


class TokenLogprobs(_LazyList):
    """Per-token log-probabilities held as arrays, one row per token: ``token_ids`` (int32), their
    ``logprobs`` (float32) and ``ranks`` (int32; 1 = the most likely token), and each token's
    ``top_ids`` / ``top_logprobs`` (int32 / float32, [tokens, k], best first). As a sequence it is
    vLLM's list of ``{token_id: Logprob}`` dicts (the token and its top k), built on access, so
    thousands of tokens with k = 20 cost arrays, not Python objects. ``decode`` fills
    ``Logprob.decoded_token`` when given."""

    __slots__ = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "_decode")

    def __init__(
        self,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        ranks: np.ndarray,
        top_ids: np.ndarray,
        top_logprobs: np.ndarray,
        decode: Callable[[int], str] | None = None,
    ) -> None:
        self.token_ids = np.asarray(token_ids, dtype=np.int32)
        self.logprobs = np.asarray(logprobs, dtype=np.float32)
        self.ranks = np.asarray(ranks, dtype=np.int32)
        n = len(self.token_ids)
        self.top_ids = np.asarray(top_ids, dtype=np.int32).reshape(n, -1)
        self.top_logprobs = np.asarray(top_logprobs, dtype=np.float32).reshape(n, -1)
        self._decode = decode

    def __len__(self) -> int:
        return len(self.token_ids)

    def _item(self, i: int) -> dict[int, Logprob]:
        decode = self._decode
        entry = {
            tid: Logprob(lp, r, decode(tid) if decode else None)
            for r, (tid, lp) in enumerate(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist(), strict=True), start=1)
        }
        tid = int(self.token_ids[i])
        entry[tid] = Logprob(float(self.logprobs[i]), int(self.ranks[i]), decode(tid) if decode else None)
        return entry

    def decoded(self, token: int) -> str:
        """A token's text (its id as text when no tokenizer was given)."""
        return self._decode(token) if self._decode else str(token)



class PromptLogprobs(_LazyList):
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then one ``{token_id: Logprob}``
    dict per prompt token; ``values`` holds positions 1.. as ``TokenLogprobs``."""

    __slots__ = ("values",)

    def __init__(self, values: TokenLogprobs) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values) + 1

    def _item(self, i: int) -> dict[int, Logprob] | None:
        return None if i == 0 else self.values[i - 1]



class LogprobsBuilder:
    """A sequence's per-token log-probabilities while it grows: one small array row per token,
    stacked into ``TokenLogprobs`` when the sequence is done."""

    __slots__ = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "k")

    def __init__(self, k: int) -> None:
        self.k = k
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []

    def append(self, token: int, logprob: float, rank: int, top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.top_ids.append(top_ids)
        self.top_logprobs.append(top_logprobs)

    def copy(self) -> LogprobsBuilder:
        other = LogprobsBuilder(self.k)
        for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
            setattr(other, name, list(getattr(self, name)))
        return other

    def __len__(self) -> int:
        return len(self.token_ids)

    def build(self, decode: Callable[[int], str] | None = None) -> TokenLogprobs:
        k = self.k
        top_ids = np.stack(self.top_ids) if self.top_ids else np.zeros((0, k), dtype=np.int32)
        top_lps = np.stack(self.top_logprobs) if self.top_logprobs else np.zeros((0, k), dtype=np.float32)
        return TokenLogprobs(np.array(self.token_ids), np.array(self.logprobs), np.array(self.ranks),
                             top_ids, top_lps, decode)


@dataclass
class CompletionOutput:
    """One completion (a sample, or a beam hypothesis).

    ``token_ids`` end with the EOS / stop token when one ended the completion (as in vLLM).
    ``cumulative_logprob`` is the sum of the raw model log-probabilities of ``token_ids``.
    ``score`` is set for beam search: the length-penalized score transformers reports as
    ``sequences_scores``. ``stop_reason`` is the stop string or stop token id that ended it, or None.
    ``logprobs``, when asked for, has one dict per generated token: token id -> ``Logprob`` (a float
    with vLLM's ``logprob`` / ``rank`` / ``decoded_token``): the sampled token and the top ones
    (a ``TokenLogprobs``: the same dicts, held as arrays). ``reasoning``: with a reasoning parser,
    the thinking (``text`` is then the answer alone), None when the completion has none.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: TokenLogprobs | list[dict[int, float]] | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    score: float | None = None
    reasoning: str | None = None


@dataclass
class RequestOutput:
    """All completions of one prompt, best first for beam search, by sample index otherwise.
    ``error`` is set (and ``outputs`` empty) when the engine gave up on this request alone."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    # when asked (``SamplingParams.prompt_logprobs``): per prompt token, None for the first, else
    # {token_id: Logprob} with the prompt token and the top ones under the raw model
    prompt_logprobs: PromptLogprobs | None = None
    lora_request: Any = None  # the LoRARequest it ran on (None: the base model)


@dataclass
class ContinuationScore:
    """One continuation's score: ``logprob`` is the sum of its tokens' log-probabilities under the
    model (after the prompt and the continuation's earlier tokens), ``num_tokens`` their count;
    ``logprobs``, when asked, each token's value, rank and top alternatives."""

    index: int
    text: str
    token_ids: list[int]
    logprob: float
    num_tokens: int
    logprobs: TokenLogprobs | None = None

    @property
    def mean_logprob(self) -> float:
        return self.logprob / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(-self.mean_logprob)


@dataclass
class ScoreOutput:
    """The scores of one prompt's continuations, in the order given (``LLM.score_continuations``).
    ``error`` is set (and ``continuations`` empty) when the engine gave up on this prompt alone."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    continuations: list[ContinuationScore] = field(default_factory=list)
    error: str | None = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search`` in vLLM's shape: ``tokens`` are the prompt's and the
    generated ones, ``text`` the generated text; ``score`` is transformers' length-penalized score."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    score: float | None = None


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
