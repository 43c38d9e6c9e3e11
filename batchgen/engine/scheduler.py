"""Continuous batching over a paged KV pool. Pure Python (no torch).

One step (``schedule``):

0. Swapped groups (swap preemption), oldest first, come back while the pool (minus a small
   watermark while others run) holds their blocks plus what they compute this step, and join the
   running groups.
1. Running groups, oldest first. Each live sequence with tokens to compute gets
   ``min(uncomputed, token budget)`` of them: 1 for a decoding sequence, a chunk for a prefill.
   If the pool cannot hold them, the newest running group is preempted until it can, or the group
   itself is the newest and is preempted. Recompute preemption frees its blocks and keeps its
   tokens; swap preemption (``preemption_mode="swap"``) moves its blocks to the host pool and
   keeps its computed state, falling back to recompute when the host pool is full.
2. Waiting groups (preempted ones first, then new ones in arrival order) are admitted while no
   group is swapped out and the token budget, ``max_num_seqs`` and the pool (minus the watermark)
   allow. A sequence without blocks starts from its longest cached prefix. With LoRA, a group whose
   adapter would raise the running adapters above ``max_loras`` waits, and the first waiting group
   whose adapter fits (or that has none) goes before it.

The result is a ``SchedulerOutput``: which sequences run how many tokens, which blocks to swap
(in the order decided) and which to copy.
A group is preempted and admitted as a whole; ``max_num_seqs`` counts a group at its final size.

Why every request that fits the pool alone completes in any mix: a group's block need is planned
exactly (``_plan``: shared blocks once), the first running group is never the victim while others
run, and nothing is admitted while a group is swapped out. So the oldest running group always
advances and finishes, and a preempted group comes back at the latest into an idle pool, where
its need is at most ``LLMEngine.blocks_needed_alone``, which validation holds to the pool size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from batchgen.engine.block_manager import BlockManager, PrefixMatch
from batchgen.engine.sequence import SeqStatus, Sequence, SequenceGroup, is_long_rope, long_rope_key
from batchgen.step import Chunk, CopyPair, StepBatch, Swap
from batchgen.utils import cdiv

# Share of the pool kept free when admitting a group beside running ones: the running groups'
# next decode blocks then rarely force a preemption right after an admission.
WATERMARK_FRACTION = 0.01

class ScheduledSeq(NamedTuple):
    """``seq`` computes ``num_new_tokens`` tokens starting at ``start`` this step."""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool  # the chunk reaches the end of the sequence: its last logits are needed


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[CopyPair] = field(default_factory=list)
    fresh_blocks: list[int] = field(default_factory=list)  # newly allocated blocks (zeroed by the runner)
    preempted: list[SequenceGroup] = field(default_factory=list)  # by recompute
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    failed: list[SequenceGroup] = field(default_factory=list)  # could not run at all; see ``group.error``
    swaps: list[Swap] = field(default_factory=list)  # in the order decided

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def step_batch(self, table_of: Callable[[int], list[int]]) -> StepBatch:
        """The runner's view of this step: token ids, positions and block tables, no sequences."""
        chunks = [
            Chunk(
                s.seq.token_ids[s.start : s.start + s.num_new_tokens],
                s.start,
                table_of(s.seq.seq_id),
                s.samples,
                _all_logits(s),
                s.seq.num_tokens,
                s.seq.group.lora_id,
            )
            for s in self.scheduled
        ]
        return StepBatch(chunks, self.copies, self.fresh_blocks, self.swaps)


def _all_logits(s: ScheduledSeq) -> bool:
    """Whether every token's logits of the chunk are needed: prompt log-probabilities for the
    prompt's positions, or a scored continuation from the prompt's last position on."""
    seq = s.seq
    if seq.score is not None:
        return s.start + s.num_new_tokens >= seq.num_prompt_tokens
    return seq.group.prompt_logprobs is not None and s.start < seq.num_prompt_tokens - 1


class _Plan(NamedTuple):
    """``seq`` computes ``num_new`` tokens from ``start``, first taking ``match`` when it has no blocks."""

    seq: Sequence
    match: PrefixMatch | None
    start: int
    num_new: int


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        rope_switch: int | None = None,
        max_loras: int = 0,
    ) -> None:
        self.bm = block_manager
        # LoRA: at most this many adapters among the running groups (0: no adapters)
        self.max_loras = max_loras
        # LongRoPE's switch length: a group growing past it is recomputed (``_schedule_running``).
        self.rope_switch = rope_switch
        self.num_rope_recomputes = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.watermark = max(1, int(self.bm.num_blocks * WATERMARK_FRACTION))
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swapped_blocks = 0  # blocks moved in either direction

    # -- queue ---------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free_seq(self, seq: Sequence) -> None:
        """Mark ``seq`` finished and return its blocks."""
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq.seq_id)

    def remove_finished(self) -> list[SequenceGroup]:
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = [g for g in self.running if not g.is_finished]
        return done

    @property
    def num_running_seqs(self) -> int:
        return sum(max(g.max_seqs, len(g.live_seqs)) for g in self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.bm.begin_step()
        budget = self.max_num_batched_tokens
        self._switch_rope(out)
        recomputing = len(out.preempted)  # for LongRoPE, not for want of memory
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            scheduled = self._schedule_running(group, budget, out)
            if scheduled is None:  # the group preempted itself
                continue
            budget -= scheduled
            i += 1
        pressure = len(out.preempted) > recomputing
        if not pressure and not out.swapped_out:
            budget = self._swap_in(out, budget)

        computing: set[int] = set()  # hashes of blocks that this step's prefills will fill
        while self.waiting and budget > 0 and len(out.preempted) == recomputing and not self.swapped:
            group = self.waiting[0]
            loras = {g.lora_id for g in self.running} - {0} if self.max_loras else set()
            if not self._adapter_fits(group, loras):
                # its adapter would be one too many: the first waiting group whose adapter fits goes first
                later = next((g for g in self.waiting if self._adapter_fits(g, loras)), None)
                if later is None:
                    break
                self.waiting.remove(later)
                self.waiting.appendleft(later)
                group = later
            plans, need = self._plan(group, budget)
            if not plans or not self._can_admit(group, need):
                break
            # A prompt whose next block is being computed right now waits one step and then
            # reuses it from the prefix cache instead of computing it again.
            if any(p.match is not None and p.match.next_hash in computing for p in plans):
                break
            self.waiting.popleft()
            self.running.append(group)
            budget -= self._apply(plans, out)
            for p in plans:
                if p.match is not None:
                    computing.update(
                        self.bm.chain_hashes(p.seq.token_ids, p.match, p.start + p.num_new, group.cache_key)
                    )
        out.fresh_blocks = self.bm.take_fresh_blocks()
        return out

    def _adapter_fits(self, group: SequenceGroup, running: set[int]) -> bool:
        """Whether ``group`` may run beside groups on the adapters ``running`` within ``max_loras``."""
        return not group.lora_id or group.lora_id in running or len(running) < self.max_loras

    def _can_admit(self, group: SequenceGroup, blocks: int) -> bool:
        """Whether a waiting or swapped group may join the running ones with ``blocks`` more
        blocks: within ``max_num_seqs`` (a group alone always is) and the pool, keeping the
        watermark free while others run."""
        if not self.running:
            return blocks <= self.bm.num_free_blocks
        return (
            self.num_running_seqs + group.max_seqs <= self.max_num_seqs
            and blocks + self.watermark <= self.bm.num_free_blocks
        )

    def _switch_rope(self, out: SchedulerOutput) -> None:
        """LongRoPE: a sequence past the switch length takes the long frequencies at every
        position. A running group that grew past it is recomputed with them (first among the
        waiting), and caches its blocks apart from short-computed ones."""
        switch = self.rope_switch
        if switch is None:
            return
        for group in list(self.running):
            if is_long_rope(group.cache_key) or all(s.num_tokens <= switch for s in group.live_seqs):
                continue
            group.cache_key = long_rope_key(group.cache_key)
            self.running.remove(group)
            self.num_rope_recomputes += 1
            self._requeue(group, out)

    def _schedule_running(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int | None:
        while True:
            plans, need = self._plan(group, budget)
            if need <= self.bm.num_free_blocks:
                return self._apply(plans, out)
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                # Alone and still too big: only a request that validation should have rejected.
                # Fail it alone rather than the batch, and leave the engine usable.
                reason = f"needs {need} KV blocks in one step; the pool has {self.bm.num_free_blocks} free"
                self.fail(group, out, reason)
                return None
            self._preempt(victim, out)
            if victim is group:
                return None

    def _plan(self, group: SequenceGroup, budget: int) -> tuple[list[_Plan], int]:
        """What the group's live sequences compute this step within ``budget`` tokens, and how many
        free blocks that takes. Each block is counted once for the whole group: a free cached
        prefix block that several siblings match (all of them after a recompute preemption) is
        taken once, and a shared block that all its holders write is copied for all but the last
        (``BlockManager.blocks_needed_many``)."""
        plans: list[_Plan] = []
        bs = self.bm.block_size
        computing: set[int] = set()  # blocks an earlier sequence of this group fills this step
        matched_free: set[int] = set()  # free cached blocks the matches take out of the free queue
        new_blocks = 0  # blocks after the matched prefixes
        writes: list[tuple[int, int, int]] = []  # (seq id, start, tokens) of sequences with blocks
        for seq in group.live_seqs:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens == 0:
                continue
            match, start = None, seq.num_computed_tokens
            if start == 0 and not self.bm.has_blocks(seq.seq_id):
                # Keep at least one token to compute: its logits are what the step is for. A scored
                # continuation takes the prompt's blocks only: its own tokens' logits are its scores.
                limit = (seq.num_tokens - 1) // bs
                if seq.score is not None:
                    limit = min(limit, seq.num_prompt_tokens // bs)
                match = self.bm.match_prefix(seq.token_ids, group.cache_key, limit)
                if match.next_hash is not None and match.next_hash in computing:
                    # A sibling recomputes this sequence's next blocks right now (after a
                    # preemption): take them from the cache next step instead of a second copy.
                    continue
                start = match.num_blocks * bs
                matched_free.update(match.free_block_ids)
            num_new = min(seq.num_tokens - start, budget)
            if match is not None:
                if len(group.seqs) > 1:
                    computing.update(
                        self.bm.chain_hashes(seq.token_ids, match, start + num_new, group.cache_key)
                    )
                new_blocks += cdiv(start + num_new, bs) - match.num_blocks
            else:
                writes.append((seq.seq_id, start, num_new))
            plans.append(_Plan(seq, match, start, num_new))
            budget -= num_new
        return plans, len(matched_free) + new_blocks + self.bm.blocks_needed_many(writes)

    def _apply(self, plans: list[_Plan], out: SchedulerOutput) -> int:
        used = 0
        # Take every matched cached block first: a fresh allocation below may otherwise evict a
        # free cached block that a later sequence of the same group matched.
        for plan in plans:
            seq = plan.seq
            if plan.match is not None:
                cached = self.bm.allocate_prefix(seq.seq_id, plan.match)
                seq.num_computed_tokens = cached
                if seq.group.num_cached_tokens is None:
                    seq.group.num_cached_tokens = cached
        for plan in plans:
            seq = plan.seq
            copies = self.bm.append_slots(seq.seq_id, plan.start, plan.num_new)
            assert copies is not None, "planned allocation failed"
            out.copies.extend(copies)
            seq.status = SeqStatus.RUNNING
            out.scheduled.append(
                ScheduledSeq(seq, plan.start, plan.num_new, plan.start + plan.num_new == seq.num_tokens)
            )
            used += plan.num_new
        return used

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped groups back, oldest first, and schedule them in this step.

        A group comes back once the pool (minus the watermark while others run) holds its swapped
        blocks plus the blocks it computes this step, counted as ``_plan`` counts them. Since
        nothing new is admitted while a group is swapped out, the running groups only finish or
        shrink, so that moment comes. A group that does not fit even into an idle pool (a request
        larger than the pool, which validation rejects) is recomputed instead of waiting forever.
        """
        while self.swapped and budget > 0:
            group = self.swapped[0]
            ids = [s.seq_id for s in group.live_seqs]
            _, need = self._plan(group, budget)
            if not self._can_admit(group, len(self.bm.host_blocks_of(ids)) + need):
                if self.running:
                    break
                self.swapped.popleft()
                self._requeue(group, out)
                continue
            pairs = self.bm.swap_in(ids)
            assert pairs is not None, "planned swap-in failed"
            out.swaps.append(Swap(False, pairs))
            self.num_swapped_blocks += len(pairs)
            for seq in group.live_seqs:
                seq.status = SeqStatus.RUNNING
            self.swapped.popleft()
            self.running.append(group)
            plans, need = self._plan(group, budget)
            if need > self.bm.num_free_blocks:  # a matched cached block was evicted: next step
                continue
            budget -= self._apply(plans, out)
        return budget

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swap preemption when chosen and the host pool has room, else recompute: free every
        block of the group, keep its tokens, requeue it first."""
        self.running.remove(group)
        out.scheduled = [s for s in out.scheduled if s.seq.group is not group]
        self.num_preemptions += 1
        if self.preemption_mode == "swap":
            pairs = self.bm.swap_out([s.seq_id for s in group.live_seqs])
            if pairs is not None:
                out.swaps.append(Swap(True, pairs))
                self.num_swap_outs += 1
                self.num_swapped_blocks += len(pairs)
                for seq in group.live_seqs:
                    seq.status = SeqStatus.SWAPPED
                self.swapped.appendleft(group)
                out.swapped_out.append(group)
                return
        self._requeue(group, out)

    def _requeue(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute preemption: free every block of the group (device or host), keep its tokens,
        and queue it first among the waiting groups."""
        for seq in group.live_seqs:
            self.bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
        self.waiting.appendleft(group)
        out.preempted.append(group)

    def fail(self, group: SequenceGroup, out: SchedulerOutput, reason: str) -> None:
        """Finish ``group`` with an error wherever it is queued: its blocks are freed, the other
        requests go on, and ``out.failed`` tells the engine to report it."""
        self.abort(group)
        out.scheduled = [s for s in out.scheduled if s.seq.group is not group]
        group.error = f"request {group.request_id} {reason}"
        out.failed.append(group)

    def abort(self, group: SequenceGroup) -> None:
        """Drop ``group`` from every queue and free its blocks (device and host)."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            self.free_seq(seq)

    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance the computed counters of what ran and make newly full blocks findable."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.group.cache_key)
