"""The model runner: turns a ``SchedulerOutput`` into one forward pass over a flattened batch.

Per step it (1) applies the step's copy-on-write block copies in one indexed copy over all layers,
(2) lays out decode tokens first and prefill chunks after, building input ids, positions, slot
mapping and block tables with numpy (no per-token Python loop), (3) runs the model and returns the
logits of the last token of every sequence that samples this step, in the scheduler's order.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from batchgen.config import EngineConfig
from batchgen.cpus import SharedCores, affinity_cpus, choose_threads
from batchgen.model.attention import (
    AttentionMetadata,
    CacheShape,
    DecodeGroups,
    PrefillChunk,
    TorchAttention,
    make_backend,
)
from batchgen.model.decoder import DecoderModel
from batchgen.model.graphs import DecodeGraphs, HostStaging
from batchgen.model.layers import fused_cpu_ops
from batchgen.model.lora import LoRAManager
from batchgen.model.malloc import keep_freed_memory
from batchgen.step import Chunk, CopyPair, StepBatch, StepResult
from batchgen.utils import cdiv
from batchgen_kernels.swap import swap_blocks

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


# Decode steps of up to this many sequences replay CUDA graphs (one graph per bucketed batch
# size); larger ones run eagerly: every bucket costs capture time and graph-pool memory.
MAX_GRAPH_BATCH = 256
# GPU memory left outside the KV pool when it is sized from free memory: activations, logits
# of a full batch and the CUDA-graph pool.
GPU_RESERVE_BYTES = 2 * 2**30

@dataclass
class RunnerTimes:
    """Seconds spent, summed over steps: block copies, input building, the model forward (of which
    attention and, in mixture-of-experts models, the experts' GEMMs), and the LM head."""

    copy: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    attention: float = 0.0
    experts: float = 0.0
    lm_head: float = 0.0


class _Layout(NamedTuple):
    """One step's flattened batch in numpy (see ``ModelRunner._layout``)."""

    order: list[Chunk]  # decode chunks, then prefill chunks
    num_decode: int
    ids: np.ndarray  # [tokens] input ids
    positions: np.ndarray  # [tokens]
    slots: np.ndarray  # [tokens] KV slot of each token
    tables: np.ndarray  # [chunks, width] block tables padded with the null block
    cu: np.ndarray  # [chunks + 1] offsets of each chunk's tokens
    starts: np.ndarray  # [chunks] position of each chunk's first token
    seq_of_token: np.ndarray  # [tokens] chunk of each token


class ModelRunner:
    def __init__(self, cfg: EngineConfig, hf_config, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        # the CPUs this process may use (affinity mask, cgroup quota) unless a setting names a count;
        # the compiled kernels read torch's count
        self.threads = choose_threads(cfg.num_threads)
        torch.set_num_threads(self.threads.count)
        # fewer threads while other processes take part of these CPUs (``adapt_threads``)
        self.shared_cores = (
            SharedCores(affinity_cpus(), self.threads.count)
            if cfg.adapt_threads and self.device.type == "cpu" and self.threads.count > 1
            else None
        )
        if self.device.type == "cpu":  # a step's largest block: the logits of a full batch
            keep_freed_memory(cfg.max_num_seqs * (getattr(hf_config, "vocab_size", 0) or 0) * 4)
        self.model = DecoderModel(
            hf_config, cfg.model, self.device, self.dtype, max_model_len, linear_backend=cfg.linear_backend
        )
        m = self.model
        self.backend = make_backend(
            cfg.attention_backend,
            self.device,
            CacheShape(self.dtype, m.num_heads, m.num_kv_heads, m.head_dim, cfg.block_size),
        )
        self.times = RunnerTimes()
        # LoRA adapters (``enable_lora``): on the Triton kernels where attention runs on Triton
        self.lora: LoRAManager | None = None
        if cfg.enable_lora:
            self.lora = LoRAManager(
                m, cfg.max_loras, cfg.max_lora_rank, m.linear_backends, triton=not isinstance(self.backend, TorchAttention)
            )
        # The Triton backend reads the batch per token; the torch backend per decode group / prefill.
        self.per_token_layout = not isinstance(self.backend, TorchAttention)
        # Decode rows sharing leading blocks attend as one group (not with sliding windows: a group's
        # key positions are not absolute there).
        self.group_shared_prefixes = all(lw.attn.window is None for lw in self.model.layers)
        self.min_shared_blocks = 2
        self.max_group_rows = 8
        self.block_size = cfg.block_size
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_memory(max_model_len)
        # One block past the pool, never handed out and kept zeroed: padding entries of block
        # tables and the padding rows of CUDA-graph steps point at it (vLLM's null block).
        self.null_block = self.num_blocks
        self.kv_cache = torch.empty(
            (m.num_layers, 2, m.num_kv_heads, self.num_blocks + 1, self.block_size, m.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.zero_blocks([self.null_block])
        mode = cfg.preemption_mode
        self.preemption_mode = (
            ("swap" if self.device.type == "cuda" else "recompute") if mode == "auto" else mode
        )
        self.num_host_blocks = 0
        self.host_cache: torch.Tensor | None = None
        if self.preemption_mode == "swap":
            # the host pool for swap preemption: pinned on CUDA so transfers run asynchronously
            self.num_host_blocks = max(1, int(cfg.swap_space_gb * 2**30 // self.bytes_per_block))
            shape = list(self.kv_cache.shape)
            shape[3] = self.num_host_blocks
            try:
                self.host_cache = torch.empty(
                    shape, dtype=self.dtype, device="cpu", pin_memory=self.device.type == "cuda"
                )
            except RuntimeError as e:
                raise ValueError(
                    f"swap_space_gb={cfg.swap_space_gb}: cannot allocate the host pool for swap "
                    f"preemption ({self.num_host_blocks} blocks); lower swap_space_gb ({e})"
                ) from e
        self.staging = HostStaging(self.device)
        # Decode steps replay CUDA graphs (the Triton backend's per-token layout, on CUDA only; not
        # for mixture-of-experts models, whose expert loop reads token counts on the host).
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graphs and self.device.type == "cuda" and self.per_token_layout and not self.model.is_moe:
            try:
                self.graphs = DecodeGraphs(self, min(cfg.max_num_seqs, MAX_GRAPH_BATCH))
            except RuntimeError as e:  # a capture failure costs speed, not results
                warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {e}", stacklevel=2)
                torch.cuda.synchronize(self.device)

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        return (
            2
            * m.num_layers
            * self.block_size
            * m.num_kv_heads
            * m.head_dim
            * torch.finfo(self.dtype).bits
            // 8
        )

    def _blocks_from_memory(self, max_model_len: int) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * self.cfg.gpu_memory_utilization - GPU_RESERVE_BYTES
        else:
            budget = self.cfg.kv_cache_memory_gb * 2**30
        # Never more than every sequence at full length could use.
        cap = self.cfg.max_num_seqs * (cdiv(max_model_len, self.block_size) + 1)
        return max(2, min(int(budget // self.bytes_per_block), cap))

    def zero_blocks(self, block_ids: list[int]) -> None:
        """New blocks start as zeros: masked slots of a partly filled block must hold finite values."""
        if not block_ids:
            return
        if (ops := fused_cpu_ops(self.kv_cache, kernel="block_ops")) is not None:
            ops.zero_blocks(self.kv_cache, block_ids)
            return
        self.kv_cache[:, :, :, torch.tensor(block_ids, device=self.device)] = 0

    def copy_blocks(self, copies: list[CopyPair]) -> None:
        if not copies:
            return
        src_ids, dst_ids = [c.src for c in copies], [c.dst for c in copies]
        # one memcpy per block and plane where the copies can run in any order; else torch's
        # gather, then scatter
        ops = fused_cpu_ops(self.kv_cache, kernel="block_ops")
        if ops is not None and ops.independent(src_ids, dst_ids):
            ops.copy_blocks(self.kv_cache, src_ids, dst_ids)
            return
        src = torch.tensor(src_ids, device=self.device)
        dst = torch.tensor(dst_ids, device=self.device)
        if self.per_token_layout:
            from batchgen_kernels.block_ops import copy_blocks

            copy_blocks(self.kv_cache, src, dst)
        else:
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]

    def swap_blocks(self, to_host: bool, pairs: list[CopyPair]) -> None:
        if self.host_cache is None:
            raise RuntimeError("swap requested but the runner has no host pool (preemption_mode)")
        src = torch.tensor([p.src for p in pairs])
        dst = torch.tensor([p.dst for p in pairs])
        if to_host:
            swap_blocks(self.kv_cache, self.host_cache, src, dst)
        else:
            swap_blocks(self.host_cache, self.kv_cache, src, dst)

    def apply_block_ops(self, batch: StepBatch) -> None:
        """Before a forward pass: swaps in the order the scheduler decided them (a block freed by a
        swap-out may be the target of a later swap-in), then zeroing of new blocks (a freed block may
        have been handed out again), then copy-on-write copies (their source may have just been
        swapped in)."""
        for swap in batch.swaps:
            self.swap_blocks(swap.to_host, swap.pairs)
        self.zero_blocks(batch.fresh_blocks)
        self.copy_blocks(batch.copies)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step; returns float32 logits [number of sampling chunks, vocab] in chunk order,
        and every token's logits for the chunks that ask (``Chunk.all_logits``).
        ``apply_block_ops`` runs first."""
        t0 = time.perf_counter()
        if self.shared_cores is not None:
            threads = self.shared_cores.update()
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.apply_block_ops(batch)
        t1 = time.perf_counter()
        lay = self._layout(batch.chunks)
        plain = all(s.samples and not s.all_logits and not s.lora_id for s in lay.order)
        if self.graphs is not None and lay.num_decode == len(lay.order) and plain:
            t2 = time.perf_counter()
            logits = self.graphs.run(lay.ids, lay.positions, lay.slots, lay.tables)
            if logits is not None:  # every decode row samples, in the scheduled order
                t3 = time.perf_counter()
                self.times.copy += t1 - t0
                self.times.prepare += t2 - t1
                self.times.forward += t3 - t2
                return StepResult(logits, {})
        input_ids, pos_t, meta = self._metadata(lay)
        rope_lengths = None
        if self.model.long_rope_after is not None:  # LongRoPE: see ``Rotary``
            lengths = np.fromiter((s.seq_len for s in lay.order), dtype=np.int64, count=len(lay.order))
            rope_lengths = torch.from_numpy(lengths[lay.seq_of_token]).to(self.device)
        lora = None
        if self.lora is not None:
            adapters = np.fromiter((s.lora_id for s in lay.order), dtype=np.int64, count=len(lay.order))
            lora = self.lora.batch(adapters[lay.seq_of_token])
        # Last token of each sampling sequence, in the caller's order.
        row_of = {id(s): i for i, s in enumerate(lay.order)}
        last = [int(lay.cu[row_of[id(s)] + 1]) - 1 for s in batch.chunks if s.samples]
        t2 = time.perf_counter()
        attention_before = self.backend.seconds
        experts_before = self.model.expert_seconds()
        hidden = self.model.forward(input_ids, pos_t, self.kv_cache, meta, self.backend, rope_lengths, lora)
        self._sync()
        t3 = time.perf_counter()
        dev = self.device
        logits = (
            self.model.logits(hidden[torch.tensor(last, device=dev)])
            if last
            else torch.empty((0, self.model.vocab_size), device=dev)
        )
        chunk_logits = {}
        for i, s in enumerate(batch.chunks):
            if s.all_logits:
                row = row_of[id(s)]
                chunk_logits[i] = self.model.logits(hidden[int(lay.cu[row]) : int(lay.cu[row + 1])])
        self._sync()
        t4 = time.perf_counter()
        tm = self.times
        tm.copy += t1 - t0
        tm.prepare += t2 - t1
        tm.forward += t3 - t2
        tm.attention += self.backend.seconds - attention_before
        tm.experts += self.model.expert_seconds() - experts_before
        tm.lm_head += t4 - t3
        return StepResult(logits, chunk_logits)

    def _layout(self, chunks: list[Chunk]) -> _Layout:
        """The flattened batch in numpy: decode chunks first, then prefill chunks; each token's
        position and KV slot, the padded block tables."""
        decode = [s for s in chunks if s.num_new_tokens == 1]
        prefill = [s for s in chunks if s.num_new_tokens != 1]
        if self.lora is not None:  # the rows of one adapter contiguous (``LoRABatch.segments``)
            decode.sort(key=lambda s: s.lora_id)
            prefill.sort(key=lambda s: s.lora_id)
        order = decode + prefill
        bs = self.block_size
        lens = np.fromiter((s.num_new_tokens for s in order), dtype=np.int64, count=len(order))
        starts = np.fromiter((s.start for s in order), dtype=np.int64, count=len(order))
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(len(order)), lens)
        positions = starts[seq_of_token] + (np.arange(total) - cu[:-1][seq_of_token])
        width = max(len(s.block_table) for s in order)
        bt = np.full((len(order), width), self.null_block, dtype=np.int64)
        for row, s in enumerate(order):
            bt[row, : len(s.block_table)] = s.block_table
        slots = bt[seq_of_token, positions // bs] * bs + positions % bs
        ids: list[int] = []
        for s in order:
            ids.extend(s.token_ids)
        return _Layout(
            order, len(decode), np.array(ids, dtype=np.int64), positions, slots, bt, cu, starts, seq_of_token
        )

    def _metadata(self, lay: _Layout) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata on the device, in the backend's layout:
        per token for Triton, decode groups and prefill chunks for the torch backend."""
        if self.per_token_layout:
            bt_t, slots_t, input_ids, pos_t, rows_t, ctx_t = self.staging(
                lay.tables, lay.slots, lay.ids, lay.positions, lay.seq_of_token, lay.positions + 1
            )
            meta = AttentionMetadata(slot_mapping=slots_t, num_decode=lay.num_decode)
            meta.block_tables = bt_t
            meta.token_rows = rows_t
            meta.token_ctx = ctx_t
            meta.max_context = int(lay.positions.max()) + 1
            return input_ids, pos_t, meta
        bt_t, slots_t, input_ids, pos_t = self.staging(lay.tables, lay.slots, lay.ids, lay.positions)
        meta = AttentionMetadata(slot_mapping=slots_t, num_decode=lay.num_decode)
        nd = lay.num_decode
        if nd and self.backend.decode_rows:
            meta.decode_tables = bt_t[:nd]
            meta.decode_context = torch.from_numpy(lay.starts[:nd] + 1).to(self.device)
        elif nd:
            meta.decode_groups = self._decode_groups(lay.tables[:nd], lay.starts[:nd] + 1)
        for row in range(nd, len(lay.order)):
            s = lay.order[row]
            end = s.start + s.num_new_tokens
            nblocks = cdiv(end, self.block_size)
            meta.prefills.append(PrefillChunk(int(lay.cu[row]), s.num_new_tokens, end, bt_t[row, :nblocks]))
        return input_ids, pos_t, meta

    def _shared_prefixes(self, bt: np.ndarray, ctx: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Rows (at least 2) whose tables start with the same full blocks (at least
        ``min_shared_blocks``), with the length of that common start."""
        bs = self.block_size
        full = (ctx - 1) // bs  # blocks entirely before each row's newest token
        first = bt[:, 0]
        order = np.argsort(first, kind="stable")
        bounds = np.flatnonzero(np.diff(first[order])) + 1
        out = []
        for rows in np.split(order, bounds):
            if len(rows) < 2:
                continue
            limit = int(full[rows].min())
            if limit < self.min_shared_blocks:
                continue
            sub = bt[rows, :limit]
            same = (sub == sub[0]).all(axis=0)
            n = limit if same.all() else int(np.argmin(same))
            if n >= self.min_shared_blocks:
                out.append((rows, n))
        return out

    def _decode_groups(self, bt: np.ndarray, ctx: np.ndarray) -> list[DecodeGroups]:
        """Decode rows in groups that share leading blocks (each shared block is then read once for
        all the group's rows), batched by similar size so that padding wastes little."""
        bs = self.block_size
        nblocks = cdiv(ctx, bs)
        shared = self._shared_prefixes(bt, ctx) if self.group_shared_prefixes else []
        alone = np.ones(len(ctx), dtype=bool)
        for rows, _ in shared:
            alone[rows] = False
        # Big groups are cut into groups of at most ``max_group_rows``: every row of a group scores
        # the other rows' own blocks too (masked), so that work grows with the group's size squared.
        cap = self.max_group_rows
        groups = [(rows[i : i + cap], n) for rows, n in shared for i in range(0, len(rows), cap)]
        groups += [(np.array([r]), 0) for r in np.flatnonzero(alone)]
        sizes = [n + int((nblocks[rows] - n).sum()) for rows, n in groups]
        keys = [
            (int(np.ceil(np.log2(u))), int(np.ceil(np.log2(len(rows)))))
            for u, (rows, _) in zip(sizes, groups, strict=True)
        ]
        out = []
        for key in sorted(set(keys)):
            members = [i for i, k in enumerate(keys) if k == key]
            g_count = len(members)
            r_max = max(len(groups[i][0]) for i in members)
            u_max = max(sizes[i] for i in members)
            # every row of the bucket at once: its group, place in the group, shared block count,
            # own block count and the column where its own blocks start in the group's table
            rows = np.concatenate([groups[i][0] for i in members])
            sizes_g = np.array([len(groups[i][0]) for i in members])
            g_of = np.repeat(np.arange(g_count), sizes_g)
            first = np.cumsum(sizes_g) - sizes_g
            r_of = np.arange(len(rows)) - first[g_of]
            n_of = np.repeat(np.array([groups[i][1] for i in members]), sizes_g)
            own = nblocks[rows] - n_of
            own_before = np.cumsum(own) - own  # own blocks of earlier rows, across groups
            col = n_of + own_before - own_before[first][g_of]
            tables = np.full((g_count, u_max), self.null_block, dtype=np.int64)
            for gi, i in enumerate(members):  # the shared blocks, once per group
                lead, n = groups[i]
                tables[gi, :n] = bt[lead[0], :n]
            k = np.arange(int(own.sum())) - np.repeat(own_before, own)  # index among a row's own blocks
            tables[np.repeat(g_of, own), np.repeat(col, own) + k] = bt[
                np.repeat(rows, own), np.repeat(n_of, own) + k
            ]
            pos = np.arange(u_max * bs)[None, :]
            start = (col * bs)[:, None]
            row_mask = (pos < (n_of * bs)[:, None]) | (
                (pos >= start) & (pos < start + (ctx[rows] - n_of * bs)[:, None])
            )
            mask = np.zeros((g_count, r_max, u_max * bs), dtype=bool)
            mask[g_of, r_of] = row_mask
            row_index = np.zeros((g_count, r_max), dtype=np.int64)
            valid = np.zeros((g_count, r_max), dtype=bool)
            lens = np.zeros((g_count, r_max), dtype=np.int64)
            row_index[g_of, r_of] = rows
            valid[g_of, r_of] = True
            lens[g_of, r_of] = ctx[rows]
            dev = self.device
            out.append(
                DecodeGroups(*(torch.from_numpy(a).to(dev) for a in (row_index, valid, tables, mask, lens)))
            )
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda" and self.cfg.debug_checks:
            torch.cuda.synchronize(self.device)
