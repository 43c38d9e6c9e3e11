"""Host staging of a step's inputs, and decode steps replayed through CUDA graphs.

``HostStaging`` packs a step's integer inputs (token ids, positions, slots, block tables, ...) into
one host buffer, pinned on CUDA, and moves them with a single asynchronous copy. Every step ends with
a device-to-host read of the sampled tokens, so a buffer is never rewritten while its copy is in
flight. On the CPU the arrays are used in place.

``DecodeGraphs`` serves decode-only steps (one new token per sequence, the common step of a long
generation): the forward pass and LM head are captured once per bucketed batch size over static
input buffers, and a step copies its inputs into those buffers (padding rows: slot -1, which the KV
write skips; context 1 over the runner's null block, which is kept zeroed) and replays the graph of the smallest
bucket that holds it. Launch overhead disappears, which is what dominates small decode batches on
a GPU. It needs the per-token batch layout of the Triton backend. With ``capture=False`` the same
static-buffer path runs eagerly: that is how its padding and bucketing are tested on a CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.model.attention import AttentionMetadata
from batchgen.utils import cdiv


class HostStaging:
    """Integer arrays to device tensors, through one (pinned, on CUDA) host buffer per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=device)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if not self.pinned:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        total = sum(a.size for a in arrays)
        if self._host.numel() < total:
            size = max(total, 2 * self._host.numel(), 1 << 16)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
        flat = self._host.numpy()
        offset = 0
        for a in arrays:
            flat[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        out, offset = [], 0
        for a in arrays:
            out.append(self._dev[offset : offset + a.size].view(a.shape))
            offset += a.size
        return out


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, capture: bool = True) -> None:
        self.runner = runner
        self.model = runner.model
        self.buckets = default_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.width = cdiv(runner.max_model_len, runner.block_size)  # block table columns
        self.capture = capture
        dev = runner.device
        b, w = self.max_batch, self.width
        # [ids | positions | slots | contexts | block tables]: one host buffer, one transfer
        self._sizes = (b, b, b, b, b * w)
        self._host = torch.zeros(sum(self._sizes), dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._flat = torch.zeros(sum(self._sizes), dtype=torch.int64, device=dev)
        parts = torch.split(self._flat, list(self._sizes))
        self.input_ids, self.positions, self.slots, self.context = parts[:4]
        self.block_tables = parts[4].view(b, w)
        self.token_rows = torch.arange(b, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        if capture:
            self._capture_all()

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode=b,
            block_tables=self.block_tables[:b],
            token_rows=self.token_rows[:b],
            token_ctx=self.context[:b],
            max_context=self.runner.max_model_len,  # fixed: the graph's split count cannot change
        )

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        hidden = self.model.forward(
            self.input_ids[:b], self.positions[:b], r.kv_cache, self._meta(b), r.backend
        )
        return self.model.logits(hidden)

    def _capture_all(self) -> None:
        self._stage(0, np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, 1)), np.zeros(0))
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        for b in reversed(self.buckets):  # largest first: the others reuse its memory pool
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels and settle allocations outside the capture
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.runner.device)

    def _stage(
        self,
        n: int,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        context: np.ndarray,
    ) -> None:
        b, w = self.max_batch, self.width
        host = self._host.numpy()
        o = np.cumsum((0,) + self._sizes)
        host[o[0] : o[0] + n] = ids
        host[o[0] + n : o[1]] = 0
        host[o[1] : o[1] + n] = positions
        host[o[1] + n : o[2]] = 0
        host[o[2] : o[2] + n] = slots
        host[o[2] + n : o[3]] = -1  # padding rows write nothing
        host[o[3] : o[3] + n] = context
        host[o[3] + n : o[4]] = 1  # and attend to one zero slot of the null block
        bt = host[o[4] :].reshape(b, w)
        bt[:] = self.runner.null_block
        bt[:n, : tables.shape[1]] = tables
        self._flat.copy_(self._host, non_blocking=True)

    def run(
        self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray
    ) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode-only step of n sequences, or None if n has no bucket."""
        n = len(ids)
        b = self.bucket_for(n)
        if b is None or tables.shape[1] > self.width:
            return None
        self._stage(n, ids, positions, slots, tables, positions + 1)
        self.replays += 1
        if not self.capture:
            with torch.inference_mode():
                return self._forward(b)[:n]
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
