"""The Triton attention backend: KV write and paged attention over the whole mixed batch, each in
one launch per layer. Used on CUDA by default (``attention_backend="auto"``); on a CPU machine it
runs under ``TRITON_INTERPRET=1``, which is how its parity with the torch backend is tested."""

from __future__ import annotations

from kernels.kv_write import write_kv
from kernels.paged_attention import paged_attention


class TritonAttention:
    def __init__(self) -> None:
        self.seconds = 0.0  # not measured: device work is asynchronous

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.token_rows,
            meta.token_ctx,
            scale,
            max_context=meta.max_context,
            window=sliding_window,
        )
