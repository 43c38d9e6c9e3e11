"""Beam search's candidate step on the compiled CPU kernel (``cpu_beam.cpp``): per group of k
beams, the best ``keep`` continuations by ``log_softmax(logits) + running score``, read straight
from the float32 logits. ``batchgen.engine.beam`` uses it on the CPU where the library
builds; its torch code (``log_softmax``, then ``topk``) is the reference and the fallback."""

from __future__ import annotations

import torch

from batchgen_kernels.cpu import available, load
from batchgen_kernels.cpu_args import KernelArgumentError, expect


def takes(logits: torch.Tensor) -> bool:
    """Whether the kernel runs on these logits: a CPU float32 matrix."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and available()


def beam_topk(
    logits: torch.Tensor, rows: torch.Tensor, running: torch.Tensor, k: int, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``G = len(rows) // k`` groups, beam i of group g reading ``logits[rows[g*k + i]]`` with
    running score ``running[g*k + i]``: the ``keep`` best scores ``log_softmax(row)[t] + running``
    of each group ([G, keep] float32, descending, equal scores by the lower index) and their flat
    indices ``i * vocab + t`` ([G, keep] int64), as ``torch.topk`` over the [G, k * vocab] scores."""
    expect("beam_topk", "logits", logits, torch.float32, (None, None))
    expect("beam_topk", "rows", rows, shape=(None,))
    expect("beam_topk", "running", running, shape=tuple(rows.shape))
    if k < 1 or len(rows) % k:
        raise KernelArgumentError(f"beam_topk: rows ({len(rows)}) must be whole groups of k = {k} beams")
    if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]:
        raise KernelArgumentError(f"beam_topk: rows must index logits' {logits.shape[0]} rows")
    logits = logits.contiguous()
    vocab = logits.shape[1]
    rows = rows.to(torch.int64).contiguous()
    running = running.to(torch.float32).contiguous()
    groups = len(rows) // k
    scores = torch.empty((groups, keep), dtype=torch.float32)
    index = torch.empty((groups, keep), dtype=torch.int64)
    rc = load().beam_topk_f32(
        logits.data_ptr(),
        vocab,
        rows.data_ptr(),
        running.data_ptr(),
        groups,
        k,
        keep,
        scores.data_ptr(),
        index.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"beam_topk: keep {keep} is not in 1..{k * vocab}")
    return scores, index
