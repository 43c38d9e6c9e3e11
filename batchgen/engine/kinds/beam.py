"""Beam-search requests (``BeamSearchParams``): the ``beam_width`` best hypotheses of one prompt,
as transformers ``generate(num_beams=k)`` finds them (the algorithm: ``engine/beam.py``).

A group's beams advance together: a step runs the search once every beam of the group has its
logits (rows computed in an earlier step, when the token budget split the group, wait in
``pending``), vectorized over every group of the same width and number of end tokens. The chosen
parents then continue in place or fork (a parent chosen twice shares its blocks copy-on-write),
and dropped beams free their blocks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from batchgen.engine.beam import BeamChoice, BeamState, beam_step
from batchgen.engine.kinds.base import CompletionKind, EngineParts
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.outputs import CompletionOutput
from batchgen.params import BeamSearchParams


class BeamKind(CompletionKind[BeamSearchParams]):
    params_type = BeamSearchParams

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        self.pending: dict[int, torch.Tensor] = {}  # beam seq id -> logits row waiting for its siblings

    def validate(self, token_ids: list[int], params: BeamSearchParams) -> None:
        if params.structured_outputs is not None and not self.parts.constraints.end_tokens(params):
            raise ValueError("structured_outputs with beam search needs an end token: drop ignore_eos or give stop_token_ids")

    def start(self, seq: Sequence, params: BeamSearchParams) -> None:
        self.parts.constraints.start(seq, params)

    def drop(self, group: SequenceGroup[Any]) -> None:
        for seq in group.seqs:  # rows computed before a recompute are void
            self.pending.pop(seq.seq_id, None)

    def advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        parts = self.parts
        row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        ready: dict[tuple[int, int], list[SequenceGroup[BeamSearchParams]]] = defaultdict(list)
        for group in dict.fromkeys(seq.group for seq in seqs):
            if group.beam is None:
                params: BeamSearchParams = group.params
                prompt_seq = group.seqs[0]
                max_len = min(prompt_seq.num_prompt_tokens + params.max_tokens, parts.max_model_len)
                group.beam = BeamState.start(params, prompt_seq, parts.constraints.end_tokens(params), max_len)
            beams = group.beam.beams
            if all(b.seq_id in row_of or b.seq_id in self.pending for b in beams):
                ready[group.beam.group_key].append(group)
            else:  # some beams were not computed this step (token budget): keep the rows we have
                for b in beams:
                    if b.seq_id in row_of:
                        self.pending[b.seq_id] = logits[row_of[b.seq_id]].clone()
        for groups in ready.values():
            beams = [b for g in groups for b in g.beam.beams]
            if all(b.seq_id in row_of for b in beams):
                source, index = logits, [row_of[b.seq_id] for b in beams]
            else:
                source = torch.stack(
                    [logits[row_of[b.seq_id]] if b.seq_id in row_of else self.pending[b.seq_id] for b in beams]
                )
                index = list(range(len(beams)))
            for b in beams:
                self.pending.pop(b.seq_id, None)
            choices = beam_step([g.beam for g in groups], source, index, parts.constraints.mask(beams))
            for group, choice in zip(groups, choices, strict=True):
                self._apply(group, choice)

    def _apply(self, group: SequenceGroup[BeamSearchParams], choice: BeamChoice) -> None:
        parts = self.parts
        state: BeamState = group.beam
        old = list(dict.fromkeys(state.beams))
        if state.done:
            for seq in old:
                parts.scheduler.free_seq(seq)
            group.seqs = old
            return
        used: set[int] = set()
        assigned: list[tuple[Sequence, int, float]] = []
        for parent, tok, score in zip(choice.parents, choice.tokens, choice.scores, strict=True):
            if parent.seq_id in used:
                target = parts.fork(parent, index=len(group.seqs))
            else:
                used.add(parent.seq_id)
                target = parent
            assigned.append((target, tok, score))
        parts.stats.values["generated_tokens"] += len(assigned)
        for target, tok, score in assigned:
            target.token_ids.append(tok)
            target.cumulative_logprob = score
            parts.constraints.advance(target, tok)
        for seq in old:
            if seq.seq_id not in used:
                parts.scheduler.free_seq(seq)
        state.beams = [t for t, _, _ in assigned]
        group.seqs = list(state.beams)

    def completions(self, group: SequenceGroup[BeamSearchParams]) -> list[CompletionOutput]:
        """The best ``num_return_sequences`` finished hypotheses, best first; ``score`` is
        transformers' ``sequences_scores``."""
        text, eos_ids = self.parts.text, self.parts.eos_ids
        out = []
        for i, hyp in enumerate(group.beam.finished[: group.params.num_return_sequences]):
            if hyp is None:
                continue
            reasoning, answer = text.split(hyp.token_ids, True, None)
            out.append(
                CompletionOutput(
                    index=i,
                    text=answer,
                    reasoning=reasoning,
                    token_ids=hyp.token_ids,
                    cumulative_logprob=hyp.logprob_sum,
                    logprobs=None,
                    finish_reason="stop" if hyp.ended_by_token else "length",
                    stop_reason=hyp.token_ids[-1] if hyp.ended_by_token and hyp.token_ids[-1] not in eos_ids else None,
                    score=hyp.score,
                )
            )
        return out
