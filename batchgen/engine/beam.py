"""Beam search inside the engine, step for step the algorithm of transformers
``generate(num_beams=k, do_sample=False)`` (its ``_beam_search``), vectorized over every beam group
of the batch that has the same width and number of end tokens.

Per step and group: accumulated scores of all ``k x vocab`` continuations, the top
``max(2, 1 + n_eos) * k`` of them; those that end (an end token, or the length limit) may enter the
group's ``k`` finished hypotheses with score ``logprob_sum / generated_len ** length_penalty``; the
best ``k`` that do not end become the next running beams. The engine then forks the chosen parents
(sharing KV blocks copy-on-write) and frees the dropped ones. The early-stopping rules (True, False,
"never") and the final ranking are transformers'. The first step starts from one prompt sequence
standing for all ``k`` beams, as transformers does with scores ``[0, -1e9, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from batchgen.engine.sampler import GrammarMask
from batchgen.engine.sequence import Sequence
from batchgen.params import BeamSearchParams
from batchgen_kernels import cpu_beam
from batchgen_kernels.cpu import library_kernels

NEG = -1.0e9
FUSED_CPU_TOPK = True  # the compiled candidate step on CPU logits (False: the torch code, the reference)


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the end token included
    score: float
    logprob_sum: float
    ended_by_token: bool


@dataclass
class BeamState:
    params: BeamSearchParams
    end_ids: list[int]
    prompt_len: int
    max_length: int
    cur_len: int
    beams: list[Sequence]  # running beams in score order (the prompt sequence k times at first)
    running_scores: torch.Tensor  # [k] summed log-probs
    finished_scores: torch.Tensor  # [k]
    is_finished: torch.Tensor  # [k] bool
    early_stop_unsatisfied: torch.Tensor  # [1] bool
    finished: list[Hypothesis | None] = field(default_factory=list)
    done: bool = False

    @classmethod
    def start(
        cls, params: BeamSearchParams, prompt_seq: Sequence, end_ids: list[int], max_length: int
    ) -> BeamState:
        k = params.beam_width
        running = torch.zeros(k)
        running[1:] = NEG
        return cls(
            params=params,
            end_ids=end_ids,
            prompt_len=prompt_seq.num_prompt_tokens,
            max_length=max_length,
            cur_len=prompt_seq.num_prompt_tokens,
            beams=[prompt_seq] * k,
            running_scores=running,
            finished_scores=torch.full((k,), NEG),
            is_finished=torch.zeros(k, dtype=torch.bool),
            early_stop_unsatisfied=torch.ones(1, dtype=torch.bool),
            finished=[None] * k,
        )

    @property
    def group_key(self) -> tuple[int, int]:
        return (self.params.beam_width, len(self.end_ids))


def _end_tokens_masked(states: list[BeamState]) -> bool:
    return any(st.cur_len - st.prompt_len < st.params.min_tokens and st.end_ids for st in states)


def _mask_end_tokens(states: list[BeamState], log_probs: torch.Tensor, k: int) -> torch.Tensor:
    """transformers' ``min_new_tokens`` processor: end tokens get -inf while too few tokens exist."""
    if not _end_tokens_masked(states):
        return log_probs
    log_probs = log_probs.clone()
    for g, st in enumerate(states):
        if st.cur_len - st.prompt_len < st.params.min_tokens and st.end_ids:
            log_probs[g * k : (g + 1) * k, torch.tensor(st.end_ids)] = float("-inf")
    return log_probs


@dataclass
class BeamChoice:
    """The new running beams of one group: beam i continues ``parents[i]`` with ``tokens[i]``."""

    parents: list[Sequence]
    tokens: list[int]
    scores: list[float]


def beam_step(
    states: list[BeamState], logits: torch.Tensor, rows: list[int], grammar: GrammarMask | None = None
) -> list[BeamChoice]:
    """One step for groups of equal (width, number of end tokens).

    ``logits``: the model's logits, one row per computed sequence; beam i of group g reads row
    ``rows[g*k + i]``. ``grammar``: structured outputs' mask, one row per beam in the same order,
    applied to the log-probabilities (as transformers applies a logits processor in beam search).
    Updates every state in place and returns the running beams chosen per group.
    """
    if states[0].params.beam_width == 1:
        log_probs = _log_softmax(logits, rows)
        if grammar is not None:
            grammar.apply(log_probs, grammar.mask, grammar.rows)
        return _greedy_step(states, log_probs)
    k = states[0].params.beam_width
    cand = _candidates(states, logits, rows, k, grammar)

    # e. next running beams: the best k continuations that did not end
    topk_running = cand.log_probs + cand.ends.to(torch.float32) * NEG
    next_idx = torch.topk(topk_running, k=k)[1]
    next_scores = topk_running.gather(1, next_idx)

    merged_idx, new_finished_scores, new_is_finished = _merge_finished(states, cand, k)

    choices = []
    idx_rows, beam_rows, id_rows = merged_idx.tolist(), cand.beams.tolist(), cand.token_ids.tolist()
    lp_rows, next_rows, score_rows = cand.log_probs.tolist(), next_idx.tolist(), next_scores.tolist()
    unchanged = list(range(k))
    new_finished_rows = new_finished_scores.tolist()
    for g, st in enumerate(states):
        if idx_rows[g] != unchanged:  # a candidate that ended entered the finished hypotheses
            old = st.finished
            new: list[Hypothesis | None] = []
            for j in idx_rows[g]:
                if j < k:
                    new.append(old[j])
                else:
                    c = j - k
                    parent = st.beams[beam_rows[g][c]]
                    tok = id_rows[g][c]
                    new.append(
                        Hypothesis(
                            parent.output_token_ids + [tok],
                            new_finished_rows[g][len(new)],
                            lp_rows[g][c],
                            tok in st.end_ids,
                        )
                    )
            st.finished = new
        # rows of this step's fresh tensors, never written in place
        st.finished_scores = new_finished_scores[g]
        st.is_finished = new_is_finished[g]
        st.running_scores = next_scores[g]
        choices.append(
            BeamChoice(
                parents=[st.beams[beam_rows[g][c]] for c in next_rows[g]],
                tokens=[id_rows[g][c] for c in next_rows[g]],
                scores=score_rows[g],
            )
        )
        st.cur_len += 1
    _update_done(states, next_scores, new_finished_scores, new_is_finished, cand.ends.all(dim=1).tolist())
    return choices


class _Candidates(NamedTuple):
    """The top ``max(2, 1 + n_end) * k`` continuations of each group ([G, keep] each)."""

    log_probs: torch.Tensor  # accumulated log-probabilities
    beams: torch.Tensor  # which running beam each continues
    token_ids: torch.Tensor
    ends: torch.Tensor  # bool: the continuation ends (an end token, or the length limit)


def _log_softmax(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows' float32 log-probabilities, in the beams' order (no gather when already in it)."""
    in_order = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    return torch.log_softmax((logits if in_order else logits[torch.tensor(rows)]).float(), dim=-1)


def _candidates(
    states: list[BeamState], logits: torch.Tensor, rows: list[int], k: int, grammar: GrammarMask | None = None
) -> _Candidates:
    """a.-d.: accumulated scores of all ``k x vocab`` continuations and the best of them (on the
    compiled CPU kernel where it runs: the same scores without a vocabulary-sized temporary)."""
    g_count = len(states)
    n_end = len(states[0].end_ids)
    vocab = logits.shape[-1]
    keep = max(2, 1 + n_end) * k
    running = torch.stack([st.running_scores for st in states])
    if (
        FUSED_CPU_TOPK
        and "beam_topk" not in library_kernels()
        and cpu_beam.takes(logits)
        and not _end_tokens_masked(states)
        and grammar is None
    ):
        topk_log_probs, topk_idx = cpu_beam.beam_topk(logits, torch.tensor(rows), running.view(-1), k, keep)
    else:
        log_probs = _mask_end_tokens(states, _log_softmax(logits, rows), k)
        if grammar is not None:
            grammar.apply(log_probs, grammar.mask, grammar.rows)
        acc = (log_probs.view(g_count, k, vocab) + running[:, :, None]).reshape(g_count, k * vocab)
        topk_log_probs, topk_idx = torch.topk(acc, k=keep)
    topk_ids = topk_idx % vocab
    at_limit = torch.tensor([[st.cur_len + 1 >= st.max_length] for st in states])
    if n_end:
        ends = torch.tensor([st.end_ids for st in states])  # [G, n_end]
        hits = (topk_ids[:, :, None] == ends[:, None, :]).any(dim=-1) | at_limit
    else:
        hits = at_limit.expand(g_count, keep).clone()
    return _Candidates(topk_log_probs, topk_idx // vocab, topk_ids, hits)


def _merge_finished(
    states: list[BeamState], cand: _Candidates, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """f.: the candidates that end, among the top k only, scored ``logprob_sum / generated_len **
    length_penalty``, merged with each group's k finished hypotheses; returns the merged order
    (index < k: an old hypothesis, else candidate ``index - k``), the scores and finished flags."""
    keep = cand.log_probs.shape[1]
    top_k_mask = torch.cat((torch.ones(k, dtype=torch.bool), torch.zeros(keep - k, dtype=torch.bool)))
    finished_scores = torch.stack([st.finished_scores for st in states])
    is_finished = torch.stack([st.is_finished for st in states])
    unsatisfied = torch.stack([st.early_stop_unsatisfied for st in states])
    just_finished = cand.ends & top_k_mask[None, :]
    lengths = [(st.cur_len + 1 - st.prompt_len) ** st.params.length_penalty for st in states]
    scores = cand.log_probs / torch.tensor(lengths, dtype=torch.float32)[:, None]
    full = torch.all(is_finished, dim=-1, keepdim=True) & torch.tensor(
        [[st.params.early_stopping is True] for st in states]
    )
    scores += full.to(torch.float32) * NEG
    scores += (~unsatisfied).to(torch.float32) * NEG
    scores += (~just_finished) * NEG
    merged_scores = torch.cat((finished_scores, scores), dim=1)
    merged_finished = torch.cat((is_finished, just_finished), dim=1)
    merged_idx = torch.topk(merged_scores, k=k)[1]
    return merged_idx, merged_scores.gather(1, merged_idx), merged_finished.gather(1, merged_idx)


def _update_done(
    states: list[BeamState],
    running: torch.Tensor,
    finished_scores: torch.Tensor,
    is_finished: torch.Tensor,
    all_ended: list[bool],
) -> None:
    """g.: the stopping rule of each group after its step (``cur_len`` already advanced; [G, k]
    tensors); narrows ``early_stop_unsatisfied`` and sets ``done``."""
    best_lens = []
    for st in states:
        p = st.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_lens.append((st.max_length - st.prompt_len) ** p.length_penalty)
        else:
            best_lens.append((st.cur_len - st.prompt_len) ** p.length_penalty)
    best_possible = running[:, :1] / torch.tensor(best_lens, dtype=torch.float32)[:, None]
    worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, NEG)
    unsatisfied = torch.stack([st.early_stop_unsatisfied for st in states])
    unsatisfied = unsatisfied & torch.any(best_possible > worst, dim=1, keepdim=True)
    improvement = unsatisfied[:, 0].tolist()
    full = is_finished.all(dim=1).tolist()
    for g, st in enumerate(states):
        st.early_stop_unsatisfied = unsatisfied[g]
        open_beam = not (full[g] and st.params.early_stopping is True)
        st.done = not (improvement[g] and open_beam and not all_ended[g])


def _greedy_step(states: list[BeamState], log_probs: torch.Tensor) -> list[BeamChoice]:
    """Width 1: transformers runs greedy search for ``num_beams=1``, and so does batchgen."""
    log_probs = _mask_end_tokens(states, log_probs, 1)
    tokens = log_probs.argmax(dim=-1).tolist()
    chosen = log_probs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    choices = []
    for g, st in enumerate(states):
        tok = tokens[g]
        total = st.running_scores[:1] + chosen[g]
        st.cur_len += 1
        ended = tok in st.end_ids
        if ended or st.cur_len >= st.max_length:
            parent = st.beams[0]
            gen_len = st.cur_len - st.prompt_len
            score = float(total[0] / (gen_len**st.params.length_penalty))
            st.finished = [Hypothesis(parent.output_token_ids + [tok], score, float(total[0]), ended)]
            st.done = True
        st.running_scores = total
        choices.append(BeamChoice(parents=[st.beams[0]], tokens=[tok], scores=total.tolist()))
    return choices
