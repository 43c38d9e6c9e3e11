"""Scheduler without a model: token budget and chunking, max_num_seqs, prefix hits, preemption
(newest group first, whole groups, requeued at the front) on tiny pools."""

from __future__ import annotations

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.params import SamplingParams

BS = 4


def make_group(rid: str, tokens: list[int], n: int = 1) -> SequenceGroup:
    g = SequenceGroup(rid, SamplingParams(n=n), None, tokens)
    g.seqs.append(Sequence(g, 0, list(tokens), len(tokens), seed=0))
    return g


def run_step(sched: Scheduler):
    out = sched.schedule()
    sched.finish_step(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.token_ids.append(7)  # a "sampled" token
    return out


def test_long_prompt_is_prefilled_in_chunks_within_budget():
    sched = Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=5)
    g = make_group("0", list(range(12)))
    sched.add(g)
    chunks = []
    for _ in range(3):
        out = run_step(sched)
        chunks.append([(s.start, s.num_new_tokens, s.samples) for s in out.scheduled])
    assert chunks == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    out = run_step(sched)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(12, 1)]


def test_decodes_and_new_prefill_share_a_step():
    sched = Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=6)
    a, b = make_group("0", [1, 2, 3]), make_group("1", list(range(10, 20)))
    sched.add(a)
    run_step(sched)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.group.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 1), ("1", 5)]


def test_max_num_seqs_counts_groups_at_their_final_size():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add(make_group("0", [1, 2, 3], n=3))
    sched.add(make_group("1", [4, 5, 6], n=2))
    out = run_step(sched)
    assert {s.seq.group.request_id for s in out.scheduled} == {"0"}
    assert len(sched.waiting) == 1


def test_second_request_reuses_cached_prefix():
    sched = Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=100)
    prefix = list(range(100, 109))
    a = make_group("0", prefix + [1])
    sched.add(a)
    run_step(sched)
    b = make_group("1", prefix + [2, 3])
    sched.add(b)
    out = run_step(sched)
    sb = [s for s in out.scheduled if s.seq.group is b][0]
    assert sb.start == 8 and sb.num_new_tokens == 3
    assert b.num_cached_tokens == 8
    assert sched.bm.table(b.seqs[0].seq_id)[:2] == sched.bm.table(a.seqs[0].seq_id)[:2]


def test_fully_cached_prompt_still_computes_its_last_token():
    sched = Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=100)
    a = make_group("0", list(range(8)))
    sched.add(a)
    run_step(sched)
    b = make_group("1", list(range(8)))
    sched.add(b)
    out = run_step(sched)
    sb = [s for s in out.scheduled if s.seq.group is b][0]
    assert (sb.start, sb.num_new_tokens) == (4, 4)


def test_preemption_takes_newest_group_whole_and_requeues_it_first():
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_group("0", list(range(7))), make_group("1", list(range(50, 57)))
    sched.add(old)
    sched.add(new)
    run_step(sched)  # 2 blocks each; both have 8 tokens now
    assert len(sched.running) == 2
    for _ in range(8):
        out = run_step(sched)
        if out.preempted:
            break
    assert out.preempted == [new]
    assert sched.waiting[0] is new and new.seqs[0].num_computed_tokens == 0
    assert not bm.table(new.seqs[0].seq_id)
    bm.check_invariants()
    # the old group keeps running; the new one resumes once blocks come back
    assert [s.seq.group for s in out.scheduled] == [old]
    from batchgen.engine.sequence import SeqStatus

    sched.free_seq(old.seqs[0])
    sched.remove_finished()
    total = new.seqs[0].num_tokens
    out = run_step(sched)
    s = out.scheduled[0]
    assert s.seq.group is new and s.start == 8 and s.num_new_tokens == total - 8
    assert old.seqs[0].status is SeqStatus.FINISHED


def test_fresh_allocation_never_evicts_a_block_another_sequence_of_the_group_matched():
    """Regression: cached blocks at the head of the free queue, matched by sequence 1 of a group,
    must not be handed to sequence 0's new block in the same step."""
    bm = BlockManager(6, BS)
    prompt, other = list(range(100, 108)), list(range(200, 208))
    for sid, toks in ((1, prompt), (2, other)):  # cache two prompts, then free them
        bm.append_slots(sid, 0, 8)
        bm.cache_full_blocks(sid, toks, 8)
    bm.free(1)
    bm.free(2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    g = make_group("0", prompt)
    s0 = Sequence(g, 0, list(range(300, 305)), 5, seed=0)  # 4 tokens computed, the 5th needs a new block
    bm.append_slots(s0.seq_id, 0, 4)
    s0.num_computed_tokens = 4
    filler = make_group("1", [7])
    bm.append_slots(filler.seqs[0].seq_id, 0, 1)
    s1 = Sequence(g, 1, prompt + [9], 8, seed=0)  # matches the two cached prompt blocks
    g.seqs[:] = [s0, s1]
    sched.running.append(g)
    prompt_blocks = bm.match_prefix(prompt).block_ids
    assert bm.pool.free_queue.ids()[:2] == list(reversed(prompt_blocks))  # they sit at the head
    out = sched.schedule()
    assert {(s.seq.index, s.start, s.num_new_tokens) for s in out.scheduled} == {(0, 4, 1), (1, 8, 1)}
    assert bm.table(s1.seq_id)[:2] == prompt_blocks
    assert bm.table(s0.seq_id)[1] not in prompt_blocks
    bm.check_invariants()


def test_recomputed_group_shares_its_prompt_even_after_eviction():
    """A preempted n=3 group whose cached blocks were evicted needs 4 + 3 x 1 blocks, not 3 x 5:
    the first sequence recomputes the prompt, its siblings wait a step and take it from the cache."""
    bm = BlockManager(10, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    prompt = list(range(50, 66))  # 4 full blocks
    g = make_group("0", prompt, n=3)
    g.seqs[:] = [Sequence(g, i, prompt + [90 + i, 95 + i], 16, seed=0) for i in range(3)]
    sched.add(g)
    first = run_step(sched)
    assert [(s.seq.index, s.start, s.num_new_tokens) for s in first.scheduled] == [(0, 0, 18)]
    second = run_step(sched)
    assert sorted((s.seq.index, s.start, s.num_new_tokens) for s in second.scheduled) == [
        (0, 18, 1),
        (1, 16, 2),
        (2, 16, 2),
    ]
    tables = [bm.table(s.seq_id) for s in g.seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert bm.num_used_blocks == 4 + 3 * 1  # the shared prompt, then one own block each
    bm.check_invariants()


def _cache_prompt(bm: BlockManager, tokens: list[int]) -> None:
    """Leave ``tokens``' full blocks in the pool as free cached blocks (as a preempted group does)."""
    bm.append_slots(999, 0, len(tokens))
    bm.cache_full_blocks(999, tokens, len(tokens))
    bm.free(999)


def test_siblings_matching_the_same_free_cached_blocks_count_them_once():
    """After a recompute preemption all n samples match the same free prompt blocks; admission
    takes them once (2 blocks), plus one block of its own per sample: 6 of a 6-block pool."""
    prompt = list(range(9))
    bm = BlockManager(6, BS)
    _cache_prompt(bm, prompt[:8])
    g = make_group("0", prompt, n=4)
    g.seqs[0].token_ids += [100, 101]
    for i in range(1, 4):
        g.seqs.append(Sequence(g, i, prompt + [100 + 2 * i, 101 + 2 * i], len(prompt), seed=i))
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(g)
    out = sched.schedule()
    assert [(s.seq.index, s.start, s.num_new_tokens) for s in out.scheduled] == [(i, 8, 3) for i in range(4)]
    assert bm.num_free_blocks == 0 and not out.preempted
    assert [bm.table(s.seq_id)[:2] for s in g.seqs] == [bm.table(g.seqs[0].seq_id)[:2]] * 4
    bm.check_invariants()


def test_a_shared_block_written_by_all_its_holders_is_copied_for_all_but_the_last():
    bm = BlockManager(8, BS)
    bm.append_slots(1, 0, 6)  # blocks [0, 1]; block 1 holds 2 of 4 slots
    for child in (2, 3, 4):
        bm.fork(1, child)
    assert bm.blocks_needed_many([(s, 6, 1) for s in (1, 2, 3, 4)]) == 3
    assert bm.blocks_needed_many([(s, 6, 1) for s in (2, 3)]) == 2  # two holders stay on it
    free = bm.num_free_blocks
    copies = [c for s in (1, 2, 3, 4) for c in bm.append_slots(s, 6, 1)]
    assert free - bm.num_free_blocks == len(copies) == 3
    assert len({bm.table(s)[1] for s in (1, 2, 3, 4)}) == 4
    bm.check_invariants()
