"""batchgen's kernels (the folder ``kernels/``, imported as ``batchgen_kernels``: the name ``kernels``
is Hugging Face's kernel hub's). Compiled C++ ones for the CPU path (``batchgen_kernels.cpu``: decode attention over the paged
cache, prefill attention, the sampler's full-vocabulary passes, the decoder layer's
elementwise steps and the KV store, beam search's candidate step, linear layers on packed
weights; built at first use, the torch
code as fallback and reference), and Triton ones for the GPU path, each with a shape-checking wrapper and a torch reference:

- ``paged_attention``: attention of a flattened mixed batch (prefill chunks and decode tokens) over
  the paged KV cache, with grouped-query attention and an optional split-KV (flash-decoding) pass;
- ``write_kv``: store each token's K/V in its slot (slots < 0 are padding and skipped);
- ``copy_blocks``: all copy-on-write pairs of a step, over every layer, in one launch;
- ``swap_blocks`` (``batchgen_kernels.swap``, plain torch): move blocks between device and (pinned) host caches.

The caches are head-major: ``[kv_heads, num_blocks, block_size, head_dim]`` per layer and K/V.
Importing this package does not import triton; the kernel modules do. On a CPU machine the kernels
run under ``TRITON_INTERPRET=1`` (slowly, on small shapes): that is how CI tests them.
"""

__version__ = "0.0.0"
