"""What a generated token may be: a request's grammar (structured outputs) and the reasoning parser's
state, shared by the kinds that generate (sampling and beam search).

Each step ``mask`` builds the token mask of the rows that follow a grammar or must write a forced
token; after a token is chosen, ``advance`` feeds it to the sequence's reasoning state and then to
its grammar. A grammar applies after the reasoning only: a reasoning token never reaches the
grammar's matcher, a row that may still open its reasoning may also take the start tag, and a
spent thinking budget forces the end of the reasoning.
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.sampler import GrammarMask
from batchgen.engine.sequence import Sequence
from batchgen.engine.structured import StructuredOutputs, allow_also, allow_only, apply_bitmask, full_mask
from batchgen.params import RequestParams
from batchgen.reasoning import ReasoningParser, make_parser


class TokenConstraints:
    """The engine's grammars (built with the first constrained request) and its reasoning parser."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], reasoning_parser: str | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.reasoning: ReasoningParser | None = make_parser(reasoning_parser, tokenizer) if reasoning_parser else None
        self._structured: StructuredOutputs | None = None

    @property
    def structured(self) -> StructuredOutputs:
        """The grammars of structured outputs (built, with xgrammar's view of the tokenizer, when
        the first constrained request comes)."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._structured

    def end_tokens(self, params: RequestParams) -> list[int]:
        """The tokens that end a sequence of ``params``: its stop token ids and, unless it ignores
        them, the model's end tokens."""
        return sorted(set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(self.eos_ids)))

    def compile(self, params: RequestParams) -> None:
        """Compile ``params``' grammar, if it has one, into the cache; ``ValueError`` if it does not
        compile. Thread-safe: a job's reader thread compiles rows' grammars off the step loop."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def start(self, seq: Sequence, params: RequestParams) -> None:
        """Give a request's first sequence its grammar matcher and reasoning state."""
        if params.structured_outputs is not None:
            seq.matcher = self.structured.matcher(params.structured_outputs, self.end_tokens(params))
        if self.reasoning is not None:
            seq.reasoning = self.reasoning.state(seq.token_ids, params.thinking_token_budget)

    def mask(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The step's token mask for the rows of ``seqs`` that follow a grammar or must write a
        forced token (None: none do)."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None and not _thinking(seq)]
        forced = {} if self.reasoning is None else {
            i: seq.reasoning.forcing[0] for i, seq in enumerate(seqs) if seq.reasoning is not None and seq.reasoning.forcing
        }
        if not rows and not forced:
            return None
        if rows:
            structured = self.structured
            live = [i for i in rows if not seqs[i].matcher.is_terminated()]
            mask = structured.bitmask([seqs[i].matcher for i in live], live, len(seqs))
            for i in rows:
                if i not in live:  # a beam that took an end token as a running candidate (nothing else was
                    # allowed): as after the grammar's end, only end tokens, as the oracle's processor does
                    allow_only(mask, i, self.end_tokens(seqs[i].group.params))
                elif seqs[i].reasoning is not None and not seqs[i].reasoning.ended:
                    assert self.reasoning is not None
                    allow_also(mask, i, self.reasoning.start[0])
        else:
            mask = full_mask(len(seqs), self.vocab_size)
        for i, token in forced.items():
            allow_only(mask, i, [token])
        apply = self._structured.apply if self._structured is not None else apply_bitmask
        return GrammarMask(mask, sorted(set(rows) | set(forced)), apply, self.vocab_size)

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feed ``token`` to the sequence's reasoning state, then (unless it is a reasoning token)
        to its grammar; True when that ends the sequence (the grammar is complete and has no stop
        token to wait for)."""
        if seq.reasoning is not None:
            assert self.reasoning is not None
            if self.reasoning.advance(seq.reasoning, token, seq.group.params.thinking_token_budget):
                return False
        if seq.matcher is None:
            return False
        if seq.matcher.is_terminated():
            return True
        if not seq.matcher.accept_token(token) or seq.matcher.is_terminated():
            if seq.finish_reason is None:
                seq.finish_reason = "stop"
            return True
        return False

    def stats(self) -> dict[str, float | int]:
        return self._structured.stats() if self._structured is not None else StructuredOutputs.no_stats()


def _thinking(seq: Sequence) -> bool:
    """Whether the sequence's next token is part of its reasoning (no grammar applies)."""
    return seq.reasoning is not None and seq.reasoning.inside
