"""The engine loop: requests in, one scheduled forward pass per ``step``, finished groups out.

``step``: schedule -> run the model on the flattened batch -> advance counters and cache full
blocks -> hand each request kind (``engine/kinds``: sampling, beam search, scoring) the logits of
its chunks that asked for every position's and of its sequences whose last token was computed
(the kind samples, steps beams or scores, forks, checks stops and frees finished sequences) ->
return the requests that finished, each assembled by its kind.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from batchgen.config import EngineConfig
from batchgen.cpus import omp_wait_policy
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.constraints import TokenConstraints
from batchgen.engine.kinds import KINDS, EngineParts, RequestKind
from batchgen.engine.sampler import derive_seed
from batchgen.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from batchgen.engine.sequence import SeqStatus, Sequence, SequenceGroup, long_rope_key
from batchgen.engine.stats import EngineStats
from batchgen.engine.structured import StructuredOutputs
from batchgen.engine.text import OutputText
from batchgen.model.hub import local_dir, snapshot_revision
from batchgen.model.loader import load_config, load_tokenizer
from batchgen.model.quant import path_counts
from batchgen.model.runner import ModelRunner, RunnerTimes
from batchgen.outputs import RequestOutput
from batchgen.params import LoRARequest, RequestParams
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
        self._stats = EngineStats(cfg.block_size, self.max_model_len)
        self._groups: dict[str, SequenceGroup] = {}  # queued and running requests by id
        self.constraints = TokenConstraints(self.tokenizer, self.vocab_size, self.eos_ids, cfg.reasoning_parser)
        self.reasoning = self.constraints.reasoning
        parts = EngineParts(
            self.bm, self.scheduler, self._stats, self.constraints, OutputText(self.tokenizer, self.reasoning),
            self.eos_ids, self.vocab_size, self.max_model_len,
        )
        # one of each request kind, by the type of its parameters
        self.kinds: dict[type, RequestKind[Any]] = {kind.params_type: kind(parts) for kind in KINDS}

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
        self.kind(params).validate(token_ids, params)
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
        if type(params) not in self.kinds:
            *names, last = (t.__name__ for t in self.kinds)
            raise ValueError(f"params must be {', '.join(names)} or {last}, got {type(params).__name__}")
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
        """The grammars of structured outputs (built with the first constrained request)."""
        return self.constraints.structured

    def compile_grammar(self, params: RequestParams) -> None:
        """Compile ``params``' grammar, if it has one, into the cache; ``ValueError`` if it does not
        compile. Thread-safe: a job's reader thread compiles rows' grammars off the step loop."""
        self.constraints.compile(params)

    def kind(self, params: RequestParams) -> RequestKind[Any]:
        """The request kind that runs requests of ``params``' type."""
        return self.kinds[type(params)]

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
        kind = self.kind(params)
        ids = prompt.token_ids
        private = kind.private_prefix(params) or not self.cfg.enable_prefix_caching
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
            lora_request=lora_request,
        )
        seed = kind.seed(params)
        base = seed if seed is not None else int(self._rng.integers(0, 2**63))
        seq = Sequence(
            group=group,
            index=0,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            seed=derive_seed(base, 0),
            base_seed=base,
        )
        kind.start(seq, params)
        group.seqs.append(seq)
        self._groups[request_id] = group
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    has_unfinished_requests = has_unfinished  # vLLM's name

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass: schedule, run the model, advance the computed counters, hand each
        request kind its rows, collect the requests that finished."""
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
                    self.kind(chunk.seq.group.params).note_chunk(chunk, rows)
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
        for group in out.preempted + out.failed:  # what a kind kept of them across steps is void
            self.kind(group.params).drop(group)
        return out

    def _advance(self, samplers: list[Sequence], logits: torch.Tensor) -> None:
        """Hand each kind its sequences whose last token was computed (``logits``: one row per
        sequence of ``samplers``, in order)."""
        rows: dict[type, list[int]] = {}
        for i, seq in enumerate(samplers):
            rows.setdefault(type(seq.group.params), []).append(i)
        for params_type, index in rows.items():
            seqs = samplers if len(index) == len(samplers) else [samplers[i] for i in index]
            self.kinds[params_type].advance(seqs, logits if len(index) == len(samplers) else logits[index])

    def _count_prompt_tokens(self, scheduled: list[ScheduledSeq]) -> int:
        """The prompt tokens the step computed (each kind is told its sequences' counts too)."""
        total = 0
        for s in scheduled:
            prompt = max(0, min(s.start + s.num_new_tokens, s.seq.num_prompt_tokens) - s.start)
            total += prompt
            self.kind(s.seq.group.params).note_computed(s.seq, prompt, s.num_new_tokens - prompt)
        return total

    def _live_seqs(self) -> list[Sequence]:
        return [s for g in self.scheduler.running for s in g.seqs if s.status is not SeqStatus.FINISHED]

    def _check_invariants(self) -> None:
        self.bm.check_invariants()
        for group in self.scheduler.running:
            for seq in group.seqs:
                seq.check()

    # -- results -------------------------------------------------------------------------------
    def _collect(self, failed: list[SequenceGroup]) -> list[RequestOutput]:
        done = [self.kind(g.params).output(g) for g in self.scheduler.remove_finished()]
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
            self.kind(group.params).drop(group)

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
            **{key: value for kind in self.kinds.values() for key, value in kind.stats().items()},
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
            **self.constraints.stats(),
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

