"""Results of ``LLM.generate``: one ``RequestOutput`` per prompt, each holding its completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


class Logprob(float):
    """A log-probability that is also vLLM's ``Logprob``: ``.logprob``, ``.rank`` (1 = the most
    likely token under the raw model) and ``.decoded_token``. It compares and computes as the
    float it is, so ``{token_id: logprob}`` code keeps working."""

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


@dataclass
class CompletionOutput:
    """One completion (a sample, or a beam hypothesis).

    ``token_ids`` end with the EOS / stop token when one ended the completion (as in vLLM).
    ``cumulative_logprob`` is the sum of the raw model log-probabilities of ``token_ids``.
    ``score`` is set for beam search: the length-penalized score transformers reports as
    ``sequences_scores``. ``stop_reason`` is the stop string or stop token id that ended it, or None.
    ``logprobs``, when asked for, has one dict per generated token: token id -> ``Logprob`` (a float
    with vLLM's ``logprob`` / ``rank`` / ``decoded_token``): the sampled token and the top ones.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    score: float | None = None


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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: Any = None  # the LoRARequest it ran on (None: the base model)


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
