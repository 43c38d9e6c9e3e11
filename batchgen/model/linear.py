"""Linear layers with weights packed once at load time.

On the CPU, float32 and bfloat16 weights are packed for the compiled GEMM kernel
(``kernels/batchgen_kernels/cpu_gemm.cpp``: 16-column vectors, a 6-row x 64-column register block; 3 rows x 32
columns on AVX2), which runs the row counts of inference (1-256 rows per call) at 340-450 GFLOP/s
in bf16 and 185-225 in float32 on 2 cores, where oneDNN's packed GEMM reaches 100-330 and 80-180
below 64 rows. bfloat16 on a CPU with AMX (Intel Sapphire Rapids and later) runs in the same
kernel on AMX tiles (the packed layout is already the tiles' operand): at the 64 rows of a decode
step, weights from memory, 1,000-1,200 GFLOP/s on bench-56m's projections against oneDNN's AMX
GEMM's 750-990 (``scripts/gemm_rates.py --dtype bfloat16 --rows 64 --cold``), and 1.06-1.17x
whole bf16 workloads (1.5x M, whose grouped experts run in one call); oneDNN stays ahead on
prefill chunks of thousands of rows (about 2,500 against 3,200 at 2,048 rows), and so does
``F.linear`` (MKL's AMX GEMM), which such a layer runs from ``_TORCH_FROM_ROWS`` rows. A bf16 layer whose
input width is not a multiple of 32 goes to oneDNN there instead, whose AMX GEMM is several times
the kernel's dot instruction. Where the kernel is not available (no compiler, a CPU without
AVX-512 or AVX2 with FMA) weights are reordered into oneDNN's blocked layout and multiplied with
``torch.ops.mkldnn._linear_pointwise``, as vLLM's CPU backend does. ``F.linear`` goes through
MKL's ``sgemm``, which on some CPUs (AMD EPYC among them) takes a code path that ran the bench
model's shapes at about a third of oneDNN's rate (``scripts/bench.py`` measures all three). Each
packed layer is checked against ``F.linear`` when it is built; if the check fails, the layer
takes the next backend. On other devices nothing is packed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchgen import utils

if TYPE_CHECKING:
    from batchgen_kernels.cpu_gemm import PackedWeight

# The packed layout is tuned for a batch size; any batch size runs with it.
_PACK_HINT_ROWS = 128
# oneDNN compiles and caches a kernel per GEMM shape (about 1 MB each), so the row counts it sees
# are kept to a fixed set: a call is cut into pieces of at most 2,048 rows, and a piece's rows are
# padded up to the next size of this list (at most 7 rows more up to 64, at most 25% more above).
# Prefill chunks take the sizes above 256: one large call is faster than several small pieces and
# their concatenation (docs/kernels.md, "Thresholds").
_ROW_SIZES: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_ROW_SIZES += (320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
_MAX_ROWS = _ROW_SIZES[-1]
_PAD_TO = [next(s for s in _ROW_SIZES if s >= m) for m in range(_MAX_ROWS + 1)]
# From this many rows (prefill chunks) a bf16 layer on the kernel's AMX tiles runs through
# ``F.linear`` instead (MKL's AMX GEMM on the layer's own weight, no second copy), which is faster
# there; below about 1,024 rows the tiles are as fast or faster (docs/kernels.md, "Thresholds").
# A gated layer's fused ``silu_mul`` stays on the tiles (it saves the SwiGLU's pass).
_TORCH_FROM_ROWS = 1536


BACKENDS = ("auto", "cpu", "onednn", "torch")


def backends_for(setting: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends a layer tries in order, for the ``linear_backend`` setting: "auto" is the
    compiled kernel, else oneDNN, else ``F.linear`` (a layer may still skip the kernel:
    ``_onednn_faster``);
    "cpu" and "onednn" are that one alone (an error where it cannot run); "torch" is ``F.linear``."""
    if setting == "torch":
        return ["torch"]
    cpu = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    onednn = cpu and torch.backends.mkldnn.is_available()
    if setting == "onednn" and not onednn:
        raise ValueError(
            f"linear_backend='onednn' needs a CPU device, float32 or bfloat16 weights and a torch "
            f"built with oneDNN (device {device}, dtype {dtype}, oneDNN "
            f"{torch.backends.mkldnn.is_available()})"
        )
    if setting == "cpu":
        from batchgen_kernels.cpu import available  # noqa: PLC0415

        if not (cpu and available()):
            raise ValueError(
                f"linear_backend='cpu' needs a CPU device, float32 or bfloat16 weights and the compiled "
                f"CPU kernels (device {device}, dtype {dtype}, kernels built: {available()})"
            )
        return ["cpu"]
    if setting == "onednn":
        return ["onednn"]
    ok = {"cpu": cpu, "onednn": onednn}
    return [b for b in ("cpu", "onednn") if ok[b]] + ["torch"]


def _kernel_amx() -> bool:
    """Whether the compiled kernel runs bfloat16 GEMMs on AMX tiles here (``batchgen_kernels.cpu_gemm.amx``)."""
    from batchgen_kernels.cpu_gemm import amx  # noqa: PLC0415

    return amx()


def _on_tiles(weight: torch.Tensor) -> bool:
    """Whether the kernel runs this weight on AMX tiles: bfloat16, an input width of a multiple of 32."""
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and _kernel_amx()


def _onednn_faster(weight: torch.Tensor) -> bool:
    """A bfloat16 layer that the kernel would run on its dot instruction on a CPU with AMX (its
    input width not a multiple of 32): oneDNN's AMX GEMM is several times faster there."""
    return weight.dtype == torch.bfloat16 and utils.has_amx() and not _on_tiles(weight)


class Linear:
    """``y = x @ weight.T + bias`` with ``weight`` [out, in]. ``backends``: what to try in order
    (``backends_for``); ``strict``: raise if the first one cannot run this layer. ``backend`` says
    which one it runs on. ``gated``: the weight is [gate; up] of a SwiGLU MLP; the kernel then also
    gives ``silu(gate) * up`` in the GEMM's pass (``silu_mul``).

    A layer on a packed backend holds only its packed copy: ``weight`` is then None and the
    caller's tensor is freed once nothing else holds it (a tied embedding does where the LM head is
    on oneDNN; on the kernel the model looks tokens up in the packed copy). The one exception keeps
    both: a bfloat16 layer on AMX tiles, whose prefill chunks run on ``F.linear``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        backends: tuple[str, ...] | list[str] = ("torch",),
        strict: bool = False,
        gated: bool = False,
    ) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None  # oneDNN's layout
        self.kernel: PackedWeight | None = None  # the compiled kernel's
        self.backend = "torch"
        for backend in backends:
            if backend == "cpu" and not strict and "onednn" in backends and _onednn_faster(weight):
                continue
            if backend == "cpu":
                self.kernel = _pack_for_kernel(weight, bias, gated)
            elif backend == "onednn":
                self.packed = _pack(weight, bias)
            if backend == "torch" or self.kernel is not None or self.packed is not None:
                self.backend = backend
                break
            if strict:
                raise ValueError(
                    f"linear_backend={backend!r}: it cannot run a {tuple(weight.shape)} {weight.dtype} layer"
                )
        # calls of _TORCH_FROM_ROWS rows or more go to F.linear where the kernel runs on AMX tiles
        self._large_to_torch = self.kernel is not None and _on_tiles(weight)
        if self.backend != "torch" and not self._large_to_torch:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        large = self._large_to_torch and x.numel() >= _TORCH_FROM_ROWS * x.shape[-1]
        if self.kernel is not None and not large:
            return _over_rows(self.kernel, x)
        if self.packed is not None:
            lead = x.shape[:-1]
            x = x.reshape(-1, x.shape[-1])
            m = x.shape[0]
            pieces = [self._gemm(x[i : i + _MAX_ROWS]) for i in range(0, m, _MAX_ROWS)]
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return out.view(*lead, out.shape[-1])
        assert self.weight is not None  # kept on the torch backend and for AMX tiles' large calls
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gated layer's output in one pass where the kernel runs it
        (it packed the layer gated); None otherwise (the caller applies its activation)."""
        if self.kernel is None or not self.kernel.gated:
            return None
        return _over_rows(self.kernel.silu_mul, x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``: the output rounded to the weight's dtype, as float32 (the LM head's
        logits), in one pass where the kernel runs it."""
        if self.kernel is None:
            return self(x).float()
        return _over_rows(partial(self.kernel, widened=True), x)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = _PAD_TO[m] - m
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:m] if pad else y


def _over_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` of the kernel, which takes rows [m, k], on ``x`` [..., k] (2-D as it comes)."""
    if x.dim() == 2:
        return fn(x)
    out = fn(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


def _agrees(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    scale = want.abs().max().clamp(min=1.0)
    return got.shape == want.shape and bool(((got.float() - want.float()).abs().max() / scale) < tol)


def _probe(weight: torch.Tensor) -> torch.Tensor:
    return torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)


def _pack_for_kernel(
    weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
) -> PackedWeight | None:
    """The weight packed for the compiled kernel (gated where asked and its shape allows, else
    plain), checked on a probe; None where it does not run."""
    from batchgen_kernels import cpu_gemm  # noqa: PLC0415

    packed = (cpu_gemm.pack(weight, bias, gated=True) if gated else None) or cpu_gemm.pack(weight, bias)
    if packed is None:
        return None
    probe = _probe(weight)
    want = F.linear(probe, weight, bias)
    if not _agrees(packed(probe), want, weight.dtype):
        return None
    if packed.gated:
        gate, up = want.float().chunk(2, dim=-1)
        if not _agrees(packed.silu_mul(probe), F.silu(gate) * up, weight.dtype):
            return None
    return packed


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
        probe = _probe(weight)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed if _agrees(got, F.linear(probe, weight, bias), weight.dtype) else None
