"""Engine statistics: step counts and time split, and the KV-cache figures of ``LLM.stats()``.

Kept apart from the step loop. Per step only counters move and the live sequences' computed tokens
are summed; the walk over block tables that measures unused slots runs only when the physical peak
rises (at most a few times per run once the pool is warm).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sequence import Sequence
from batchgen.utils import cdiv


class EngineStats:
    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.values: defaultdict[str, float] = defaultdict(float)

    def clear(self) -> None:
        self.values.clear()

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``key``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.values[key] += time.perf_counter() - t0

    def note_step(self, token_counts: list[int], seconds: float, prompt_tokens: int = 0) -> None:
        """A step with any prefill chunk counts as prefill time, a pure decode step as decode time.
        ``prompt_tokens``: tokens of prompts computed in the step (not found in the prefix cache)."""
        v = self.values
        v["prompt_tokens_computed"] += prompt_tokens
        v["steps"] += 1
        prefill = [n for n in token_counts if n > 1]
        v["prefill_s" if prefill else "decode_s"] += seconds
        v["prefill_tokens"] += sum(prefill)
        v["decode_tokens"] += len(token_counts) - len(prefill)

    def note_kv_usage(self, live: Iterable[Sequence], bm: BlockManager) -> None:
        """Track the peak KV tokens held logically (sum over live sequences) and physically (slots
        in used blocks), with what contiguous or max-length reservations would have held then."""
        v = self.values
        live = list(live)
        logical = sum(s.num_computed_tokens for s in live)
        if logical > v["peak_logical_kv_tokens"]:
            v["peak_logical_kv_tokens"] = logical
            v["contiguous_reserved_at_peak"] = sum(
                s.num_prompt_tokens + min(s.group.params.max_tokens or self.max_model_len, self.max_model_len)
                for s in live
            )
            v["max_len_reserved_at_peak"] = len(live) * self.max_model_len
        physical = bm.num_used_blocks * self.block_size
        if physical > v["peak_physical_kv_slots"]:
            v["peak_physical_kv_slots"] = physical
            v["unused_slots_in_held_blocks_at_peak"] = self._unused_slots(live, bm)
            # blocks the same sequences would hold without sharing (each its own copy of everything)
            v["unshared_blocks_at_peak"] = sum(cdiv(s.num_computed_tokens, self.block_size) for s in live)

    def _unused_slots(self, live: list[Sequence], bm: BlockManager) -> int:
        """Unused slots in held blocks. Blocks before a sequence's last written one are full; only
        each sequence's tail (the block of its next token and any after it) can have unused slots.
        A tail block also held by a sequence that has filled it (more holders than tail holders) is
        full."""
        bs = self.block_size
        fill: dict[int, int] = {}
        tail_holders: dict[int, int] = {}
        for s in live:
            table = bm.table(s.seq_id)
            c = s.num_computed_tokens
            for i in range(c // bs, len(table)):
                b = table[i]
                fill[b] = max(fill.get(b, 0), c - i * bs)
                tail_holders[b] = tail_holders.get(b, 0) + 1
        blocks = bm.pool.blocks
        return sum(bs - max(f, 0) for b, f in fill.items() if blocks[b].ref_count == tail_holders[b])

    def kv_figures(self) -> dict[str, float | int]:
        v = self.values
        out: dict[str, float | int] = {
            "peak_logical_kv_tokens": int(v["peak_logical_kv_tokens"]),
            "peak_physical_kv_slots": int(v["peak_physical_kv_slots"]),
            "unused_slots_in_held_blocks_at_peak": int(v["unused_slots_in_held_blocks_at_peak"]),
            "contiguous_reserved_slots_at_peak": int(v["contiguous_reserved_at_peak"]),
            "max_len_reserved_slots_at_peak": int(v["max_len_reserved_at_peak"]),
        }
        logical, physical = out["peak_logical_kv_tokens"], out["peak_physical_kv_slots"]
        out["physical_over_logical"] = physical / logical if logical else 0.0
        unshared = v["unshared_blocks_at_peak"]
        out["kv_saved_by_sharing"] = 1 - (physical // self.block_size) / unshared if unshared else 0.0
        return out

    def step_figures(self) -> dict[str, float | int]:
        v = self.values
        counts = {k: int(v[k]) for k in ("steps", "prefill_tokens", "decode_tokens", "prompt_tokens_computed")}
        times = {
            k: v[k]
            for k in ("schedule_s", "model_s", "postprocess_s", "sampler_s", "output_s", "prefill_s", "decode_s")
        }
        return {**counts, **times}
