"""The Triton attention backend: KV write and paged attention over the whole mixed batch, each in
one launch per layer. Used on CUDA by default (``attention_backend="auto"``); on a CPU machine it
runs under ``TRITON_INTERPRET=1``, which is how its parity with the torch backend is tested."""

from __future__ import annotations

from batchgen_kernels.kv_write import write_kv
from batchgen_kernels.paged_attention import paged_attention


class TritonAttention:
    decode_rows = False  # the per-token layout carries the decode rows

    def __init__(self) -> None:
        self.seconds = 0.0  # not measured: device work is asynchronous

    def forward(self, q, k, v, k_cache, v_cache, meta, layer):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.token_rows,
            meta.token_ctx,
            layer.scale,
            max_context=meta.max_context,
            window=layer.window,
            softcap=layer.softcap,
            sinks=layer.sinks,
        )
