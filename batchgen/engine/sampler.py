"""Token sampling for a batch of rows, vectorized over rows.

Order of processing (vLLM's): ``min_tokens`` blocks stop tokens, then repetition / presence /
frequency penalties, then greedy rows take the argmax; other rows divide by temperature, apply
``min_p``, ``top_k`` and ``top_p``, and draw by inverse CDF with one uniform number per row.

That number comes from a counter-based hash of (the sequence's seed, its output position), not from
a shared generator, so a seeded request samples the same tokens whatever else is in the batch and
after a preemption. Reported log-probabilities are the raw model's (``log_softmax`` of the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.params import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) determined by (seed, step) alone."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ step) >> 11) / float(1 << 53)


def derive_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded with ``seed``."""
    return splitmix64((seed & _MASK64) * 1_000_003 + index)


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    step: int  # output tokens so far
    token_ids: list[int]  # prompt + output, for penalties
    num_prompt_tokens: int
    blocked_ids: list[int]  # stop tokens masked while below min_tokens


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def _penalize(logits: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> None:
    vocab = logits.shape[1]
    dev = logits.device
    for i in idx:  # one row at a time: only rows that asked for penalties pay for them
        r, p = rows[i], rows[i].params
        out = torch.tensor(r.token_ids[r.num_prompt_tokens :], dtype=torch.long, device=dev)
        counts = torch.zeros(vocab, device=dev).index_add_(
            0, out.clamp_(0, vocab - 1), torch.ones(len(out), device=dev)
        )
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(r.token_ids[: r.num_prompt_tokens], dtype=torch.long, device=dev).clamp_(
                0, vocab - 1
            )
            seen[prompt] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        if p.frequency_penalty:
            row.sub_(p.frequency_penalty * counts)
        if p.presence_penalty:
            row.sub_(p.presence_penalty * (counts > 0).float())


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Pick one token per row of ``logits`` [rows, vocab] (float32)."""
    n = len(rows)
    dev = logits.device
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    x = logits.clone()

    blocked = [(i, t) for i, r in enumerate(rows) for t in r.blocked_ids if t < x.shape[1]]
    if blocked:
        bi, bt = zip(*blocked, strict=True)
        x[list(bi), list(bt)] = float("-inf")
    pen = [
        i
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
    ]
    if pen:
        _penalize(x, rows, pen)

    greedy = torch.tensor([r.params.temperature == 0 for r in rows], device=dev)
    tokens = x.argmax(dim=-1)
    if not bool(greedy.all()):
        temp = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev, dtype=x.dtype)
        x = x / temp[:, None]
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev, dtype=x.dtype)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        u = torch.tensor([uniform(r.seed, r.step) for r in rows], device=dev, dtype=torch.float64)
        top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev, dtype=x.dtype)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            x, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(x.shape[1], device=dev)[None, :]
            x = x.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), float("-inf"))
            probs = torch.softmax(x, dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            x = x.masked_fill((before >= top_p[:, None]) & (ranks > 0), float("-inf"))
        else:
            order = None
        cdf = torch.softmax(x, dim=-1).double().cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_(max=x.shape[1] - 1)
        # Never land on a masked token at the right edge of the CDF.
        pick = torch.minimum(pick, (x > float("-inf")).sum(dim=-1) - 1) if order is not None else pick
        sampled = order.gather(1, pick[:, None]).squeeze(1) if order is not None else pick
        tokens = torch.where(greedy, tokens, sampled)

    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    top: list[dict[int, float] | None] = [None] * n
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        k = max(rows[i].params.logprobs for i in want)  # type: ignore[type-var]
        vals, ids = raw_logprobs[want].topk(k, dim=-1) if k > 0 else (None, None)
        for j, i in enumerate(want):
            d: dict[int, float] = {}
            kk = rows[i].params.logprobs or 0
            if kk:
                d.update(zip(ids[j, :kk].tolist(), vals[j, :kk].tolist(), strict=True))  # type: ignore[index]
            d[int(tokens[i])] = float(chosen[i])
            top[i] = d
    return SampleResult(tokens.tolist(), chosen.tolist(), top)
