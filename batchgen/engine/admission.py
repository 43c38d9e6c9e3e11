"""Admission order that finds the sharing in a dataset, and duplicate requests computed once.

The prefix cache shares KV blocks between requests whose prompts start alike, but only while
those blocks are still cached. In a dataset the rows that share a long prefix (a few-shot
template, a system prompt, a document) are scattered; fed in input order, a pool that cannot hold
every template at once evicts a prefix before its next row arrives. Offline, the upcoming rows
are known, so the admission order can keep rows of one prefix together:

* ``prefix_order`` orders a list known in full (``LLM.generate``): rows grouped by their first
  full block, groups in order of first appearance, rows within a group sorted by their full
  blocks' tokens (so deeper shared prefixes are adjacent too). Rows without a full block, and
  rows whose first block no other row shares, keep their place.
* ``PrefixWindow`` does the same over a bounded window of a stream (a job): the next row is one
  sharing the most leading blocks with the row admitted last, else one whose first block is in the
  prefix cache, else one of the largest group; no row waits longer than ``capacity`` admissions.

Block hashes are the block manager's chained hashes (``hash_block``), so "shares a block" means
exactly what the prefix cache means by it. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from batchgen.engine.block_manager import hash_block
from batchgen.params import RequestParams, SamplingParams

T = TypeVar("T")

# Leading blocks indexed per row: deeper sharing than this counts as this deep.
MAX_INDEXED_BLOCKS = 64


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the leading full blocks (at most ``limit``), as the prefix cache keys them."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    out: list[int] = []
    parent = None
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def prefix_order(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Indices of ``prompts`` in admission order (see the module's docstring)."""
    first_seen: dict[tuple[int, ...], int] = {}
    keys: list[tuple[int, tuple[int, ...]]] = []
    for i, ids in enumerate(prompts):
        full = len(ids) // block_size * block_size
        if full == 0:
            keys.append((i, ()))
            continue
        head = tuple(ids[:block_size])
        rank = first_seen.setdefault(head, i)
        keys.append((rank, tuple(ids[:full])))
    return sorted(range(len(prompts)), key=lambda i: keys[i])


def duplicate_key(
    token_ids: Sequence[int], params: RequestParams, lora_id: int = 0
) -> tuple | None:
    """Requests with equal keys produce equal outputs: the same prompt, adapter and parameters, and
    parameters that leave nothing to chance (beam search, greedy, or an explicit seed: a seeded
    request's draws do not depend on the batch; a greedy request's seed is irrelevant). None: the
    request must run on its own."""
    if isinstance(params, SamplingParams):
        if params.temperature == 0 or params.top_k == 1:
            params = dataclasses.replace(params, seed=None)
        elif params.seed is None:
            return None
    return (tuple(token_ids), lora_id, type(params).__name__, repr(params))


def admission_plan(
    prompts: Sequence[Sequence[int]],
    params: Sequence[RequestParams],
    block_size: int,
    by_prefix: bool = True,
    lora_ids: Sequence[int] | None = None,
) -> tuple[list[int], dict[int, int]]:
    """For a list of requests known in full (``LLM.generate``, a Ray replica's batch): the indices
    to add to the engine, in admission order (``prefix_order`` when ``by_prefix``, else as given),
    and the identical deterministic requests computed once (a duplicate's index -> the index
    computed; only when ``by_prefix``). ``lora_ids``: each request's adapter (0: none)."""
    order: Sequence[int] = range(len(prompts))
    if by_prefix and len(prompts) > 1:
        order = prefix_order(prompts, block_size)
    leaders: dict[tuple, int] = {}
    copies: dict[int, int] = {}
    add = []
    for i in order:
        key = duplicate_key(prompts[i], params[i], lora_ids[i] if lora_ids else 0) if by_prefix else None
        if key is not None and key in leaders:
            copies[i] = leaders[key]
            continue
        if key is not None:
            leaders[key] = i
        add.append(i)
    return add, copies


@dataclass
class _Entry(Generic[T]):
    item: T
    arrived: int  # admissions made before this item arrived
    hashes: list[int]


@dataclass
class PrefixWindow(Generic[T]):
    """A bounded window of pending items, each with its prompt's token ids; ``pop`` returns the
    next one to admit. ``is_cached(hash)`` says whether the prefix cache holds a block."""

    block_size: int
    capacity: int
    is_cached: Callable[[int], bool] = lambda h: False
    _entries: dict[int, _Entry[T]] = field(default_factory=dict)
    _by_hash: dict[int, set[int]] = field(default_factory=dict)
    _last: list[int] = field(default_factory=list)  # block hashes of the row admitted last
    _counter: itertools.count = field(default_factory=itertools.count)
    _admitted: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.capacity

    def add(self, item: T, token_ids: Sequence[int]) -> None:
        seq = next(self._counter)
        hashes = block_hashes(token_ids, self.block_size, MAX_INDEXED_BLOCKS)
        self._entries[seq] = _Entry(item, self._admitted, hashes)
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(seq)

    def pop(self) -> T:
        if not self._entries:
            raise IndexError("pop from an empty PrefixWindow")
        oldest = next(iter(self._entries))  # dicts keep insertion order
        if self._admitted - self._entries[oldest].arrived >= self.capacity:  # no row starves
            return self._take(oldest)
        for h in reversed(self._last):  # the most leading blocks shared with the row admitted last
            rows = self._by_hash.get(h)
            if rows:
                return self._take(min(rows))
        best, best_key = oldest, (-1, 0)
        for seq, entry in self._entries.items():
            if not entry.hashes:
                continue
            head = entry.hashes[0]
            # a cached first block first, then the largest group; ties: the oldest
            key = (1 if self.is_cached(head) else 0, len(self._by_hash[head]))
            if key > best_key:
                best, best_key = seq, key
        return self._take(best)

    def _take(self, seq: int) -> T:
        entry = self._entries.pop(seq)
        for h in entry.hashes:
            rows = self._by_hash[h]
            rows.discard(seq)
            if not rows:
                del self._by_hash[h]
        self._last = entry.hashes
        self._admitted += 1
        return entry.item


class PromptBlockCounter:
    """Prompt tokens a perfect admission order would compute: every distinct full block once
    (by chained hash), plus each prompt's partial last block. Counts exactly up to ``max_blocks``
    distinct blocks, then stops (``exact`` turns False) to keep memory flat."""

    def __init__(self, block_size: int, max_blocks: int = 1 << 18) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.distinct: set[int] = set()
        self.partial_tokens = 0
        self.exact = True

    def add(self, token_ids: Sequence[int]) -> None:
        if not self.exact:
            return
        self.partial_tokens += len(token_ids) % self.block_size
        self.distinct.update(block_hashes(token_ids, self.block_size))
        if len(self.distinct) > self.max_blocks:
            self.exact = False
            self.distinct.clear()

    @property
    def tokens(self) -> int | None:
        return len(self.distinct) * self.block_size + self.partial_tokens if self.exact else None
