"""The data of one step between the engine and the model runner: what to compute in one forward
pass and which blocks to move first.

The engine builds a ``StepBatch`` from the scheduler's decisions; ``ModelRunner.execute`` consumes
it. This module imports neither side, so imports run one way::

    engine/  ──▶  step.py  ◀──  model/

(vLLM's ``SchedulerOutput`` and mini-sglang's ``core.py`` play the same part.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class CopyPair(NamedTuple):
    """Copy physical block ``src`` into ``dst`` before this step's forward pass (copy-on-write;
    for swaps, between the device pool and the host pool)."""

    src: int
    dst: int


class Swap(NamedTuple):
    """Blocks moved between the device pool and the host pool: ``(device, host)`` pairs when
    ``to_host``, ``(host, device)`` pairs otherwise."""

    to_host: bool
    pairs: list[CopyPair]


class Chunk(NamedTuple):
    """One sequence's part of the flattened batch: ``token_ids`` at positions ``start`` onwards,
    its KV written through ``block_table``. ``samples``: the chunk ends the sequence, so the logits
    of its last token are returned."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    samples: bool
    all_logits: bool = False  # the logits of every token are returned (prompt log-probabilities)
    seq_len: int = 0  # the sequence's length, computed or not (LongRoPE picks its frequencies by it)
    lora_id: int = 0  # the sequence's LoRA adapter (``LoRARequest.lora_int_id``; 0: the base model)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepBatch:
    """Everything the runner needs for one step, in the order it applies it: ``swaps`` (in the
    order decided), zeroing of ``fresh_blocks``, ``copies``, then the forward pass over ``chunks``."""

    chunks: list[Chunk] = field(default_factory=list)
    copies: list[CopyPair] = field(default_factory=list)
    fresh_blocks: list[int] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)


class StepResult(NamedTuple):
    """What one forward pass returns: the logits of each sampling chunk's last token, in chunk
    order, and for each chunk that asked (``all_logits``), the logits of all its tokens."""

    logits: Any  # torch.Tensor [sampling chunks, vocab], float32
    chunk_logits: dict[int, Any]  # chunk index -> [tokens, vocab]
