"""Linear layers on the compiled CPU kernel (``cpu_gemm.cpp``): weights packed once into 16-column
vectors, then ``y = x @ W^T + bias`` in one register-blocked loop, faster than oneDNN's packed
GEMM at the row counts of decode steps and of mixture-of-experts layers (``batchgen.model.linear``
uses it on the CPU where it builds; oneDNN and ``F.linear`` remain the fallbacks)."""

from __future__ import annotations

import torch

from kernels.cpu import available, load

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class PackedWeight:
    """``weight`` [n, k] packed for ``gemm``, with the bias in float32."""

    def __init__(self, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype):
        self.packed, self.n, self.k, self.bias, self.dtype = packed, n, k, bias, dtype


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
    without AVX-512 or, for bfloat16, AVX-512 BF16; another dtype or device; an odd ``k`` in bf16)."""
    dtype = weight.dtype
    if weight.dim() != 2 or dtype not in _SUFFIX or weight.device.type != "cpu" or not available():
        return None
    n, k = weight.shape
    if k == 0 or n == 0:
        return None
    vectors = (n + 15) // 16
    w = weight.contiguous()
    if dtype == torch.float32:
        packed = torch.empty(vectors * k * 16, dtype=torch.float32)
        rc = load().gemm_pack_f32(w.data_ptr(), n, k, packed.data_ptr())
    else:
        packed = torch.empty(vectors * (k // 2) * 16, dtype=torch.int32)
        rc = 1 if k % 2 else load().gemm_pack_bf16(w.data_ptr(), n, k, packed.data_ptr())
    if rc:
        return None
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    return PackedWeight(packed, n, k, b, dtype)


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``x`` [m, k] (rows may be strided) times the packed weight: [m, n] in the weight's dtype."""
    assert x.dim() == 2 and x.shape[1] == w.k and x.dtype == w.dtype, (tuple(x.shape), w.k, x.dtype, w.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, w.n), dtype=w.dtype)
    if m == 0:
        return out
    fn = getattr(load(), "gemm_" + _SUFFIX[w.dtype])
    rc = fn(
        x.data_ptr(),
        x.stride(0),
        m,
        w.k,
        w.packed.data_ptr(),
        w.n,
        0 if w.bias is None else w.bias.data_ptr(),
        out.data_ptr(),
        w.n,
        torch.get_num_threads(),
    )
    assert rc == 0, "the packed weight's kernel is missing"  # pack() checked it
    return out
