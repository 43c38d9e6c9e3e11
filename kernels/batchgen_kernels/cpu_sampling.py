"""The sampler's fused full-vocabulary passes on the compiled CPU kernel (``cpu_sampling.cpp``).
``batchgen.engine.sampler`` uses them for float32 logits on the CPU when the library builds; its
torch code is the reference and the fallback."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from batchgen_kernels.cpu import load
from batchgen_kernels.cpu_args import KernelArgumentError, expect


def _logits(kernel: str, adjusted: torch.Tensor, raw: torch.Tensor) -> tuple[int, int]:
    expect(kernel, "adjusted", adjusted, torch.float32, (None, None))
    expect(kernel, "raw", raw, torch.float32, tuple(adjusted.shape))
    return adjusted.shape[0], adjusted.shape[1]


def tempered_softmax(
    adjusted: torch.Tensor, raw: torch.Tensor, inv_temp: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 logits [rows, vocab] on the CPU: ``exp((adjusted - max) * inv_temp)`` per row
    (unnormalized, float32), its sums over consecutive ``block``-token slices (float64, [rows,
    ceil(vocab / block)]) and the log-sum-exp of ``raw`` per row (float32)."""
    rows, vocab = _logits("tempered_softmax", adjusted, raw)
    expect("tempered_softmax", "inv_temp", inv_temp, shape=(rows,))
    adjusted, raw = adjusted.contiguous(), raw.contiguous()
    inv_temp = inv_temp.to(torch.float32).contiguous()
    probs = torch.empty_like(adjusted)
    sums = torch.empty((rows, -(-vocab // block)), dtype=torch.float64)
    lse = torch.empty(rows, dtype=torch.float32)
    rc = load().tempered_softmax(
        adjusted.data_ptr(),
        raw.data_ptr(),
        rows,
        vocab,
        inv_temp.data_ptr(),
        block,
        probs.data_ptr(),
        sums.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"tempered_softmax: block {block} is not a multiple of 16")
    return probs, sums, lse


class RowMask(NamedTuple):
    """Structured outputs' mask as ``sample_rows`` and ``greedy_pick`` take it: ``bitmask`` (int32
    [rows, words], xgrammar's layout: bit j % 32 of word j / 32 set where token j is allowed) applies
    to the tokens below ``vocab`` of ``rows`` (the others are not masked), as ``token_mask`` would
    apply it to ``adjusted`` first."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab: int


def _mask_args(kernel: str, mask: RowMask | None, rows: int, vocab: int) -> tuple[int, int, int, int, tuple]:
    """The kernel's (bitmask, words, mask_vocab, masked) pointers and sizes, and the tensors to keep alive."""
    if mask is None or rows == 0:
        return 0, 0, 0, 0, ()
    expect(kernel, "bitmask", mask.bitmask, torch.int32, (rows, None), contiguous=True)
    words = mask.bitmask.shape[1]
    if not 0 < mask.vocab <= min(vocab, words * 32):
        raise KernelArgumentError(
            f"{kernel}: the mask's vocab {mask.vocab} must be positive and within the logits' {vocab} columns "
            f"and bitmask's {words * 32} bits"
        )
    if mask.rows and not 0 <= min(mask.rows) <= max(mask.rows) < rows:
        raise KernelArgumentError(f"{kernel}: the mask's rows must index the logits' {rows} rows")
    masked = torch.zeros(rows, dtype=torch.uint8)
    masked[mask.rows] = 1
    return mask.bitmask.data_ptr(), words, mask.vocab, masked.data_ptr(), (masked,)


def greedy_pick(
    adjusted: torch.Tensor, raw: torch.Tensor, mask: RowMask | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 logits [rows, vocab] on the CPU: per row the first position of the largest
    ``adjusted`` logit (int64, as ``argmax``; ``mask`` applied first where given) and the log-sum-exp
    of ``raw`` (float32), without the probabilities ``tempered_softmax`` writes."""
    rows, vocab = _logits("greedy_pick", adjusted, raw)
    adjusted, raw = adjusted.contiguous(), raw.contiguous()
    bits, words, mask_vocab, masked, _keep = _mask_args("greedy_pick", mask, rows, vocab)
    token = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    load().greedy_pick(
        adjusted.data_ptr(),
        raw.data_ptr(),
        rows,
        vocab,
        bits,
        words,
        mask_vocab,
        masked,
        token.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    return token, lse


def mass_above(probs: torch.Tensor, rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """For each ``rows[i]`` of float32 ``probs`` [*, vocab]: the sum of its values strictly
    greater than ``threshold[i]`` (float64)."""
    expect("mass_above", "probs", probs, torch.float32, (None, None))
    expect("mass_above", "rows", rows, shape=(None,))
    expect("mass_above", "threshold", threshold, shape=tuple(rows.shape))
    if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < probs.shape[0]:
        raise KernelArgumentError(f"mass_above: rows must index probs' {probs.shape[0]} rows")
    probs = probs.contiguous()
    rows = rows.to(torch.int64).contiguous()
    threshold = threshold.to(torch.float32).contiguous()
    out = torch.empty(len(rows), dtype=torch.float64)
    load().mass_above(
        probs.data_ptr(),
        probs.shape[1],
        rows.data_ptr(),
        len(rows),
        threshold.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def sample_rows(
    adjusted: torch.Tensor,
    raw: torch.Tensor,
    inv_temp: torch.Tensor,
    top_p: torch.Tensor,
    seeds: list[int],
    counters: list[int],
    rounds: int,
    block: int,
    mask: RowMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row of float32 logits [rows, vocab] on the CPU, in one pass per row without
    writing the probabilities: ``inv_temp`` 0 marks a greedy row (the argmax of ``adjusted``); the
    others draw from ``exp((adjusted - max) * inv_temp)`` with ``uniform(seed, counter + attempt)``,
    accepted at once where ``top_p`` >= 1, else by top-p rejection over up to ``rounds`` attempts.
    ``mask``: structured outputs' mask, applied to ``adjusted``'s rows in cache, not in place.
    Returns the tokens (int64), their raw log-probabilities (float32, from ``raw``) and which rows
    no attempt was accepted for (bool: the caller settles those by sorting)."""
    rows, vocab = _logits("sample_rows", adjusted, raw)
    expect("sample_rows", "inv_temp", inv_temp, shape=(rows,))
    expect("sample_rows", "top_p", top_p, shape=(rows,))
    if len(seeds) != rows or len(counters) != rows:
        raise KernelArgumentError(f"sample_rows: seeds and counters must have one entry per row ({rows})")
    adjusted, raw = adjusted.contiguous(), raw.contiguous()
    inv_temp = inv_temp.to(torch.float32).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    seed_array = np.array([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64)
    counter = torch.tensor(counters, dtype=torch.int64)
    bits, words, mask_vocab, masked, _keep = _mask_args("sample_rows", mask, rows, vocab)
    token = torch.empty(rows, dtype=torch.int64)
    logprob = torch.empty(rows, dtype=torch.float32)
    rejected = torch.empty(rows, dtype=torch.uint8)
    rc = load().sample_rows(
        adjusted.data_ptr(),
        raw.data_ptr(),
        rows,
        vocab,
        inv_temp.data_ptr(),
        top_p.data_ptr(),
        seed_array.ctypes.data,
        counter.data_ptr(),
        rounds,
        block,
        bits,
        words,
        mask_vocab,
        masked,
        token.data_ptr(),
        logprob.data_ptr(),
        rejected.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"sample_rows: block {block} is not a multiple of 16")
    return token, logprob, rejected.bool()


def token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """Structured outputs' mask, in place: in each of ``rows`` of float32 ``logits`` [*, >= vocab]
    (rows may be strided, each row contiguous), the tokens below ``vocab`` whose bit in int32
    ``bitmask`` [same rows, >= ceil(vocab / 32)] (xgrammar's layout) is 0 become -inf."""
    expect("token_mask", "logits", logits, torch.float32, (None, None))
    expect("token_mask", "bitmask", bitmask, torch.int32, (logits.shape[0], None), contiguous=True)
    if logits.stride(1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
        raise KernelArgumentError(f"token_mask: logits' rows must be contiguous (strides {logits.stride()})")
    if not 0 < vocab <= min(logits.shape[1], bitmask.shape[1] * 32):
        raise KernelArgumentError(
            f"token_mask: vocab {vocab} must be positive and within logits' {logits.shape[1]} columns and "
            f"bitmask's {bitmask.shape[1] * 32} bits"
        )
    index = torch.tensor(rows, dtype=torch.int64)
    if not rows:
        return
    if not 0 <= int(index.min()) <= int(index.max()) < logits.shape[0]:
        raise KernelArgumentError(f"token_mask: rows must index logits' {logits.shape[0]} rows")
    load().token_mask(
        logits.data_ptr(),
        logits.stride(0),
        vocab,
        bitmask.data_ptr(),
        bitmask.shape[1],
        index.data_ptr(),
        len(rows),
        torch.get_num_threads(),
    )
