"""What every request kind provides, and the engine parts a kind works with.

A request kind (sampling, beam search, scoring) owns how a request of that kind starts, forks and
advances in a step, and how its output is assembled. The engine keeps one instance of each kind,
picks a request's by the type of its parameters (``RequestKind.params_type``) and never tests a
request's kind itself. A kind's state per request or sequence lives on the ``SequenceGroup`` and
``Sequence`` it is given; state across requests (beam rows waiting for their siblings, say) lives on
the kind, and ``drop`` forgets a group's part of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.constraints import TokenConstraints
from batchgen.engine.sampler import derive_seed
from batchgen.engine.scheduler import ScheduledSeq, Scheduler
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.engine.stats import EngineStats
from batchgen.engine.text import OutputText
from batchgen.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from batchgen.params import RequestParams

P = TypeVar("P", bound=RequestParams)


@dataclass
class EngineParts:
    """The parts of the engine a request kind works with."""

    bm: BlockManager
    scheduler: Scheduler
    stats: EngineStats
    constraints: TokenConstraints
    text: OutputText
    eos_ids: frozenset[int]
    vocab_size: int
    max_model_len: int

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sequence ``index`` of ``parent``'s group with ``parent``'s tokens, state and KV
        blocks (shared copy-on-write)."""
        group = parent.group
        child = Sequence(
            group=group,
            index=index,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            seed=derive_seed(parent.base_seed, index),
            base_seed=parent.base_seed,
            num_computed_tokens=parent.num_computed_tokens,
            status=parent.status,
            cumulative_logprob=parent.cumulative_logprob,
        )
        if parent.logprobs is not None:
            child.logprobs = parent.logprobs.copy()
        if parent.detok is not None:
            child.detok = parent.detok.copy_for(parent.output_token_ids, self.text.tokenizer, group.params)
        if parent.matcher is not None:
            child.matcher = parent.matcher.fork()
        if parent.reasoning is not None:
            child.reasoning = parent.reasoning.copy()
        self.bm.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        return child


class RequestKind(ABC, Generic[P]):
    """One kind of request, for parameters of type ``params_type``. ``advance`` and ``output`` are
    each kind's own; the other hooks do nothing unless a kind needs them."""

    params_type: ClassVar[type]

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts

    # -- a new request -------------------------------------------------------------------------
    def validate(self, token_ids: list[int], params: P) -> None:
        """Raise ValueError for what this kind cannot run (checks common to every kind are the
        engine's)."""

    def private_prefix(self, params: P) -> bool:
        """Whether the request must compute every prompt position itself (no prefix sharing)."""
        return False

    def seed(self, params: P) -> int | None:
        """The request's seed (None: the engine draws one)."""
        return None

    def start(self, seq: Sequence, params: P) -> None:
        """Set up a request's first sequence (the prompt) before it is queued."""

    # -- a step --------------------------------------------------------------------------------
    def note_chunk(self, chunk: ScheduledSeq, logits: torch.Tensor) -> None:
        """The logits of every position of a chunk that asked for them (``Chunk.all_logits``)."""

    def note_computed(self, seq: Sequence, prompt_tokens: int, other_tokens: int) -> None:
        """A step computed ``prompt_tokens`` of ``seq``'s prompt and ``other_tokens`` after it."""

    @abstractmethod
    def advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The sequences of this kind whose last token was computed this step, with its logits
        (one row each, in order): choose their next tokens, fork, free the finished ones."""

    def drop(self, group: SequenceGroup[Any]) -> None:
        """Forget what the kind holds for ``group`` across steps (it was preempted by recompute,
        failed or aborted)."""

    # -- the output ----------------------------------------------------------------------------
    @abstractmethod
    def output(self, group: SequenceGroup[P]) -> RequestOutput:
        """The finished request's output."""

    def stats(self) -> dict[str, int]:
        """The kind's own counters in ``LLM.stats()``."""
        return {}


class CompletionKind(RequestKind[P]):
    """A kind whose output is a ``RequestOutput`` of ``CompletionOutput``s (sampling, beam search,
    scoring)."""

    def output(self, group: SequenceGroup[P]) -> RequestOutput:
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=group.num_cached_tokens or 0,
            outputs=self.completions(group),
            prompt_logprobs=self.prompt_logprobs(group),
            lora_request=group.lora_request,
        )

    @abstractmethod
    def completions(self, group: SequenceGroup[P]) -> list[CompletionOutput]:
        """The finished request's completions, in the order ``RequestOutput.outputs`` lists them."""

    def prompt_logprobs(self, group: SequenceGroup[P]) -> PromptLogprobs | None:
        return None
