"""Paged KV-cache bookkeeping: a block pool with reference counts and prefix caching, and one block
table per sequence. Pure Python (no torch): the model runner applies what this decides.

How it works::

    physical blocks   [0][1][2][3][4][5][6][7]      one KV slab per layer, indexed by block id
    seq A table        0  1  4                      logical block i -> physical block id
    seq B table        0  1  5                      B forked from A after 2 full blocks: 0, 1 shared
    refcount           2  2  .  .  1  1  .  .
    free queue        head-> 6 7 2 3 <-tail         O(1) doubly-linked list, also the LRU of cached blocks

* A full block gets a hash chaining its parent's hash and its tokens (plus an extra key that
  changes the content's meaning); ``hash -> block`` finds it for a new request with the same start.
  Lookups compare the tokens too, so a hash collision can never hand out the wrong KV.
* ``fork`` copies a table and raises every refcount: nothing is copied.
* Writing into a block that is shared (refcount > 1) or hashed first moves the writer to a fresh
  block and records ``CopyPair(src, dst)``; the runner copies all pairs of a step in one op.
* Freed blocks go to the free queue: unhashed ones at the head (reused first), hashed ones at the
  tail, so cached prefixes are evicted least-recently-freed first and stay findable until reused.
* Swap preemption moves a group's tables to host blocks (``swap_out``: each distinct device block
  once, so blocks shared inside the group stay shared on the host) and back (``swap_in``, into new
  device blocks). Host blocks freed by a swap-in return to the host free list only at the next
  ``begin_step``: the runner reads them during the step in which they were freed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from batchgen.step import CopyPair
from batchgen.utils import cdiv

__all__ = ["Block", "BlockManager", "BlockPool", "CopyPair", "FreeBlockQueue", "PrefixMatch"]


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly-linked list of blocks with O(1) popleft, append, appendleft and remove."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self._len += 1

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next)  # type: ignore[arg-type]

    def remove(self, block: Block) -> None:
        block.prev.next = block.next  # type: ignore[union-attr]
        block.next.prev = block.prev  # type: ignore[union-attr]
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        if self._len == 0:
            raise RuntimeError("no free KV block")
        block = self._head.next
        self.remove(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]

    def ids(self) -> list[int]:
        out, b = [], self._head.next
        while b is not self._tail:
            out.append(b.block_id)  # type: ignore[union-attr]
            b = b.next  # type: ignore[union-attr]
        return out


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: object = None) -> int:
    """The chained hash of a full block: parent's hash, this block's tokens, and an extra key."""
    return hash((parent_hash, extra_key, tuple(token_ids)))


class BlockPool:
    """A fixed set of blocks with reference counts, a free queue and ``hash -> block``."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the least recently freed block, dropping its cached identity if it had one."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def acquire(self, block: Block) -> None:
        """Add a reference; a cached free block leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    def set_hash(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Make a full block findable. If another block already holds this content, keep that one."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block


class PrefixMatch(NamedTuple):
    """Leading full blocks of a token sequence found in the cache, and how many of them are free."""

    block_ids: list[int]
    hashes: list[int]
    free_block_ids: list[int]  # the matched blocks that are free (cached, refcount 0)
    next_hash: int | None = None  # hash of the first full block that missed, if any

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_free_hits(self) -> int:
        """Free blocks that taking this match removes from the free queue."""
        return len(self.free_block_ids)


@dataclass
class _SeqBlocks:
    table: list[int]
    hashes: list[int]  # chained hashes of this sequence's leading full blocks (len <= len(table))


class BlockManager:
    """Block tables of all live sequences over one ``BlockPool``.

    Queries (``match_prefix``, ``blocks_needed``) never mutate; their mutations sit beside them
    (``allocate_prefix``, ``append_slots``). Sequences are identified by integer ids.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[int, _SeqBlocks] = {}
        # host pool for swap preemption: free ids (a stack), reference counts, swapped tables
        self.num_host_blocks = num_host_blocks
        self.host_free = list(range(num_host_blocks - 1, -1, -1))
        self.host_refs = [0] * num_host_blocks
        self.host_pending_free: list[int] = []
        self.swapped: dict[int, list[int]] = {}
        self.num_cow_copies = 0
        self.prefix_hit_tokens = 0
        # Blocks handed out since the last ``take_fresh_blocks``: the runner zeroes them, so that a
        # masked-out slot never holds NaN garbage (0 x NaN is NaN in the attention matmul).
        self.fresh_blocks: list[int] = []
        self.peak_used_blocks = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block of this chained hash is in the prefix cache (in use or free)."""
        return block_hash in self.pool.cached

    def table(self, seq_id: int) -> list[int]:
        entry = self.seqs.get(seq_id)
        return entry.table if entry is not None else []

    def match_prefix(
        self, token_ids: Sequence[int], extra_key: object = None, max_blocks: int | None = None
    ) -> PrefixMatch:
        """Cached leading full blocks of ``token_ids`` (at most ``max_blocks``)."""
        limit = len(token_ids) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        ids: list[int] = []
        hashes: list[int] = []
        free_ids: list[int] = []
        for _, h, chunk in self._chain(token_ids, None, 0, limit, extra_key):
            block = self.pool.lookup(h, chunk)
            if block is None:
                return PrefixMatch(ids, hashes, free_ids, h)
            ids.append(block.block_id)
            hashes.append(h)
            if block.ref_count == 0:
                free_ids.append(block.block_id)
        return PrefixMatch(ids, hashes, free_ids)

    def _chain(
        self, token_ids: Sequence[int], parent: int | None, first: int, end: int, extra_key: object
    ) -> Iterator[tuple[int, int, Sequence[int]]]:
        """``(index, chained hash, tokens)`` of full blocks ``first`` .. ``end - 1`` of
        ``token_ids``, the chain continuing from ``parent`` (the hash of block ``first - 1``)."""
        bs = self.block_size
        for i in range(first, end):
            chunk = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block(parent, chunk, extra_key)
            yield i, parent, chunk

    def chain_hashes(
        self, token_ids: Sequence[int], match: PrefixMatch, end: int, extra_key: object = None
    ) -> list[int]:
        """Hashes of the full blocks after ``match`` that the first ``end`` tokens fill."""
        parent = match.hashes[-1] if match.hashes else None
        return [h for _, h, _ in self._chain(token_ids, parent, match.num_blocks, end // self.block_size, extra_key)]

    def blocks_needed(self, seq_id: int, num_computed: int, num_new: int) -> int:
        """Free blocks that ``append_slots(seq_id, num_computed, num_new)`` would take."""
        return self.blocks_needed_many([(seq_id, num_computed, num_new)])

    def blocks_needed_many(self, writes: Sequence[tuple[int, int, int]]) -> int:
        """Free blocks that ``append_slots`` over every ``(seq_id, num_computed, num_new)`` of
        ``writes``, in order, would take. A swapped-out sequence is counted as if swapped in.

        A shared block written by ``w`` of its ``r`` holders is copied ``w`` times, except that
        when all of them write (``w == r``) the last one finds it private and writes in place:
        the n samples of a prompt whose last block is partial take n - 1 copies, not n.
        """
        bs = self.block_size
        need = 0
        writers: dict[tuple[bool, int], int] = {}
        for seq_id, num_computed, num_new in writes:
            on_host = seq_id in self.swapped
            table = self.swapped[seq_id] if on_host else self.table(seq_id)
            need += max(cdiv(num_computed + num_new, bs) - len(table), 0)
            first = num_computed // bs
            if num_new > 0 and first < len(table):
                key = (on_host, table[first])
                writers[key] = writers.get(key, 0) + 1
        for (on_host, block_id), w in writers.items():
            if on_host:  # swapped-in blocks come back unhashed, shared as on the host
                refs, hashed = self.host_refs[block_id], False
            else:
                block = self.pool.blocks[block_id]
                refs, hashed = block.ref_count, block.block_hash is not None
            need += w - 1 if w == refs and not hashed else w
        return need

    def has_blocks(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds any block, on the device or swapped out to the host."""
        return bool(self.table(seq_id) or self.swapped.get(seq_id))

    # -- mutations -----------------------------------------------------------------------------
    def allocate_prefix(self, seq_id: int, match: PrefixMatch) -> int:
        """Start ``seq_id``'s table with the matched cached blocks; returns the cached token count."""
        assert seq_id not in self.seqs or not self.seqs[seq_id].table, f"seq {seq_id} already has blocks"
        for bid in match.block_ids:
            self.pool.acquire(self.pool.blocks[bid])
        self.seqs[seq_id] = _SeqBlocks(list(match.block_ids), list(match.hashes))
        cached = match.num_blocks * self.block_size
        self.prefix_hit_tokens += cached
        self._note_usage()
        return cached

    def append_slots(self, seq_id: int, num_computed: int, num_new: int) -> list[CopyPair] | None:
        """Make the table cover ``num_computed + num_new`` tokens so that the ``num_new`` tokens
        starting at ``num_computed`` can be written. Returns the copy-on-write pairs, or None (and
        changes nothing) when the pool lacks free blocks."""
        entry = self.seqs.get(seq_id)
        if entry is not None and num_new > 0:
            # The common decode case: the tokens land in blocks the table holds, the first of them
            # private and unhashed. Nothing to allocate or copy.
            table, bs = entry.table, self.block_size
            first = num_computed // bs
            if num_computed + num_new <= len(table) * bs and first < len(table):
                if self._writable(self.pool.blocks[table[first]]):
                    return []
        if self.blocks_needed(seq_id, num_computed, num_new) > self.pool.num_free:
            return None
        entry = self.seqs.setdefault(seq_id, _SeqBlocks([], []))
        table, copies = entry.table, []
        first = num_computed // self.block_size
        if num_new > 0 and first < len(table):
            old = self.pool.blocks[table[first]]
            if not self._writable(old):
                new = self.pool.allocate()
                copies.append(CopyPair(old.block_id, new.block_id))
                table[first] = new.block_id
                del entry.hashes[first:]
                self.pool.release(old)
                self.num_cow_copies += 1
        while len(table) * self.block_size < num_computed + num_new:
            block_id = self.pool.allocate().block_id
            table.append(block_id)
            self.fresh_blocks.append(block_id)
        self._note_usage()
        return copies

    def take_fresh_blocks(self) -> list[int]:
        fresh, self.fresh_blocks = self.fresh_blocks, []
        return fresh

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the parent's table, sharing every block (no copy)."""
        parent = self.seqs.get(parent_id) or _SeqBlocks([], [])
        for bid in parent.table:
            self.pool.acquire(self.pool.blocks[bid])
        self.seqs[child_id] = _SeqBlocks(list(parent.table), list(parent.hashes))

    def free(self, seq_id: int) -> None:
        """Drop every reference of ``seq_id`` (tail first, so a prefix outlives its suffix in the LRU)."""
        host = self.swapped.pop(seq_id, None)
        if host is not None:
            self._release_host(host, self.host_free)
        entry = self.seqs.pop(seq_id, None)
        if entry is None:
            return
        for bid in reversed(entry.table):
            self.pool.release(self.pool.blocks[bid])

    # -- swap preemption -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Host blocks freed by the previous step's swap-ins may be reused from now on."""
        self.host_free.extend(self.host_pending_free)
        self.host_pending_free.clear()

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.host_free)

    def device_blocks_of(self, seq_ids: Sequence[int]) -> list[int]:
        """Distinct device blocks in the tables of ``seq_ids``, in first-use order."""
        return list(dict.fromkeys(b for sid in seq_ids for b in self.table(sid)))

    def host_blocks_of(self, seq_ids: Sequence[int]) -> list[int]:
        return list(dict.fromkeys(b for sid in seq_ids for b in self.swapped.get(sid, [])))

    def swap_out(self, seq_ids: Sequence[int]) -> list[CopyPair] | None:
        """Move the tables of ``seq_ids`` to host blocks and free their device blocks; returns the
        (device, host) copies, or None (changing nothing) when the host pool is too small."""
        blocks = self.device_blocks_of(seq_ids)
        if len(blocks) > len(self.host_free):
            return None
        to_host = {b: self.host_free.pop() for b in blocks}
        for sid in seq_ids:
            table = [to_host[b] for b in self.table(sid)]
            for h in table:
                self.host_refs[h] += 1
            self.free(sid)
            self.swapped[sid] = table
        return [CopyPair(b, h) for b, h in to_host.items()]

    def swap_in(self, seq_ids: Sequence[int]) -> list[CopyPair] | None:
        """Give ``seq_ids`` new device blocks for their host blocks; returns the (host, device)
        copies, or None (changing nothing) when the device pool is too small. The tables come
        back unhashed: ``cache_full_blocks`` registers their full blocks again."""
        blocks = self.host_blocks_of(seq_ids)
        if len(blocks) > self.pool.num_free:
            return None
        to_device = {h: self.pool.allocate() for h in blocks}  # each with one reference
        taken: set[int] = set()
        for sid in seq_ids:
            host = self.swapped.pop(sid, [])
            for h in host:
                if h in taken:  # shared inside the group: one more reference
                    self.pool.acquire(to_device[h])
                taken.add(h)
            self.seqs[sid] = _SeqBlocks([to_device[h].block_id for h in host], [])
            self._release_host(host, self.host_pending_free)
        self._note_usage()
        return [CopyPair(h, d.block_id) for h, d in to_device.items()]

    def _release_host(self, host: list[int], into: list[int]) -> None:
        for h in host:
            self.host_refs[h] -= 1
            if self.host_refs[h] == 0:
                into.append(h)

    def cache_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed: int, extra_key: object = None
    ) -> None:
        """Register the hashes of ``seq_id``'s blocks that are now full of computed tokens."""
        entry = self.seqs.get(seq_id)
        if entry is None:
            return
        num_full = min(num_computed // self.block_size, len(entry.table))
        if len(entry.hashes) >= num_full:  # no block filled since the last call
            return
        parent = entry.hashes[-1] if entry.hashes else None
        for i, h, chunk in self._chain(token_ids, parent, len(entry.hashes), num_full, extra_key):
            entry.hashes.append(h)
            self.pool.set_hash(self.pool.blocks[entry.table[i]], h, chunk)

    # -- checks --------------------------------------------------------------------------------
    def _writable(self, block: Block) -> bool:
        return block.ref_count == 1 and block.block_hash is None

    def _note_usage(self) -> None:
        used = self.num_used_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool and the tables disagree (used by tests and debug mode)."""
        refs = [0] * self.num_blocks
        for entry in self.seqs.values():
            assert len(entry.hashes) <= len(entry.table)
            for bid in entry.table:
                refs[bid] += 1
        free_ids = set(self.pool.free_queue.ids())
        assert len(free_ids) == len(self.pool.free_queue)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in free_ids), block
        for h, block in self.pool.cached.items():
            assert block.block_hash == h
        host_refs = [0] * self.num_host_blocks
        for table in self.swapped.values():
            for h in table:
                host_refs[h] += 1
        assert host_refs == self.host_refs, "host reference counts disagree with the swapped tables"
        idle = self.host_free + self.host_pending_free
        assert len(set(idle)) == len(idle), "a host block is free twice"
        assert all(host_refs[h] == 0 for h in idle), "a free host block is still referenced"
        assert len(idle) + sum(r > 0 for r in host_refs) == self.num_host_blocks
        assert not set(self.swapped) & set(self.seqs), "a sequence is both swapped and resident"
        assert sum(refs) == sum(len(e.table) for e in self.seqs.values())
