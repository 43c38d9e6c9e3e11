"""Building blocks of the supported families, written to match transformers' float32 arithmetic."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

# The compiled CPU kernels for the elementwise steps below (kernels/batchgen_kernels/cpu_ops.py), where they build;
# the torch code here is their reference and fallback. False: the torch code everywhere (and no
# SwiGLU in the GEMM kernel's pass: models loaded then pack their gate_up layers plain).
FUSED_CPU_OPS = True


def fused_cpu_ops(*tensors: torch.Tensor, kernel: str) -> ModuleType | None:
    """``batchgen_kernels.cpu_ops`` where its compiled ``kernel`` takes these tensors (and is switched on)."""
    if not FUSED_CPU_OPS or not tensors[0].is_cpu:
        return None
    ops, library_kernels = _cpu_ops()
    if kernel in library_kernels():
        return None
    return ops if ops.takes(*tensors) else None


@functools.cache  # imported on first use: the kernels package builds its library then
def _cpu_ops() -> tuple[ModuleType, Callable[[], frozenset[str]]]:
    from batchgen_kernels import cpu_ops  # noqa: PLC0415
    from batchgen_kernels.cpu import library_kernels  # noqa: PLC0415

    return cpu_ops, library_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm scaled by ``offset + weight`` (Gemma stores ``weight`` around 0 and scales by
    ``1 + weight``, in float32 before casting back)."""
    dtype = x.dtype
    if not offset and (ops := fused_cpu_ops(x, weight, kernel="rms_norm")) is not None:
        return ops.rms_norm(x, weight, eps)
    if offset:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return (y * (offset + weight.float())).to(dtype)
    if dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: the same arithmetic as transformers' in float32, one op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: the residual stream's addition and the norm after
    it, in one pass on the compiled kernel where it runs; without a weight, the sum twice."""
    if weight is None:
        total = residual + x
        return total, total
    if not offset and (ops := fused_cpu_ops(x, residual, weight, kernel="rms_norm")) is not None:
        return ops.add_rms_norm(x, residual, weight, eps)
    total = residual + x
    return rms_norm(total, weight, eps, offset), total


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE settings of the config (of one layer type where they differ per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        return dict(params[layer_type])
    params = dict(params or {})
    if not params:  # transformers < 5 keeps rope_theta / rope_scaling on the config
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(
    config, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the config's RoPE type (transformers' own code)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' is not supported (its frequencies change with the sequence length)"
        )
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
        )
    kwargs: dict = {"seq_len": seq_len}
    if layer_type is not None and layer_type in (getattr(config, "rope_parameters", None) or {}):
        kwargs["layer_type"] = layer_type
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


def _table(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class Rotary:
    """cos / sin tables for every position up to ``max_positions``, indexed by position ids.

    LongRoPE (Phi-3 long-context models) has two sets of frequencies: a sequence longer than
    ``original_max_position_embeddings`` uses the long one at every position, a shorter one the
    short one (transformers' ``generate`` recomputes its cache when a sequence crosses that
    length; the scheduler does the same). ``rope_lengths`` gives each token its sequence's
    length. Only the first ``dim`` channels of a head rotate (partial rotary)."""

    def __init__(
        self,
        config,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        layer_type: str | None = None,
    ) -> None:
        params = rope_parameters(config, layer_type)
        self.long_after: int | None = None
        inv_freq, scaling = rope_inv_freq(config, layer_type)
        cos, sin = _table(inv_freq, scaling, max_positions)
        if params.get("rope_type", params.get("type")) == "longrope":
            self.long_after = int(params["original_max_position_embeddings"])
            long_freq, long_scaling = rope_inv_freq(config, layer_type, seq_len=self.long_after + 1)
            lcos, lsin = _table(long_freq, long_scaling, max_positions)
            cos, sin = torch.cat([cos, lcos]), torch.cat([sin, lsin])
        self.max_positions = max_positions
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)

    def __call__(
        self, positions: torch.Tensor, rope_lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.long_after is not None:
            lengths = positions + 1 if rope_lengths is None else rope_lengths
            positions = positions + (lengths > self.long_after).long() * self.max_positions
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, rotary_dim] (rotary_dim <= head_dim: the
    remaining channels pass through)."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    if dim % 2 == 0 and x.stride(-1) == 1 and (ops := fused_cpu_ops(x, cos, sin, kernel="rotary")) is not None:
        return ops.rotary(x, cos, sin)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": F.gelu,
}
