"""Linear layers on the compiled CPU kernel (``cpu_gemm.cpp``): weights packed once into 16-column
vectors, then ``y = x @ W^T + bias`` in one register-blocked loop, faster than oneDNN's packed
GEMM at the row counts of decode steps and of mixture-of-experts layers (``batchgen.model.linear``
uses it on the CPU where it builds; oneDNN and ``F.linear`` remain the fallbacks)."""

from __future__ import annotations

import torch

from kernels.cpu import available, load
from kernels.cpu_ops import DTYPE_SUFFIX


class PackedWeight:
    """``weight`` [n, k] packed for the kernel, with the bias in float32; calling it on ``x``
    [m, k] (rows may be strided) gives ``x @ weight.T + bias``, [m, n] in the weight's dtype."""

    def __init__(self, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype):
        self.packed, self.n, self.k, self.bias, self.dtype = packed, n, k, bias, dtype
        self._gemm = getattr(load(), "gemm_" + DTYPE_SUFFIX[dtype])
        self._bias_ptr = 0 if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.k and x.dtype == self.dtype, (x.shape, self.k, x.dtype)
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, self.n), dtype=self.dtype)
        if m == 0:
            return out
        rc = self._gemm(
            x.data_ptr(),
            x.stride(0),
            m,
            self.k,
            self.packed.data_ptr(),
            self.n,
            self._bias_ptr,
            out.data_ptr(),
            self.n,
            torch.get_num_threads(),
        )
        assert rc == 0, "the packed weight's kernel is missing"  # pack() checked it
        return out


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The packed weight, or None where the kernel does not run it (no compiled library, a CPU
    without AVX-512 or, for bfloat16, AVX-512 BF16; another dtype or device; an odd ``k`` in bf16)."""
    dtype = weight.dtype
    if weight.dim() != 2 or dtype not in DTYPE_SUFFIX or weight.device.type != "cpu" or not available():
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
        rc = load().gemm_pack_bf16(w.data_ptr(), n, k, packed.data_ptr())  # 1 for an odd k
    if rc:
        return None
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    return PackedWeight(packed, n, k, b, dtype)
