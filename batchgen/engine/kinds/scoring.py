"""Scoring requests (``ScoreParams``): given continuations of one prompt, scored by the model.

A request's first sequence prefills the prompt; its last position's logits score every
continuation's first token; it then forks into one sequence per continuation (``EngineParts.fork``:
the prompt's blocks shared, the partial last one copied when each writer first writes it) whose
tokens are the continuation but its last, computed as prefill chunks that ask for every position's
logits (``Chunk.all_logits``); row t scores token t + 1. A sequence whose continuation is computed
is done. After a recompute preemption a continuation matches only the prompt's cached blocks (its
own positions must be computed for their logits; scores already taken are kept).
"""

from __future__ import annotations

import torch

from batchgen.engine.kinds.base import CompletionKind
from batchgen.engine.sampler import target_logprobs
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.outputs import CompletionOutput
from batchgen.params import ScoreParams

COUNTERS = ("scored_continuations", "score_prompt_tokens_computed", "score_continuation_tokens_computed")


class ScoreKind(CompletionKind[ScoreParams]):
    params_type = ScoreParams

    def validate(self, token_ids: list[int], params: ScoreParams) -> None:
        vocab, max_len = self.parts.vocab_size, self.parts.max_model_len
        for i, cont in enumerate(params.continuations):
            bad = [t for t in cont if t >= vocab]
            if bad:
                raise ValueError(f"continuation {i} has token id {bad[0]}, outside the vocabulary [0, {vocab})")
            if len(token_ids) + len(cont) > max_len:
                raise ValueError(
                    f"prompt ({len(token_ids)} tokens) and continuation {i} ({len(cont)} tokens) exceed "
                    f"the model's context (max_model_len {max_len})"
                )

    def advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """A prompt whose prefill just ended forks into its continuations, and its last row scores
        their first tokens; a continuation whose last chunk was computed is done."""
        parts = self.parts
        for seq, row in zip(seqs, logits, strict=True):
            if seq.score is not None:  # its continuation's last chunk: every token is scored
                parts.scheduler.free_seq(seq)
                continue
            params: ScoreParams = seq.group.params
            children = [seq] + [parts.fork(seq, index=j) for j in range(1, len(params.continuations))]
            firsts = torch.tensor([c[0] for c in params.continuations], device=row.device)
            scores = target_logprobs(row.float()[None].expand(len(children), -1), firsts, params.logprobs)
            for child, cont, entry in zip(children, params.continuations, scores, strict=True):
                child.score = [None] * len(cont)
                child.score[0] = entry
                if len(cont) == 1:
                    parts.scheduler.free_seq(child)
                else:
                    child.token_ids.extend(cont[:-1])

    def note_chunk(self, chunk: ScheduledSeq, logits: torch.Tensor) -> None:
        """A continuation's chunk: the row of position t scores the token at t + 1, from the
        prompt's last position (after a recompute) to the continuation's last token."""
        seq = chunk.seq
        params: ScoreParams = seq.group.params
        cont = params.continuations[seq.index]
        first = max(chunk.start, seq.num_prompt_tokens - 1)  # the first position that scores a token
        offset = first - chunk.start
        n = min(chunk.start + logits.shape[0], seq.num_prompt_tokens + len(cont) - 1) - first
        if n <= 0:
            return
        c0 = first + 1 - seq.num_prompt_tokens  # the continuation token the first row scores
        targets = torch.tensor(cont[c0 : c0 + n], device=logits.device)
        assert seq.score is not None
        seq.score[c0 : c0 + n] = target_logprobs(logits[offset : offset + n].float(), targets, params.logprobs)

    def note_computed(self, seq: Sequence, prompt_tokens: int, other_tokens: int) -> None:
        values = self.parts.stats.values
        values["score_prompt_tokens_computed"] += prompt_tokens
        values["score_continuation_tokens_computed"] += other_tokens

    def completions(self, group: SequenceGroup[ScoreParams]) -> list[CompletionOutput]:
        """One per continuation: ``cumulative_logprob`` is its total log-probability, ``logprobs``
        (when asked) its tokens' values and top alternatives."""
        text, params = self.parts.text, group.params
        out = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            cont = params.continuations[seq.index]
            assert seq.score is not None and all(e is not None for e in seq.score), "a continuation token was not scored"
            logprobs = None if params.logprobs is None else text.token_logprobs(params.logprobs, cont, seq.score)
            out.append(
                CompletionOutput(
                    index=seq.index,
                    text=text.decode(cont, False),
                    token_ids=list(cont),
                    cumulative_logprob=float(sum(lp for lp, _ in seq.score)),
                    logprobs=logprobs,
                    finish_reason="length",
                )
            )
        self.parts.stats.values["scored_continuations"] += len(out)
        return out

    def stats(self) -> dict[str, int]:
        return {key: int(self.parts.stats.values[key]) for key in COUNTERS}
