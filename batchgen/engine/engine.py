"""The engine loop: requests in, one scheduled forward pass per ``step``, finished groups out.

``step``: schedule -> run the model on the flattened batch -> advance counters and cache full
blocks -> sample the sequences whose last token was computed (forking ``n > 1`` requests after
their prompt) -> advance beam groups whose beams all have logits -> check stops, free finished
sequences -> return the requests that finished.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from batchgen.config import EngineConfig
from batchgen.cpus import omp_wait_policy
from batchgen.engine.beam import BeamState, beam_step
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sampler import GrammarMask, SampleRow, derive_seed, sample, target_logprobs
from batchgen.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from batchgen.engine.sequence import SeqStatus, Sequence, SequenceGroup, long_rope_key
from batchgen.engine.stats import EngineStats
from batchgen.engine.stops import StopStringWatcher, check_stop
from batchgen.engine.structured import (
    StructuredOutputs,
    allow_also,
    allow_only,
    apply_bitmask,
    full_mask,
)
from batchgen.model.hub import local_dir, snapshot_revision
from batchgen.model.loader import load_config, load_tokenizer
from batchgen.model.quant import path_counts
from batchgen.model.runner import ModelRunner, RunnerTimes
from batchgen.outputs import CompletionOutput, LogprobsBuilder, PromptLogprobs, RequestOutput, TokenLogprobs
from batchgen.params import BeamSearchParams, LoRARequest, RequestParams, SamplingParams, ScoreParams
from batchgen.reasoning import make_parser
from batchgen.utils import cdiv
from batchgen.vllm_compat import EngineArgs, from_vllm_prompt


class Prompt(NamedTuple):
    """A tokenized, validated prompt: its text (None when given as token ids) and token ids."""

    text: str | None
    token_ids: list[int]


def _eos_ids(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        eos = gen.eos_token_id
    except Exception:  # noqa: BLE001 - no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids = [eos]
    elif eos is not None:
        ids = list(eos)
    return frozenset(ids)


class LLMEngine:
    """The step loop. vLLM's ``LLMEngine`` habits work: ``LLMEngine.from_engine_args(EngineArgs(...))``,
    ``add_request(request_id, prompt, params)`` (text, token ids or vLLM's prompt dicts),
    ``step()`` returning the requests that finished (``finished=True``), and
    ``has_unfinished_requests()``."""

    def __init__(self, cfg: EngineConfig) -> None:
        cfg = replace(
            cfg,
            model=local_dir(cfg.model, cfg.revision, "model", cfg.download_dir),
            tokenizer=local_dir(cfg.tokenizer, cfg.tokenizer_revision, "tokenizer", cfg.download_dir)
            if cfg.tokenizer else None,
        )
        self.cfg = cfg  # with hub ids resolved to their local snapshots
        self.model_revision = snapshot_revision(cfg.model)  # the commit of a hub model, else None
        self.hf_config = load_config(cfg.model)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.max_model_len = cfg.max_model_len or int(self.hf_config.max_position_embeddings)
        self.runner = ModelRunner(cfg, self.hf_config, self.max_model_len)
        self.vocab_size = self.runner.model.vocab_size
        self.eos_ids = _eos_ids(cfg.model, self.hf_config, self.tokenizer)
        self.block_size = cfg.block_size
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size, self.runner.num_host_blocks)
        self.scheduler = Scheduler(
            self.bm,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            self.runner.preemption_mode,
            rope_switch=self.runner.model.long_rope_after,
            max_loras=cfg.max_loras if cfg.enable_lora else 0,
        )
        self._rng = np.random.default_rng(cfg.seed)
        self._pending: dict[int, torch.Tensor] = {}  # beam seq id -> logits row waiting for its siblings
        self._stats = EngineStats(cfg.block_size, self.max_model_len)
        self._groups: dict[str, SequenceGroup] = {}  # queued and running requests by id
        self._structured: StructuredOutputs | None = None  # built with the first grammar
        self.reasoning = make_parser(cfg.reasoning_parser, self.tokenizer) if cfg.reasoning_parser else None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return None, list(prompt)

    def validate(self, token_ids: list[int], params: RequestParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context (max_model_len) is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        if isinstance(params, ScoreParams):
            for i, cont in enumerate(params.continuations):
                bad = [t for t in cont if t >= self.vocab_size]
                if bad:
                    raise ValueError(f"continuation {i} has token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
                if len(token_ids) + len(cont) > self.max_model_len:
                    raise ValueError(
                        f"prompt ({len(token_ids)} tokens) and continuation {i} ({len(cont)} tokens) exceed "
                        f"the model's context (max_model_len {self.max_model_len})"
                    )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name, None)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size ({self.vocab_size}), got {k}")
        for name in ("stop_token_ids",):
            for t in getattr(params, name) or []:
                if t >= self.vocab_size:
                    raise ValueError(
                        f"{name} has token id {t}, outside the vocabulary [0, {self.vocab_size})"
                    )
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError("thinking_token_budget needs a reasoning parser (the engine setting reasoning_parser)")
        if params.structured_outputs is not None and isinstance(params, BeamSearchParams):
            if not self._grammar_stops(params):
                raise ValueError("structured_outputs with beam search needs an end token: drop ignore_eos or give stop_token_ids")
        need = self.blocks_needed_alone(len(token_ids), params)
        if need > self.bm.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks of {self.block_size} tokens even alone (prompt "
                f"{len(token_ids)} tokens, up to {self._max_new(len(token_ids), params)} new tokens x "
                f"{params.group_size} sequences) but the pool has {self.bm.num_blocks}; "
                "raise num_kv_blocks / kv_cache_memory_gb or lower max_tokens / n"
            )

    def _max_new(self, num_prompt_tokens: int, params: RequestParams) -> int:
        return min(params.max_tokens or self.max_model_len, self.max_model_len - num_prompt_tokens)

    def blocks_needed_alone(self, num_prompt_tokens: int, params: RequestParams) -> int:
        """The most KV blocks a request holds when it runs alone, the pool size it needs: its full
        prompt blocks once (shared by all its samples or beams), and per sample or beam its own
        blocks after them up to its last computed token (the last generated token's KV is never
        written). The scheduler guarantees that a request within this completes in any mix."""
        bs = self.block_size
        last = num_prompt_tokens + self._max_new(num_prompt_tokens, params) - 1
        shared = num_prompt_tokens // bs
        return shared + params.group_size * (cdiv(last, bs) - shared)

    def prepare(
        self,
        prompt: str | list[int],
        params: RequestParams,
        lora_request: LoRARequest | None = None,
    ) -> Prompt:
        """Tokenize and validate one request, compile its grammar (cached) and read its LoRA adapter
        (once per adapter). Raises ValueError (naming the problem) on bad input."""
        if not isinstance(params, (SamplingParams, BeamSearchParams, ScoreParams)):
            raise ValueError(
                f"params must be SamplingParams, BeamSearchParams or ScoreParams, got {type(params).__name__}"
            )
        self.add_lora(lora_request)
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        self.compile_grammar(params)
        return Prompt(text, ids)

    def add_lora(self, lora_request: LoRARequest | None) -> bool:
        """Read a LoRA adapter and check it against the model (once per ``lora_int_id``; vLLM's
        ``add_lora``); ``ValueError`` naming what is wrong. None: nothing to do."""
        if lora_request is None:
            return False
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but the engine was built without "
                "enable_lora=True"
            )
        self.runner.lora.add(lora_request)
        return True

    @property
    def structured(self) -> StructuredOutputs:
        """The grammars of structured outputs (built, with xgrammar's view of the tokenizer, when
        the first constrained request comes)."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._structured

    def compile_grammar(self, params: RequestParams) -> None:
        """Compile ``params``' grammar, if it has one, into the cache; ``ValueError`` if it does not
        compile. Thread-safe: a job's reader thread compiles rows' grammars off the step loop."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def _grammar_stops(self, params: RequestParams) -> list[int]:
        return sorted(set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(self.eos_ids)))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Prompt,
        params: RequestParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue one request (``prepare``d already, or prepared here), on the LoRA adapter of
        ``lora_request`` (None: the base model). Raises ValueError, queuing nothing, on bad input."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        if not isinstance(prompt, Prompt):
            prompt = self.prepare(from_vllm_prompt(prompt), params, lora_request)
        else:
            self.add_lora(lora_request)
        matcher = None
        if params.structured_outputs is not None:
            matcher = self.structured.matcher(params.structured_outputs, self._grammar_stops(params))
        ids = prompt.token_ids
        # Prompt log-probabilities need every prompt position computed: such a request shares no
        # blocks with others (its own recompute after a preemption still reuses its blocks).
        wants_prompt_logprobs = isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        private = wants_prompt_logprobs or not self.cfg.enable_prefix_caching
        cache_key: object = ("req", request_id) if private else None
        if lora_request is not None:  # an adapter's blocks hold other KV: cached apart per adapter
            cache_key = ("lora", lora_request.lora_int_id, cache_key)
        switch = self.runner.model.long_rope_after
        if switch is not None and len(ids) > switch:  # LongRoPE: long frequencies from the start
            cache_key = long_rope_key(cache_key)
        group = SequenceGroup(
            request_id=request_id,
            params=params,
            prompt=prompt.text,
            prompt_token_ids=list(ids),
            cache_key=cache_key,
            prompt_logprobs=[None] * len(ids) if wants_prompt_logprobs else None,
            lora_request=lora_request,
        )
        seed = params.seed if isinstance(params, SamplingParams) and params.seed is not None else None
        base = seed if seed is not None else int(self._rng.integers(0, 2**63))
        seq = Sequence(
            group=group,
            index=0,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            seed=derive_seed(base, 0),
            base_seed=base,
            matcher=matcher,
        )
        if self.reasoning is not None and not isinstance(params, ScoreParams):
            seq.reasoning = self.reasoning.state(ids, params.thinking_token_budget)
        if isinstance(params, SamplingParams):
            if params.logprobs is not None:
                seq.logprobs = LogprobsBuilder(params.logprobs)
            if params.stop:
                seq.detok = StopStringWatcher(self.tokenizer, params)
        group.seqs.append(seq)
        self._groups[request_id] = group
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    has_unfinished_requests = has_unfinished  # vLLM's name

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass: schedule, run the model, advance the computed counters, sample and
        step beams, collect the requests that finished."""
        t0 = time.perf_counter()
        with self._stats.timed("schedule_s"):
            out = self._schedule()
            batch = out.step_batch(self.bm.table)
        if out.is_empty:  # block moves only (a swap-out, say)
            self.runner.apply_block_ops(batch)
        else:
            with self._stats.timed("model_s"):
                result = self.runner.execute(batch)
            with self._stats.timed("schedule_s"):
                self.scheduler.finish_step(out)
                self._stats.note_kv_usage(self._live_seqs(), self.bm)
            with self._stats.timed("postprocess_s"):
                for i, rows in result.chunk_logits.items():
                    chunk = out.scheduled[i]
                    if chunk.seq.score is not None:
                        self._note_scores(chunk, rows)
                    else:
                        self._note_prompt_logprobs(chunk, rows)
                self._advance([s.seq for s in out.scheduled if s.samples], result.logits)
            prompt = self._count_prompt_tokens(out.scheduled)
            self._stats.note_step([s.num_new_tokens for s in out.scheduled], time.perf_counter() - t0, prompt)
        if self.cfg.debug_checks:
            self._check_invariants()
        with self._stats.timed("output_s"):
            return self._collect(out.failed)

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        sch = self.scheduler
        if out.is_empty and not sch.running and (sch.waiting or sch.swapped):
            # Nothing can run and nothing running will free blocks: give up on the head request
            # alone (validation makes this unreachable for requests that fit the pool).
            group = (sch.swapped or sch.waiting)[0]
            sch.fail(group, out, f"cannot be scheduled in a pool of {self.bm.num_blocks} KV blocks")
        for group in out.preempted + out.failed:  # beam rows computed before a recompute are void
            for seq in group.seqs:
                self._pending.pop(seq.seq_id, None)
        return out

    def _advance(self, samplers: list[Sequence], logits: torch.Tensor) -> None:
        """Sample the sampling requests' rows, step the beam groups and the scored continuations
        (``logits``: one row per sequence of ``samplers``, in order)."""
        kinds: dict[str, list[int]] = {"sample": [], "beam": [], "score": []}
        for i, seq in enumerate(samplers):
            group = seq.group
            kinds["beam" if group.is_beam else "score" if group.is_score else "sample"].append(i)
        for kind, step in (("sample", self._sample), ("beam", self._beam), ("score", self._score)):
            rows = kinds[kind]
            if rows:
                step([samplers[i] for i in rows], logits if len(rows) == len(samplers) else logits[rows])

    def _score(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Scored continuations (``ScoreParams``). A prompt whose prefill just ended forks into one
        sequence per continuation (copy-on-write, as n samples do); its last position's logits
        score each continuation's first token, and each sequence then computes its continuation
        but the last token, whose logits score the rest (``_note_scores``). A sequence whose
        continuation is computed is done."""
        for seq, row in zip(seqs, logits, strict=True):
            if seq.score is not None:  # its continuation's last chunk: every token is scored
                self.scheduler.free_seq(seq)
                continue
            p: ScoreParams = seq.group.params  # type: ignore[assignment]
            children = [seq] + [self._fork(seq, index=j) for j in range(1, len(p.continuations))]
            firsts = torch.tensor([c[0] for c in p.continuations], device=row.device)
            scores = target_logprobs(row.float()[None].expand(len(children), -1), firsts, p.logprobs)
            for child, cont, entry in zip(children, p.continuations, scores, strict=True):
                child.score = [None] * len(cont)
                child.score[0] = entry
                if len(cont) == 1:
                    self.scheduler.free_seq(child)
                else:
                    child.token_ids.extend(cont[:-1])

    def _note_scores(self, chunk: ScheduledSeq, logits: torch.Tensor) -> None:
        """A scored continuation's chunk: the row of position t scores the token at t + 1, from the
        prompt's last position (after a recompute) to the continuation's last token."""
        seq = chunk.seq
        p: ScoreParams = seq.group.params  # type: ignore[assignment]
        cont = p.continuations[seq.index]
        first = max(chunk.start, seq.num_prompt_tokens - 1)  # the first position that scores a token
        offset = first - chunk.start
        n = min(chunk.start + logits.shape[0], seq.num_prompt_tokens + len(cont) - 1) - first
        if n <= 0:
            return
        c0 = first + 1 - seq.num_prompt_tokens  # the continuation token the first row scores
        targets = torch.tensor(cont[c0 : c0 + n], device=logits.device)
        assert seq.score is not None
        seq.score[c0 : c0 + n] = target_logprobs(logits[offset : offset + n].float(), targets, p.logprobs)

    def _count_prompt_tokens(self, scheduled: list[ScheduledSeq]) -> int:
        """The prompt tokens the step computed; those of scoring requests, and their continuation
        tokens, are counted apart too (``stats()``)."""
        total = 0
        values = self._stats.values
        for s in scheduled:
            prompt = max(0, min(s.start + s.num_new_tokens, s.seq.num_prompt_tokens) - s.start)
            total += prompt
            if s.seq.group.is_score:
                values["score_prompt_tokens_computed"] += prompt
                values["score_continuation_tokens_computed"] += s.num_new_tokens - prompt
        return total

    def _note_prompt_logprobs(self, chunk: ScheduledSeq, logits: torch.Tensor) -> None:
        """Prompt log-probabilities from one prefill chunk's logits: the row of position t scores
        prompt token t + 1 (its log-probability, rank and the top k; vLLM's ``prompt_logprobs``
        at output, ``_prompt_logprobs``)."""
        seq, group = chunk.seq, chunk.seq.group
        assert group.prompt_logprobs is not None
        n = min(logits.shape[0], seq.num_prompt_tokens - 1 - chunk.start)
        if n <= 0:
            return
        targets = torch.tensor(seq.token_ids[chunk.start + 1 : chunk.start + 1 + n], device=logits.device)
        k = getattr(group.params, "prompt_logprobs", None) or 0
        group.prompt_logprobs[chunk.start + 1 : chunk.start + 1 + n] = target_logprobs(logits[:n].float(), targets, k)

    def _live_seqs(self) -> list[Sequence]:
        return [s for g in self.scheduler.running for s in g.seqs if s.status is not SeqStatus.FINISHED]

    def _check_invariants(self) -> None:
        self.bm.check_invariants()
        for group in self.scheduler.running:
            for seq in group.seqs:
                seq.check()

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows: list[SampleRow] = []
        targets: list[Sequence] = []
        row_index: list[int] = []
        for i, seq in enumerate(seqs):
            group = seq.group
            params: SamplingParams = group.params  # type: ignore[assignment]
            if len(group.seqs) == 1 and params.n > 1 and seq.num_output_tokens == 0:
                # The prompt's prefill is done: fork it into n samples, one token each from this row.
                children = [seq] + [self._fork(seq, index=j) for j in range(1, params.n)]
            else:
                children = [seq]
            for child in children:
                blocked = []
                if child.num_output_tokens < params.min_tokens:
                    blocked = list(params.stop_token_ids or []) + (
                        [] if params.ignore_eos else list(self.eos_ids)
                    )
                rows.append(
                    SampleRow(
                        params,
                        child.seed,
                        child.num_output_tokens,
                        child.token_ids,
                        child.num_prompt_tokens,
                        blocked,
                    )
                )
                targets.append(child)
                row_index.append(i)
        if len(targets) != len(seqs):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        grammar = self._grammar_mask(targets)
        with self._stats.timed("sampler_s"):
            result = sample(logits, rows, grammar=grammar)
        self._stats.values["generated_tokens"] += len(targets)
        for seq, tok, lp, top in zip(
            targets, result.tokens, result.logprobs, result.top_logprobs, strict=True
        ):
            seq.token_ids.append(tok)
            seq.cumulative_logprob += lp
            if seq.logprobs is not None:
                assert top is not None  # the request asked for logprobs
                seq.logprobs.append(tok, lp, top.rank, top.ids, top.logprobs)
            ended = self._advance_grammar(seq, tok)
            if check_stop(seq, seq.group.params, self.eos_ids, self.max_model_len) or ended:  # type: ignore[arg-type]
                self.scheduler.free_seq(seq)

    def _grammar_mask(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The step's token mask for the rows of ``seqs`` that follow a grammar or must write a
        forced token (None: none do). A grammar applies after the reasoning only; a row that may
        still start its reasoning may also take the start tag; a spent thinking budget forces
        the end of the reasoning."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None and not _thinking(seq)]
        forced = {} if self.reasoning is None else {
            i: seq.reasoning.forcing[0] for i, seq in enumerate(seqs) if seq.reasoning is not None and seq.reasoning.forcing
        }
        if not rows and not forced:
            return None
        if rows:
            structured = self.structured
            live = [i for i in rows if not seqs[i].matcher.is_terminated()]
            mask = structured.bitmask([seqs[i].matcher for i in live], live, len(seqs))
            for i in rows:
                if i not in live:  # a beam that took an end token as a running candidate (nothing else was
                    # allowed): as after the grammar's end, only end tokens, as the oracle's processor does
                    allow_only(mask, i, self._grammar_stops(seqs[i].group.params))
                elif seqs[i].reasoning is not None and not seqs[i].reasoning.ended:
                    assert self.reasoning is not None
                    allow_also(mask, i, self.reasoning.start[0])
        else:
            mask = full_mask(len(seqs), self.vocab_size)
        for i, token in forced.items():
            allow_only(mask, i, [token])
        apply = self._structured.apply if self._structured is not None else apply_bitmask
        return GrammarMask(mask, sorted(set(rows) | set(forced)), apply, self.vocab_size)

    def _advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Feed ``token`` to the sequence's grammar (after its reasoning state: a reasoning token
        is not the grammar's); True when that ends the sequence (the grammar is complete and has
        no stop token to wait for)."""
        if seq.reasoning is not None:
            assert self.reasoning is not None
            budget = seq.group.params.thinking_token_budget
            if self.reasoning.advance(seq.reasoning, token, budget):
                return False
        if seq.matcher is None:
            return False
        if seq.matcher.is_terminated():
            return True
        if not seq.matcher.accept_token(token) or seq.matcher.is_terminated():
            if seq.finish_reason is None:
                seq.finish_reason = "stop"
            return True
        return False

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        group = parent.group
        child = Sequence(
            group=group,
            index=index,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            seed=derive_seed(parent.base_seed, index),
            base_seed=parent.base_seed,
            num_computed_tokens=parent.num_computed_tokens,
            status=parent.status,
            cumulative_logprob=parent.cumulative_logprob,
        )
        if parent.logprobs is not None:
            child.logprobs = parent.logprobs.copy()
        if parent.detok is not None:
            child.detok = parent.detok.copy_for(parent.output_token_ids, self.tokenizer, group.params)
        if parent.matcher is not None:
            child.matcher = parent.matcher.fork()
        if parent.reasoning is not None:
            child.reasoning = parent.reasoning.copy()
        self.bm.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        return child

    def _beam(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        ready: dict[tuple[int, int], list[SequenceGroup]] = defaultdict(list)
        for group in dict.fromkeys(seq.group for seq in seqs):
            if group.beam is None:
                p: BeamSearchParams = group.params  # type: ignore[assignment]
                end = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos_ids)))
                prompt_seq = group.seqs[0]
                max_len = min(prompt_seq.num_prompt_tokens + p.max_tokens, self.max_model_len)
                group.beam = BeamState.start(p, prompt_seq, end, max_len)
            beams = group.beam.beams
            if all(b.seq_id in row_of or b.seq_id in self._pending for b in beams):
                ready[group.beam.group_key].append(group)
            else:  # some beams were not computed this step (token budget): keep the rows we have
                for b in beams:
                    if b.seq_id in row_of:
                        self._pending[b.seq_id] = logits[row_of[b.seq_id]].clone()
        for groups in ready.values():
            beams = [b for g in groups for b in g.beam.beams]
            if all(b.seq_id in row_of for b in beams):
                source, index = logits, [row_of[b.seq_id] for b in beams]
            else:
                source = torch.stack(
                    [
                        logits[row_of[b.seq_id]] if b.seq_id in row_of else self._pending[b.seq_id]
                        for b in beams
                    ]
                )
                index = list(range(len(beams)))
            for b in beams:
                self._pending.pop(b.seq_id, None)
            choices = beam_step([g.beam for g in groups], source, index, self._grammar_mask(beams))
            for group, choice in zip(groups, choices, strict=True):
                self._apply_beams(group, choice)

    def _apply_beams(self, group: SequenceGroup, choice) -> None:
        state: BeamState = group.beam
        old = list(dict.fromkeys(state.beams))
        if state.done:
            for seq in old:
                self.scheduler.free_seq(seq)
            group.seqs = old
            return
        used: set[int] = set()
        assigned: list[tuple[Sequence, int, float]] = []
        for parent, tok, score in zip(choice.parents, choice.tokens, choice.scores, strict=True):
            if parent.seq_id in used:
                target = self._fork(parent, index=len(group.seqs))
            else:
                used.add(parent.seq_id)
                target = parent
            assigned.append((target, tok, score))
        self._stats.values["generated_tokens"] += len(assigned)
        for target, tok, score in assigned:
            target.token_ids.append(tok)
            target.cumulative_logprob = score
            self._advance_grammar(target, tok)
        for seq in old:
            if seq.seq_id not in used:
                self.scheduler.free_seq(seq)
        state.beams = [t for t, _, _ in assigned]
        group.seqs = list(state.beams)

    # -- results -------------------------------------------------------------------------------
    def _collect(self, failed: list[SequenceGroup]) -> list[RequestOutput]:
        done = [self._output(g) for g in self.scheduler.remove_finished()]
        for group in failed:
            done.append(
                RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, 0, error=group.error)
            )
        for out in done:
            self._groups.pop(out.request_id, None)
        return done

    def abort_request(self, request_id: str) -> None:
        """Drop a queued or running request and free its blocks; unknown ids are ignored."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            self.scheduler.abort(group)
            for seq in group.seqs:
                self._pending.pop(seq.seq_id, None)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        except Exception:  # noqa: BLE001 - ids past the tokenizer's vocabulary
            known = [t for t in ids if t < len(self.tokenizer)]
            return self.tokenizer.decode(known, skip_special_tokens=skip_special)

    def _split(self, token_ids: list[int], skip_special: bool, stopped: str | None) -> tuple[str | None, str]:
        """(reasoning, text) of a completion: without a reasoning parser, no reasoning and the
        whole text (``stopped``: the text a stop string cut, when one did)."""
        if self.reasoning is None:
            return None, stopped if stopped is not None else self._decode(token_ids, skip_special)
        if stopped is not None:  # split the cut text at the end tag's text
            end = self._decode(self.reasoning.end, False)
            start = self._decode(self.reasoning.start, False)
            if end in stopped:
                head, _, tail = stopped.partition(end)
                return head.replace(start, "", 1), tail
            return None, stopped
        thinking, answer = self.reasoning.split(token_ids, lambda ids: self._decode(ids, skip_special))
        return thinking, answer or ""

    def _decode_token(self, token: int) -> str:
        return self._decode([token], False)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        completions = []
        if group.is_score:
            completions = [self._score_output(seq) for seq in sorted(group.seqs, key=lambda s: s.index)]
            self._stats.values["scored_continuations"] += len(completions)
        elif group.is_beam:
            p: BeamSearchParams = group.params  # type: ignore[assignment]
            for i, hyp in enumerate(group.beam.finished[: p.num_return_sequences]):
                if hyp is None:
                    continue
                reasoning, text = self._split(hyp.token_ids, True, None)
                completions.append(
                    CompletionOutput(
                        index=i,
                        text=text,
                        reasoning=reasoning,
                        token_ids=hyp.token_ids,
                        cumulative_logprob=hyp.logprob_sum,
                        logprobs=None,
                        finish_reason="stop" if hyp.ended_by_token else "length",
                        stop_reason=hyp.token_ids[-1]
                        if hyp.ended_by_token and hyp.token_ids[-1] not in self.eos_ids
                        else None,
                        score=hyp.score,
                    )
                )
        else:
            sp: SamplingParams = group.params  # type: ignore[assignment]
            for seq in sorted(group.seqs, key=lambda s: s.index):
                stopped = seq.detok.text[: seq.text_end] if seq.text_end is not None else None
                reasoning, text = self._split(seq.output_token_ids, sp.skip_special_tokens, stopped)
                completions.append(
                    CompletionOutput(
                        index=seq.index,
                        text=text,
                        reasoning=reasoning,
                        token_ids=seq.output_token_ids,
                        cumulative_logprob=seq.cumulative_logprob,
                        logprobs=None if seq.logprobs is None else seq.logprobs.build(self._decode_token),
                        finish_reason=seq.finish_reason or "length",
                        stop_reason=seq.stop_reason,
                    )
                )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=group.num_cached_tokens or 0,
            outputs=completions,
            prompt_logprobs=self._prompt_logprobs(group),
            lora_request=group.lora_request,
        )

    def _score_output(self, seq: Sequence) -> CompletionOutput:
        """One scored continuation: ``cumulative_logprob`` is its total log-probability,
        ``logprobs`` (when asked) its tokens' values and top alternatives."""
        p: ScoreParams = seq.group.params  # type: ignore[assignment]
        cont = p.continuations[seq.index]
        assert seq.score is not None and all(e is not None for e in seq.score), "a continuation token was not scored"
        logprobs = None if p.logprobs is None else self._token_logprobs(p.logprobs, cont, seq.score)
        return CompletionOutput(
            index=seq.index,
            text=self._decode(cont, False),
            token_ids=list(cont),
            cumulative_logprob=float(sum(lp for lp, _ in seq.score)),
            logprobs=logprobs,
            finish_reason="length",
        )

    def _token_logprobs(self, k: int, tokens: list[int], values: list[Any]) -> TokenLogprobs:
        """``TokenLogprobs`` of ``tokens`` from their (log-probability, TopLogprobs) pairs."""
        builder = LogprobsBuilder(k)
        for tok, (lp, top) in zip(tokens, values, strict=True):
            builder.append(tok, lp, top.rank, top.ids, top.logprobs)
        return builder.build(self._decode_token)

    def _prompt_logprobs(self, group: SequenceGroup) -> PromptLogprobs | None:
        if group.prompt_logprobs is None:
            return None
        k = getattr(group.params, "prompt_logprobs", None) or 0
        return PromptLogprobs(self._token_logprobs(k, group.prompt_token_ids[1:], group.prompt_logprobs[1:]))

    # -- statistics ----------------------------------------------------------------------------
    @property
    def generated_tokens(self) -> int:
        """Tokens sampled so far (every sample's and beam's), finished requests or not."""
        return int(self._stats.values["generated_tokens"])

    def reset_stats(self) -> None:
        """Start the step counts, times and KV peaks afresh (benchmarks do after a warm-up)."""
        self._stats.clear()
        self.runner.times = RunnerTimes()

    def stats(self) -> dict[str, float | int | str]:
        tm = self.runner.times
        return {
            "num_blocks": self.bm.num_blocks,
            "block_size": self.block_size,
            "peak_blocks_used": self.bm.peak_used_blocks,
            "cow_copies": self.bm.num_cow_copies,
            "prefix_cache_hit_tokens": self.bm.prefix_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_outs": self.scheduler.num_swap_outs,
            "swapped_blocks": self.scheduler.num_swapped_blocks,
            "rope_recomputes": self.scheduler.num_rope_recomputes,
            **{k: int(self._stats.values[k]) for k in (
                "scored_continuations", "score_prompt_tokens_computed", "score_continuation_tokens_computed")},
            "linear_backend": self.runner.model.lm_head.backend,
            "cuda_graph_replays": self.runner.graphs.replays if self.runner.graphs is not None else 0,
            "num_threads": self.runner.threads.count,
            "num_threads_reason": self.runner.threads.reason,
            "omp_wait_policy": omp_wait_policy(),
            **self._shared_core_stats(),
            **self._stats.kv_figures(),
            **self._stats.step_figures(),
            "runner_prepare_s": tm.prepare + tm.copy,
            "forward_s": tm.forward,
            "attention_s": tm.attention,
            "expert_s": tm.experts,
            "lm_head_s": tm.lm_head,
            **(self._structured.stats() if self._structured is not None else StructuredOutputs.no_stats()),
            **self._lora_stats(),
            **self._quant_stats(),
        }

    def _shared_core_stats(self) -> dict[str, float | int]:
        """Threads while other processes share the CPUs (``adapt_threads``): the count now, the CPUs
        the others used over the last second, the seconds run with fewer threads."""
        shared = self.runner.shared_cores
        if shared is None:
            return {"threads_now": self.runner.threads.count, "others_cpus": 0.0, "reduced_threads_s": 0.0}
        return {"threads_now": shared.threads, "others_cpus": round(shared.others, 2),
                "reduced_threads_s": round(shared.reduced_s, 2)}

    def _quant_stats(self) -> dict[str, str]:
        """The checkpoint's quantization and how many projections took each path (``quant.py``)."""
        model = self.runner.model
        if model.quant_method is None:
            return {"quantization": "none", "quantized_paths": ""}
        counts = path_counts(model.linears)
        return {
            "quantization": model.quant_method,
            "quantized_paths": ", ".join(f"{path} x {n}" for path, n in sorted(counts.items())),
        }

    def _lora_stats(self) -> dict[str, int]:
        """Adapters read from disk, made resident (loaded into a slot) and evicted from one."""
        lora = self.runner.lora
        return {
            "lora_disk_loads": lora.disk_loads if lora else 0,
            "lora_activations": lora.activations if lora else 0,
            "lora_evictions": lora.evictions if lora else 0,
        }


def _thinking(seq: Sequence) -> bool:
    """Whether the sequence's next token is part of its reasoning (no grammar applies)."""
    return seq.reasoning is not None and seq.reasoning.inside
