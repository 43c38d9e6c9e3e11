"""Token sampling for a batch of rows, vectorized over rows.

Order of processing (vLLM's): ``min_tokens`` blocks stop tokens, then repetition / presence /
frequency penalties, then greedy rows take the argmax; other rows divide by temperature, apply
``min_p``, ``top_k`` and ``top_p``, and draw by inverse CDF with one uniform number per draw.

Those numbers come from a counter-based hash of (the sequence's seed, its output position, the
draw), not from a shared generator, so a seeded request samples the same tokens whatever else is in
the batch and after a preemption. Reported log-probabilities are the raw model's (``log_softmax`` of
the logits). Full-vocabulary work is done by torch's fused softmax kernels (one for the raw
distribution, one for the tempered one when a temperature is not 1) and a few elementwise passes:
on the CPU those passes, not the arithmetic, are the cost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from batchgen.params import SamplingParams

if TYPE_CHECKING:
    from batchgen_kernels.cpu_sampling import RowMask

_MASK64 = (1 << 64) - 1

# Below this log-probability a float32 probability is subnormal (from about -87.3) or 0, so its
# log has lost bits; such a token's log-probability is recomputed with log_softmax.
_INEXACT_LOG_PROB = -80.0


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
class GrammarMask:
    """A step's structured-output mask: ``apply(scores, mask, rows)`` sets the tokens below
    ``vocab`` that ``mask`` does not allow to -inf in ``rows`` of ``scores``
    (``batchgen/engine/structured.py``)."""

    mask: torch.Tensor
    rows: list[int]
    apply: Callable[[torch.Tensor, torch.Tensor, list[int]], None]
    vocab: int


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs | None]  # for the rows that asked for ``logprobs``


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


def uniforms(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """``uniform(seed, counter)`` for many pairs at once (float64), in numpy's wrapping uint64."""
    with np.errstate(over="ignore"):
        x = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
        c = np.array(counters, dtype=np.uint64)
        x = _splitmix64_np(_splitmix64_np(x) ^ c)
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) / float(1 << 53))


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_BLOCK = 128
_REJECTION_ROUNDS = 4  # top-p draws tried before a row is settled by sorting


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive ``_BLOCK``-wide slices of each row of ``probs`` [rows, vocab] (float64)."""
    rows, vocab = probs.shape
    full = vocab // _BLOCK * _BLOCK
    sums = probs[:, :full].reshape(rows, -1, _BLOCK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat((sums, probs[:, full:].sum(dim=-1, keepdim=True)), dim=1)
    return sums.double()


def _draw(
    probs: torch.Tensor, u: torch.Tensor, block_sums: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse-CDF draw of one index per row of unnormalized ``probs`` [rows, vocab] (or per
    ``rows`` of it, whose ``block_sums`` are then given), without a full-vocabulary cumulative sum:
    block sums locate the block, a short cumsum the index."""
    vocab = probs.shape[1]
    block_cdf = (_block_sums(probs) if block_sums is None else block_sums).cumsum(dim=-1)
    target = u * block_cdf[:, -1]
    b = torch.searchsorted(block_cdf, target[:, None]).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target[:, None]))
    # the chosen block of each row (the last one may be short: pad it with zeros)
    cols = b * _BLOCK + torch.arange(_BLOCK, device=probs.device)[None, :]
    cols_in = cols.clamp(max=vocab - 1)
    inner = probs.gather(1, cols_in) if rows is None else probs[rows[:, None], cols_in]
    inner = inner.masked_fill_(cols >= vocab, 0.0)
    j = torch.searchsorted(inner.double().cumsum(dim=-1), (target[:, None] - before)).clamp_(max=_BLOCK - 1)
    idx = (b * _BLOCK + j).squeeze(1)
    return idx.clamp_(max=vocab - 1)


def _sample_top_p_by_rejection(
    probs: torch.Tensor,
    rows: list[SampleRow],
    top_p: torch.Tensor,
    sums: torch.Tensor | None = None,
    fused: ModuleType | None = None,
    rounds: int = _REJECTION_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from the full distribution (unnormalized ``probs``) and accept a token iff it lies in
    the nucleus (the mass of strictly more likely tokens is below ``top_p``): accepted draws follow
    the renormalized nucleus exactly. Rows still rejected after ``rounds`` tries are reported for
    the sort path."""
    n = probs.shape[0]
    dev = probs.device
    tokens = torch.zeros(n, dtype=torch.long, device=dev)
    pending = torch.arange(n, device=dev)
    sums = _block_sums(probs) if sums is None else sums
    total = sums.cumsum(dim=-1)[:, -1]  # as _draw's: the last of the cumulative block sums
    for attempt in range(rounds):
        if pending.numel() == 0:
            break
        first = attempt == 0
        p_rows = pending.tolist()
        u = uniforms([rows[i].seed for i in p_rows], [rows[i].step * 8 + attempt for i in p_rows]).to(dev)
        if fused is not None:  # no copies of the pending rows; one fused pass for the mass above
            tok = _draw(probs, u, sums if first else sums[pending], None if first else pending)
            p_tok = probs[pending, tok]
            above = fused.mass_above(probs, pending, p_tok)
        else:
            sub = probs if first else probs[pending]
            tok = _draw(sub, u, sums if first else sums[pending])
            p_tok = sub.gather(1, tok[:, None])
            # sum(relu(p - p_tok)) + p_tok * count(p > p_tok), the count as the sum of the signs
            # (comparisons into bool tensors are several times slower)
            excess = (sub - p_tok).relu_()
            above = excess.sum(dim=-1).double() + p_tok.squeeze(1).double() * excess.sign_().sum(dim=-1).double()
        ok = above < top_p[pending].double() * total[pending]
        tokens[pending[ok]] = tok[ok]
        pending = pending[~ok]
    return tokens, pending


def _sample_sorted(
    probs: torch.Tensor, rows: list[SampleRow], idx: list[int], top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Exact truncation by sorting (top-k, and top-p rows the rejection path could not settle).
    ``probs`` already carry temperature and min-p."""
    dev = probs.device
    sub = torch.log(probs[idx])
    k_max = int(top_k[idx].max())
    if 0 < k_max <= 1024 and bool((top_k[idx] > 0).all()):
        sub, order = sub.topk(k_max, dim=-1)
    else:
        sub, order = sub.sort(dim=-1, descending=True)
    ranks = torch.arange(sub.shape[1], device=dev)[None, :]
    k = top_k[idx][:, None]
    sub = sub.masked_fill((k > 0) & (ranks >= k), float("-inf"))
    probs = torch.softmax(sub, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    probs = probs.masked_fill((before >= top_p[idx][:, None]) & (ranks > 0), 0.0)
    u = uniforms([rows[i].seed for i in idx], [rows[i].step * 8 + 7 for i in idx]).to(dev)
    pick = _draw(probs, u)
    return order.gather(1, pick[:, None]).squeeze(1)


@functools.cache  # decided once per process: sample() asks every step
def fused_kernels(swap: str = "sampling") -> ModuleType | None:
    """``batchgen_kernels.cpu_sampling`` where the compiled CPU kernels build and
    ``BATCHGEN_LIBRARY_KERNELS`` does not send ``swap`` (``sampling``, ``token_mask``) to its
    library path, else None (torch code, or xgrammar's mask kernel, only)."""
    try:
        from batchgen_kernels import cpu, cpu_sampling  # noqa: PLC0415

        if swap in cpu.library_kernels():
            return None
        cpu.load()
    except (ImportError, RuntimeError):
        return None
    return cpu_sampling


def sample(
    logits: torch.Tensor, rows: list[SampleRow], fused: bool | None = None, grammar: GrammarMask | None = None
) -> SampleResult:
    """Pick one token per row of ``logits`` [rows, vocab] (float32): the grammar's mask, blocked
    tokens and penalties applied, greedy rows by argmax, the others drawn from their tempered,
    truncated distribution; with the raw model log-probability of each pick (and the top ones
    where asked).

    ``fused``: the full-vocabulary passes on the compiled CPU kernels (``batchgen_kernels.cpu_sampling``);
    None: where they build and the logits are float32 on the CPU. The torch code is the reference.
    Where the compiled kernels pick every row in one call (greedy, plain and top-p draws) and nothing
    else adjusts the logits, the grammar's mask goes into that call: no masked copy of the logits."""
    greedy_rows = [r.params.temperature == 0 for r in rows]
    temps = [r.params.temperature or 1.0 for r in rows]
    kernels = None
    if fused or (fused is None and logits.device.type == "cpu" and logits.dtype == torch.float32):
        kernels = fused_kernels()
        if kernels is None and fused:
            raise RuntimeError("the compiled CPU kernels are not available here")
    # the kernels where they pick every row in one call (greedy, plain and top-p draws)
    one_call = kernels if all(greedy_rows) or not any(r.params.top_k > 0 or r.params.min_p for r in rows) else None
    mask = None
    if one_call is not None and grammar is not None and fused_kernels("token_mask") is not None:
        if not _adjusts(rows, logits):
            mask, grammar = one_call.RowMask(grammar.mask, grammar.rows, grammar.vocab), None
    x = _adjusted_logits(logits, rows, grammar)
    if kernels is not None and all(greedy_rows):  # the argmax and log-sum-exp only
        tokens, lse = kernels.greedy_pick(x, logits, mask)
        chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse
        return SampleResult(tokens.tolist(), chosen.tolist(), _top_logprobs(logits, tokens, rows))
    if one_call is not None:
        return _sample_in_one_pass(x, logits, rows, one_call, mask)
    tokens = x.argmax(dim=-1) if any(greedy_rows) else torch.zeros(len(rows), dtype=torch.long, device=x.device)
    if kernels is not None:
        inv_temp = torch.tensor([1.0 / t for t in temps], dtype=torch.float32)
        probs, sums, lse = kernels.tempered_softmax(x, logits, inv_temp, _BLOCK)
        if not all(greedy_rows):
            drawn = _draw_rows(probs, rows, tokens, sums, kernels)
            tokens = torch.where(torch.tensor(greedy_rows), tokens, drawn)
        # log p(token) = logit - logsumexp(logits): exact, nothing underflows
        chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse
        return SampleResult(tokens.tolist(), chosen.tolist(), _top_logprobs(logits, tokens, rows))
    # Fused softmax kernels rather than exp / sum passes of our own.
    probs = raw_probs = None
    if not all(greedy_rows):
        if x is logits and all(t == 1.0 for t in temps):
            probs = raw_probs = torch.softmax(logits, dim=-1)
        else:
            scaled = (
                x
                if all(t == 1.0 for t in temps)
                else x * torch.tensor([1.0 / t for t in temps], device=x.device, dtype=x.dtype)[:, None]
            )
            probs = torch.softmax(scaled, dim=-1)
        tokens = torch.where(torch.tensor(greedy_rows, device=x.device), tokens, _draw_rows(probs, rows, tokens))
    if raw_probs is None:
        raw_probs = torch.softmax(logits, dim=-1)
    chosen, top = _logprobs(logits, raw_probs, tokens, rows)
    return SampleResult(tokens.tolist(), chosen.tolist(), top)


def _sample_in_one_pass(
    x: torch.Tensor, logits: torch.Tensor, rows: list[SampleRow], kernels: ModuleType, mask: RowMask | None = None
) -> SampleResult:
    """``sample`` on the compiled kernels for rows without top-k and min-p: greedy, plain and top-p
    draws and the log-probabilities in one call (``kernels.sample_rows``, with the grammar's ``mask``
    where given) that keeps each row's probabilities in cache; the rows top-p by rejection did not
    settle go to the sort path, as in ``_draw_rows``. The tokens are those of the multi-pass route
    (the same arithmetic)."""
    inv_temp = torch.tensor([1.0 / r.params.temperature if r.params.temperature else 0.0 for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
    tokens, chosen, rejected = kernels.sample_rows(
        x, logits, inv_temp, top_p, [r.seed for r in rows], [r.step * 8 for r in rows], _REJECTION_ROUNDS, _BLOCK,
        mask,
    )
    left = torch.nonzero(rejected).flatten()
    if left.numel():
        sub = x[left]  # a copy
        if mask is not None:
            masked = set(mask.rows)
            index = [j for j, i in enumerate(left.tolist()) if i in masked]
            kernels.token_mask(sub, mask.bitmask[left], index, mask.vocab)
        probs, _, lse = kernels.tempered_softmax(sub, logits[left], inv_temp[left], _BLOCK)
        sub_rows = [rows[i] for i in left.tolist()]
        no_k = torch.zeros(len(sub_rows), dtype=torch.long)
        tokens[left] = _sample_sorted(probs, sub_rows, list(range(len(sub_rows))), no_k, top_p[left])
        chosen[left] = logits[left].gather(1, tokens[left][:, None]).squeeze(1) - lse
    return SampleResult(tokens.tolist(), chosen.tolist(), _top_logprobs(logits, tokens, rows))


def _blocked(rows: list[SampleRow], logits: torch.Tensor) -> list[tuple[int, int]]:
    return [(i, t) for i, r in enumerate(rows) for t in r.blocked_ids if t < logits.shape[1]]


def _penalized(rows: list[SampleRow]) -> list[int]:
    return [
        i
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
    ]


def _adjusts(rows: list[SampleRow], logits: torch.Tensor) -> bool:
    """Whether a row blocks tokens or takes a penalty (``_adjusted_logits`` then copies the logits)."""
    return bool(_penalized(rows) or _blocked(rows, logits))


def _adjusted_logits(logits: torch.Tensor, rows: list[SampleRow], grammar: GrammarMask | None = None) -> torch.Tensor:
    """``logits`` with the grammar's disallowed tokens and blocked tokens at -inf and repetition /
    frequency / presence penalties applied (a copy only when a row needs one). Where blocking the
    stop tokens (``min_tokens``) would leave a grammar row no token, the grammar wins."""
    x = logits
    blocked = _blocked(rows, x)
    pen = _penalized(rows)
    if blocked or pen or grammar is not None:
        x = x.clone()
    if grammar is not None:
        grammar.apply(x, grammar.mask, grammar.rows)
    if blocked:
        bi, bt = zip(*blocked, strict=True)
        before = x[list(dict.fromkeys(bi))].clone() if grammar is not None else None
        x[list(bi), list(bt)] = float("-inf")
        if before is not None:
            for j, i in enumerate(dict.fromkeys(bi)):
                if bool(torch.isneginf(x[i]).all()):
                    x[i] = before[j]
    if pen:
        _penalize(x, rows, pen)
    return x


def _draw_rows(
    probs: torch.Tensor,
    rows: list[SampleRow],
    tokens: torch.Tensor,
    sums: torch.Tensor | None = None,
    fused: ModuleType | None = None,
) -> torch.Tensor:
    """One draw per non-greedy row from ``probs`` after min-p, top-k and top-p (greedy rows keep
    ``tokens``): plain draws, top-p by rejection, and a sort only for top-k and rejected rows.
    ``sums``: the block sums of ``probs`` where known; ``fused``: the compiled kernels."""
    n, dev = len(rows), probs.device
    greedy_rows = [r.params.temperature == 0 for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        mp = torch.tensor(min_p, device=dev, dtype=probs.dtype)[:, None]
        probs = probs.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0)
        sums = None
    vocab = probs.shape[1]
    top_k = torch.tensor([min(r.params.top_k, vocab) for r in rows], device=dev)  # past the vocabulary: all
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev, dtype=torch.float32)
    plain = [i for i, r in enumerate(rows) if not greedy_rows[i] and r.params.top_k == 0 and r.params.top_p >= 1]
    nucleus = [i for i, r in enumerate(rows) if not greedy_rows[i] and r.params.top_k == 0 and r.params.top_p < 1]
    with_k = [i for i, r in enumerate(rows) if not greedy_rows[i] and r.params.top_k > 0]
    sampled = tokens.clone()
    if plain:
        u = uniforms([rows[i].seed for i in plain], [rows[i].step * 8 for i in plain]).to(dev)
        everyone = len(plain) == n
        part = None if sums is None else sums if everyone else sums[plain]
        sampled[plain] = _draw(probs if everyone else probs[plain], u, part)
    if nucleus:
        everyone = len(nucleus) == n
        tok, left = _sample_top_p_by_rejection(
            probs if everyone else probs[nucleus],
            [rows[i] for i in nucleus],
            top_p if everyone else top_p[nucleus],
            None if sums is None else sums if everyone else sums[nucleus],
            fused,
        )
        sampled[nucleus] = tok
        with_k += [nucleus[i] for i in left.tolist()]
    if with_k:
        sampled[with_k] = _sample_sorted(probs, rows, with_k, top_k, top_p)
    return sampled


def _logprobs(
    logits: torch.Tensor, raw_probs: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]
) -> tuple[torch.Tensor, list[TopLogprobs | None]]:
    """The raw model log-probability of each chosen token, and the top ``logprobs`` per row that
    asks for them. The log of the raw probability (softmax is cheaper than log_softmax); one that
    (nearly) underflowed is recomputed exactly for its row."""
    chosen = raw_probs.gather(1, tokens[:, None]).squeeze(1).log()
    tiny = torch.nonzero(chosen < _INEXACT_LOG_PROB).flatten().tolist()
    if tiny:
        exact = torch.log_softmax(logits[tiny], dim=-1).gather(1, tokens[tiny][:, None]).squeeze(1)
        chosen[tiny] = exact
    return chosen, _top_logprobs(logits, tokens, rows)


class TopLogprobs(NamedTuple):
    """One row's log-probability details: the chosen token's ``rank`` (1 = the most likely) and the
    row's top ``k`` tokens and log-probabilities, best first."""

    rank: int
    ids: np.ndarray  # int32 [k]
    logprobs: np.ndarray  # float32 [k]


def _top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[TopLogprobs | None]:
    top: list[TopLogprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        entries = top_logprobs(logits[want], tokens[want], [rows[i].params.logprobs or 0 for i in want])
        for i, entry in zip(want, entries, strict=True):
            top[i] = entry
    return top


def top_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_k: list[int], logp: torch.Tensor | None = None
) -> list[TopLogprobs]:
    """Per row of ``logits`` [n, vocab] (raw, float32): the rank of ``targets[j]`` (1 + the tokens
    more likely than it) and the row's top ``top_k[j]`` tokens with their log-probabilities, as
    vLLM reports ``logprobs`` and ``prompt_logprobs``. ``logp``: the rows' log-softmax, when the
    caller has it."""
    if logp is None:
        logp = torch.log_softmax(logits, dim=-1)
    top_k = [min(kk, logits.shape[1]) for kk in top_k]
    k = max(top_k, default=0)
    vals, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    ranks = ((logits > logits.gather(1, targets[:, None])).sum(dim=-1) + 1).tolist()
    ids_np = ids.to(torch.int32).cpu().numpy()
    vals_np = vals.float().cpu().numpy()
    # each row's own copy: a view would keep the whole step's arrays (with k = 0, its log-softmax)
    # alive for as long as the sequence holds its row
    return [TopLogprobs(ranks[j], ids_np[j, :kk].copy(), vals_np[j, :kk].copy()) for j, kk in enumerate(top_k)]


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int | None
) -> list[tuple[float, TopLogprobs | None]]:
    """Per row j of ``logits`` [n, vocab] (raw, float32): the log-probability of ``targets[j]``
    and, with ``top_k``, its rank and the row's top ``top_k`` (``top_logprobs``), from one
    log-softmax: the values of ``prompt_logprobs`` and of scored continuations."""
    logp = torch.log_softmax(logits, dim=-1)
    values = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    if top_k is None:
        return [(v, None) for v in values]
    return list(zip(values, top_logprobs(logits, targets, [top_k] * len(values), logp), strict=True))
