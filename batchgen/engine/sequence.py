"""Request state: a ``SequenceGroup`` is one request (one prompt); its ``Sequence``s are the n
samples or k beams that share the prompt.

Counters of a sequence, with the invariant ``0 <= num_computed_tokens <= num_tokens``:
``num_tokens`` is prompt + generated tokens; ``num_computed_tokens`` of them have KV in the cache.
After a preemption by recompute, ``num_computed_tokens`` drops to 0 and the whole history is
prefilled again (cached prefix blocks make that cheap); the tokens themselves never change.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from batchgen.outputs import FinishReason
from batchgen.params import RequestParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV moved to host blocks
    FINISHED = "finished"


_seq_ids = itertools.count()
P = TypeVar("P", bound=RequestParams)


@dataclass(eq=False)
class Sequence:
    group: SequenceGroup[Any]
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int  # this completion's sampling seed
    base_seed: int = 0  # the request's seed: completion i of a fork gets derive_seed(base_seed, i)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: Any = None  # a LogprobsBuilder when the request asked for ``logprobs``
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    detok: Any = None  # incremental detokenizer state (only when stop strings are used)
    text_end: int | None = None  # where the completion's text ends (a stop string was found)
    matcher: Any = None  # the grammar's state after this sequence's tokens (structured outputs)
    # a scored continuation (ScoreParams): per continuation token, (log-probability, TopLogprobs or
    # None) once its logits were seen; None before the prompt's prefill forked the continuations
    score: list[Any] | None = None
    reasoning: Any = None  # a ReasoningState with the engine's reasoning parser

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def check(self) -> None:
        assert 0 <= self.num_computed_tokens <= self.num_tokens, (self.num_computed_tokens, self.num_tokens)
        assert self.num_prompt_tokens <= self.num_tokens


def long_rope_key(cache_key: object) -> object:
    """The cache key of a group computed with LongRoPE's long frequencies: its blocks are shared
    only with others computed so (the same tokens hold other K values with the short ones)."""
    return ("long-rope", cache_key)


def is_long_rope(cache_key: object) -> bool:
    return isinstance(cache_key, tuple) and len(cache_key) == 2 and cache_key[0] == "long-rope"


@dataclass(eq=False)
class SequenceGroup(Generic[P]):
    """One request. ``seqs`` starts with one sequence holding the prompt; a sampling request with
    ``n > 1`` forks it into n after the prompt's prefill, a beam request keeps ``beam_width`` beams.
    ``cache_key`` is mixed into block hashes: None shares prefixes across requests, a per-request
    value keeps them private (prefix caching off) while still letting a recompute reuse its own blocks.
    """

    request_id: str
    params: P  # its kind's parameters (``engine/kinds``)
    prompt: str | None
    prompt_token_ids: list[int]
    cache_key: object = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    beam: Any = None  # the beam search state of a beam search request (``kinds/beam.py``)
    error: str | None = None  # set when the engine gave up on the request (it is then finished)
    prompt_logprobs: list[Any] | None = None  # per prompt position, when the request asked for them
    lora_request: Any = None  # the request's LoRARequest (None: the base model)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def max_seqs(self) -> int:
        return self.params.group_size

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not SeqStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)
