"""The sampler's fused full-vocabulary passes on the compiled CPU kernel (``cpu_sampling.cpp``).
``batchgen.engine.sampler`` uses them for float32 logits on the CPU when the library builds; its
torch code is the reference and the fallback."""

from __future__ import annotations

import torch

from kernels.cpu import load


def tempered_softmax(
    adjusted: torch.Tensor, raw: torch.Tensor, inv_temp: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 logits [rows, vocab] on the CPU: ``exp((adjusted - max) * inv_temp)`` per row
    (unnormalized, float32), its sums over consecutive ``block``-token slices (float64, [rows,
    ceil(vocab / block)]) and the log-sum-exp of ``raw`` per row (float32)."""
    rows, vocab = adjusted.shape
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


def greedy_pick(adjusted: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 logits [rows, vocab] on the CPU: per row the first position of the largest
    ``adjusted`` logit (int64, as ``argmax``) and the log-sum-exp of ``raw`` (float32), without
    the probabilities ``tempered_softmax`` writes."""
    rows, vocab = adjusted.shape
    adjusted, raw = adjusted.contiguous(), raw.contiguous()
    token = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    load().greedy_pick(
        adjusted.data_ptr(),
        raw.data_ptr(),
        rows,
        vocab,
        token.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    return token, lse


def mass_above(probs: torch.Tensor, rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """For each ``rows[i]`` of float32 ``probs`` [*, vocab]: the sum of its values strictly
    greater than ``threshold[i]`` (float64)."""
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
