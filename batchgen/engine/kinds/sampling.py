"""Sampling requests (``SamplingParams``): ``n`` samples of one prompt.

The prompt's sequence prefills alone; its last position's logits give the first token of every
sample, as it forks into ``n`` sequences that share its blocks copy-on-write. Each step samples one
token per sample (the sampler's one batched call over every sampling row, grammar masks applied),
then checks stops. A request that asks for ``prompt_logprobs`` computes every prompt position
itself (no prefix sharing), and its prefill chunks return every position's logits.
"""

from __future__ import annotations

import torch

from batchgen.engine.kinds.base import CompletionKind
from batchgen.engine.sampler import SampleRow, sample, target_logprobs
from batchgen.engine.scheduler import ScheduledSeq
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.engine.stops import StopStringWatcher, check_stop
from batchgen.outputs import CompletionOutput, LogprobsBuilder, PromptLogprobs
from batchgen.params import SamplingParams


class SamplingKind(CompletionKind[SamplingParams]):
    params_type = SamplingParams

    def private_prefix(self, params: SamplingParams) -> bool:
        # prompt log-probabilities need every prompt position computed (a recompute after a
        # preemption still reuses the request's own blocks)
        return params.prompt_logprobs is not None

    def seed(self, params: SamplingParams) -> int | None:
        return params.seed

    def start(self, seq: Sequence, params: SamplingParams) -> None:
        self.parts.constraints.start(seq, params)
        if params.logprobs is not None:
            seq.logprobs = LogprobsBuilder(params.logprobs)
        if params.stop:
            seq.detok = StopStringWatcher(self.parts.text.tokenizer, params)
        if params.prompt_logprobs is not None:
            seq.group.prompt_logprobs = [None] * seq.num_prompt_tokens

    def note_chunk(self, chunk: ScheduledSeq, logits: torch.Tensor) -> None:
        """Prompt log-probabilities from one prefill chunk's logits: the row of position t scores
        prompt token t + 1 (its log-probability, rank and the top k)."""
        seq, group = chunk.seq, chunk.seq.group
        assert group.prompt_logprobs is not None
        n = min(logits.shape[0], seq.num_prompt_tokens - 1 - chunk.start)
        if n <= 0:
            return
        params: SamplingParams = group.params
        targets = torch.tensor(seq.token_ids[chunk.start + 1 : chunk.start + 1 + n], device=logits.device)
        k = params.prompt_logprobs or 0
        group.prompt_logprobs[chunk.start + 1 : chunk.start + 1 + n] = target_logprobs(logits[:n].float(), targets, k)

    def advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        parts = self.parts
        rows: list[SampleRow] = []
        targets: list[Sequence] = []
        row_index: list[int] = []
        for i, seq in enumerate(seqs):
            group = seq.group
            params: SamplingParams = group.params
            if len(group.seqs) == 1 and params.n > 1 and seq.num_output_tokens == 0:
                # The prompt's prefill is done: fork it into n samples, one token each from this row.
                children = [seq] + [parts.fork(seq, index=j) for j in range(1, params.n)]
            else:
                children = [seq]
            for child in children:
                blocked = []
                if child.num_output_tokens < params.min_tokens:
                    blocked = list(params.stop_token_ids or []) + (
                        [] if params.ignore_eos else list(parts.eos_ids)
                    )
                rows.append(
                    SampleRow(
                        params,
                        child.seed,
                        child.num_output_tokens,
                        child.token_ids,
                        child.num_prompt_tokens,
                        blocked,
                    )
                )
                targets.append(child)
                row_index.append(i)
        if len(targets) != len(seqs):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        grammar = parts.constraints.mask(targets)
        with parts.stats.timed("sampler_s"):
            result = sample(logits, rows, grammar=grammar)
        parts.stats.values["generated_tokens"] += len(targets)
        for seq, tok, lp, top in zip(
            targets, result.tokens, result.logprobs, result.top_logprobs, strict=True
        ):
            seq.token_ids.append(tok)
            seq.cumulative_logprob += lp
            if seq.logprobs is not None:
                assert top is not None  # the request asked for logprobs
                seq.logprobs.append(tok, lp, top.rank, top.ids, top.logprobs)
            ended = parts.constraints.advance(seq, tok)
            if check_stop(seq, seq.group.params, parts.eos_ids, parts.max_model_len) or ended:
                parts.scheduler.free_seq(seq)

    def completions(self, group: SequenceGroup[SamplingParams]) -> list[CompletionOutput]:
        text = self.parts.text
        out = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            stopped = seq.detok.text[: seq.text_end] if seq.text_end is not None else None
            reasoning, answer = text.split(seq.output_token_ids, group.params.skip_special_tokens, stopped)
            out.append(
                CompletionOutput(
                    index=seq.index,
                    text=answer,
                    reasoning=reasoning,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=None if seq.logprobs is None else seq.logprobs.build(text.decode_token),
                    finish_reason=seq.finish_reason or "length",
                    stop_reason=seq.stop_reason,
                )
            )
        return out

    def prompt_logprobs(self, group: SequenceGroup[SamplingParams]) -> PromptLogprobs | None:
        if group.prompt_logprobs is None:
            return None
        k = group.params.prompt_logprobs or 0
        values = self.parts.text.token_logprobs(k, group.prompt_token_ids[1:], group.prompt_logprobs[1:])
        return PromptLogprobs(values)
