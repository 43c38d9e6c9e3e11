"""Block manager: exact block ids, refcounts, copies and eviction order on tiny pools, and a
property-based test of the invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.engine.block_manager import Block, BlockManager, CopyPair, FreeBlockQueue

BS = 4


def test_free_queue_is_fifo_with_o1_remove():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.ids() == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.appendleft(blocks[0])
    q.append(blocks[2])
    assert q.ids() == [0, 1, 3, 4, 2]
    assert len(q) == 5


def test_allocate_grows_one_block_at_a_time():
    bm = BlockManager(8, BS)
    assert bm.append_slots(1, 0, 3) == []
    assert bm.table(1) == [0]
    assert bm.append_slots(1, 3, 1) == []
    assert bm.table(1) == [0]
    assert bm.append_slots(1, 4, 1) == []
    assert bm.table(1) == [0, 1]
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_fork_allocates_nothing_and_first_write_copies_shared_partial_block_once():
    bm = BlockManager(8, BS)
    bm.append_slots(1, 0, 6)  # blocks 0 (full), 1 (2 of 4 slots)
    free_before = bm.num_free_blocks
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.num_free_blocks == free_before
    assert bm.table(2) == bm.table(3) == [0, 1]
    assert [bm.pool.blocks[b].ref_count for b in (0, 1)] == [3, 3]
    bm.check_invariants()

    # seq 2 writes at position 6 (inside shared block 1): copy exactly that block, once
    assert bm.append_slots(2, 6, 1) == [CopyPair(1, 2)]
    assert bm.table(2) == [0, 2]
    assert bm.pool.blocks[1].ref_count == 2
    # seq 3 copies too (block 1 is still shared with seq 1)
    assert bm.append_slots(3, 6, 1) == [CopyPair(1, 3)]
    # seq 1 is now the only owner of block 1: it writes in place
    assert bm.append_slots(1, 6, 1) == []
    assert bm.table(1) == [0, 1]
    assert bm.num_cow_copies == 2
    bm.check_invariants()


def test_no_copy_after_fork_when_last_block_was_full():
    bm = BlockManager(8, BS)
    bm.append_slots(1, 0, 8)  # two full blocks
    bm.fork(1, 2)
    assert bm.append_slots(2, 8, 1) == []
    assert bm.append_slots(1, 8, 1) == []
    assert bm.table(1)[:2] == bm.table(2)[:2] and bm.table(1)[2] != bm.table(2)[2]
    assert bm.num_cow_copies == 0
    bm.check_invariants()


def test_prefix_reuse_checks_tokens_and_counts_free_hits():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    bm.append_slots(1, 0, 10)
    bm.cache_full_blocks(1, tokens, 10)
    match = bm.match_prefix(tokens + [99])
    assert match.block_ids == bm.table(1)[:2] and match.num_free_hits == 0
    assert bm.match_prefix([0, 1, 2, 3, 9, 9, 9, 9]).block_ids == [bm.table(1)[0]]
    assert bm.match_prefix([0, 1, 2, 3], extra_key="other").block_ids == []
    bm.free(1)
    match = bm.match_prefix(tokens)
    assert match.num_blocks == 2 and match.num_free_hits == 2
    assert bm.allocate_prefix(2, match) == 8
    assert bm.table(2) == match.block_ids
    assert bm.prefix_hit_tokens == 8
    bm.check_invariants()


def test_cached_blocks_are_never_written():
    bm = BlockManager(8, BS)
    bm.append_slots(1, 0, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    # Rewriting a position of a hashed block moves the writer to a fresh block.
    copies = bm.append_slots(1, 3, 1)
    assert copies == [CopyPair(0, 1)]
    bm.check_invariants()


def test_lru_eviction_order_of_cached_blocks():
    bm = BlockManager(4, BS)
    for seq, base in ((1, 0), (2, 100), (3, 200)):
        toks = list(range(base, base + 4))
        bm.append_slots(seq, 0, 4)
        bm.cache_full_blocks(seq, toks, 4)
    b1, b2, b3 = bm.table(1)[0], bm.table(2)[0], bm.table(3)[0]
    bm.free(2)
    bm.free(1)
    bm.free(3)
    # Unhashed block 3 is reused first, then cached blocks least-recently-freed first: 2, 1, 3.
    assert bm.pool.free_queue.ids() == [3, b2, b1, b3]
    bm.append_slots(10, 0, 8)
    assert bm.table(10) == [3, b2]
    assert bm.match_prefix(list(range(100, 104))).block_ids == []  # evicted
    assert bm.match_prefix(list(range(0, 4))).block_ids == [b1]  # still findable
    bm.check_invariants()


def test_everything_free_after_all_sequences_end():
    bm = BlockManager(16, BS)
    bm.append_slots(1, 0, 9)
    bm.fork(1, 2)
    bm.append_slots(2, 9, 1)
    bm.append_slots(3, 0, 5)
    for s in (1, 2, 3):
        bm.free(s)
    assert bm.num_free_blocks == 16
    assert all(b.ref_count == 0 for b in bm.pool.blocks)
    bm.check_invariants()


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(2, BS)
    bm.append_slots(1, 0, 8)
    assert bm.append_slots(2, 0, 1) is None
    assert bm.table(2) == []
    assert bm.append_slots(1, 8, 1) is None
    assert bm.table(1) == [0, 1]
    bm.check_invariants()


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "fork", "append", "free", "preempt"]), st.integers(0, 7), st.integers(1, 9)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_every_invariant(operations):
    """Random allocate / fork / append / free / preempt; after each, the pool and tables agree,
    no shared or hashed block is ever written, and memory held is proportional to tokens held."""
    bm = BlockManager(12, BS)
    seqs: dict[int, list[int]] = {}  # seq id -> tokens with KV
    next_id = 100
    written_blocks: list[int] = []

    def write(seq_id: int, n: int) -> None:
        toks = seqs[seq_id]
        start = len(toks)
        copies = bm.append_slots(seq_id, start, n)
        if copies is None:
            return
        table = bm.table(seq_id)
        for pos in range(start, start + n):
            block = bm.pool.blocks[table[pos // BS]]
            assert block.ref_count == 1 and block.block_hash is None, "wrote into a shared or cached block"
            written_blocks.append(block.block_id)
        toks.extend(range(start * 7, (start + n) * 7, 7))
        bm.cache_full_blocks(seq_id, toks, len(toks))

    for op, pick, n in operations:
        live = sorted(seqs)
        if op == "new" or not live:
            sid, next_id = next_id, next_id + 1
            seqs[sid] = []
            match = bm.match_prefix(list(range(0, n * 7, 7)), max_blocks=(n - 1) // BS)
            if match.num_free_hits <= bm.num_free_blocks:
                seqs[sid] = list(range(0, match.num_blocks * BS * 7, 7))
                bm.allocate_prefix(sid, match)
            write(sid, n)
        else:
            sid = live[pick % len(live)]
            if op == "fork":
                child, next_id = next_id, next_id + 1
                bm.fork(sid, child)
                seqs[child] = list(seqs[sid])
            elif op == "append":
                write(sid, 1 + n % 3)
            elif op in ("free", "preempt"):
                bm.free(sid)
                if op == "free":
                    del seqs[sid]
                else:
                    seqs[sid] = []
        bm.check_invariants()
        for sid, toks in seqs.items():
            assert len(bm.table(sid)) == -(-len(toks) // BS) or not bm.table(sid) and not toks
    for sid in list(seqs):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 12


@pytest.mark.parametrize("n", [1, 4, 5])
def test_blocks_needed_matches_what_append_takes(n):
    bm = BlockManager(10, BS)
    bm.append_slots(1, 0, 6)
    bm.fork(1, 2)
    need = bm.blocks_needed(2, 6, n)
    free = bm.num_free_blocks
    bm.append_slots(2, 6, n)
    assert free - bm.num_free_blocks == need


def test_swap_keeps_sharing_and_host_blocks_wait_one_step():
    bm = BlockManager(10, BS, num_host_blocks=6)
    bm.append_slots(1, 0, 6)  # blocks 0, 1 (second one half full)
    bm.fork(1, 2)
    bm.append_slots(3, 0, 3)  # another sequence stays resident
    out = bm.swap_out([1, 2])
    assert out is not None and len(out) == 2  # the two shared blocks leave once each
    assert bm.table(1) == [] and bm.num_free_blocks == 9
    assert bm.num_free_host_blocks == 4
    back = bm.swap_in([1, 2])
    assert back is not None and len(back) == 2
    assert bm.table(1) == bm.table(2)  # still shared on the device
    assert {p.src for p in back} == {p.dst for p in out}  # from the host blocks written on the way out
    # the host blocks may still be read in this step: free only from the next one
    assert bm.num_free_host_blocks == 4
    bm.begin_step()
    assert bm.num_free_host_blocks == 6
    # the shared half-full block is copied on the first write, exactly once
    copies = bm.append_slots(2, 6, 1)
    assert copies == [CopyPair(bm.table(1)[1], bm.table(2)[1])]
    bm.check_invariants()


def test_swap_out_needs_room_on_the_host_and_changes_nothing_without_it():
    bm = BlockManager(10, BS, num_host_blocks=1)
    bm.append_slots(1, 0, 6)
    before = bm.table(1)
    assert bm.swap_out([1]) is None
    assert bm.table(1) == before and bm.num_free_host_blocks == 1
    bm.check_invariants()


swap_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "fork", "append", "append", "free", "swap_out", "swap_in", "step"]),
        st.integers(0, 7),
        st.integers(1, 9),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(swap_ops)
def test_random_swaps_move_exactly_the_right_contents(operations):
    """A simulated KV store follows every write, copy-on-write and swap the block manager asks for;
    after each operation every resident sequence reads its own tokens back through its table."""
    bm = BlockManager(12, BS, num_host_blocks=8)
    device: dict[int, list] = {b: [None] * BS for b in range(12)}
    host: dict[int, list] = {h: [None] * BS for h in range(8)}
    seqs: dict[int, list[int]] = {}
    swapped: set[int] = set()
    families: list[list[int]] = []  # swapped out together, swapped in together
    next_id = 1

    def write(sid: int, n: int) -> None:
        toks = seqs[sid]
        start = len(toks)
        copies = bm.append_slots(sid, start, n)
        if copies is None:
            return
        for c in copies:
            device[c.dst] = list(device[c.src])
        table = bm.table(sid)
        new = [next_id * 1000 + start + i for i in range(n)]
        for i, tok in enumerate(new):
            device[table[(start + i) // BS]][(start + i) % BS] = tok
        toks.extend(new)

    for op, pick, n in operations:
        resident = sorted(set(seqs) - swapped)
        if op == "step":
            bm.begin_step()
        elif op == "new" or not resident and op != "swap_in":
            seqs[next_id] = []
            write(next_id, n)
            next_id += 1
        elif op == "swap_in":
            if families:
                family = families[pick % len(families)]
                pairs = bm.swap_in(family)
                if pairs is not None:
                    for p in pairs:
                        device[p.dst] = list(host[p.src])
                    swapped.difference_update(family)
                    families.remove(family)
        else:
            sid = resident[pick % len(resident)]
            if op == "fork":
                bm.fork(sid, next_id)
                seqs[next_id] = list(seqs[sid])
                next_id += 1
            elif op == "append":
                write(sid, 1 + n % 3)
            elif op == "free":
                bm.free(sid)
                del seqs[sid]
            elif op == "swap_out":
                family = [s for s in resident if set(bm.table(s)) & set(bm.table(sid))] or [sid]
                pairs = bm.swap_out(family)
                if pairs is not None:
                    for p in pairs:
                        host[p.dst] = list(device[p.src])
                    swapped.update(family)
                    families.append(family)
        bm.check_invariants()
        for sid in set(seqs) - swapped:
            table = bm.table(sid)
            got = [device[table[i // BS]][i % BS] for i in range(len(seqs[sid]))]
            assert got == seqs[sid], f"sequence {sid} reads wrong KV"
    for sid in list(seqs):
        bm.free(sid)
    bm.begin_step()
    bm.check_invariants()
    assert bm.num_free_blocks == 12 and bm.num_free_host_blocks == 8
