"""Linear layers with weights packed once at load time.

On the CPU, float32 and bfloat16 weights are reordered into oneDNN's blocked GEMM layout and
multiplied with ``torch.ops.mkldnn._linear_pointwise``, as vLLM's CPU backend does with its oneDNN
GEMMs. ``F.linear`` goes through MKL's ``sgemm``, which on some CPUs (AMD EPYC among them) takes a
code path that ran the bench model's shapes at about a third of oneDNN's rate (``scripts/bench.py``
measures both). Each packed layer is checked against ``F.linear`` when it is built; if oneDNN is missing, or
the check fails, the layer keeps the plain weight and ``F.linear``. On other devices nothing is packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The packed layout is tuned for a batch size; any batch size runs with it.
_PACK_HINT_ROWS = 128
# oneDNN compiles and caches a kernel per GEMM shape (about 1 MB each), so the row counts it sees
# are kept to a fixed set: a call is cut into pieces of at most 256 rows, and a piece's rows are
# padded up to the next size of this list (at most 7 rows more up to 64, at most 25% more above).
_ROW_SIZES = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_MAX_ROWS = _ROW_SIZES[-1]
_PAD_TO = [next(s for s in _ROW_SIZES if s >= m) for m in range(_MAX_ROWS + 1)]


def packing_wanted(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to pack, for the ``linear_backend`` setting ("auto", "onednn", "torch")."""
    if backend == "torch":
        return False
    possible = (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )
    if backend == "onednn" and not possible:
        raise ValueError(
            f"linear_backend='onednn' needs a CPU device, float32 or bfloat16 weights and a torch "
            f"built with oneDNN (device {device}, dtype {dtype}, oneDNN "
            f"{torch.backends.mkldnn.is_available()})"
        )
    return possible


class Linear:
    """``y = x @ weight.T + bias`` with ``weight`` [out, in]; ``weight`` stays readable (tied
    embeddings read it too)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False, strict: bool = False
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if pack:
            self.packed = _pack(weight, bias)
            if self.packed is None and strict:
                raise ValueError(f"linear_backend='onednn': oneDNN cannot run a {tuple(weight.shape)} layer")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        m = x.shape[0]
        pieces = [self._gemm(x[i : i + _MAX_ROWS]) for i in range(0, m, _MAX_ROWS)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.view(*lead, out.shape[-1])

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = _PAD_TO[m] - m
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:m] if pad else y


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    scale = want.abs().max().clamp(min=1.0)
    if got.shape != want.shape or not bool(((got - want).abs().max() / scale) < tol):
        return None
    return packed
