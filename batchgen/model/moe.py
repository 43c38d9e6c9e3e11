"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) over the flattened batch.

The router picks ``top_k`` experts per token. Where the compiled GEMM kernel packed every expert
(SwiGLU experts, ``gate_up`` gated), the routed experts run as one kernel call a layer
(``batchgen_kernels.cpu_gemm.PackedExperts``: the pairs sorted by expert, each expert's two GEMMs over its
rows, the weighted sum per token in float32). Otherwise tokens are grouped by expert with one stable
sort of the (token, expert) pairs, each expert runs one GEMM pair over all of its tokens, and the
weighted outputs are scattered back with one ``index_add_``: the only Python loop is over experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.model.layers import fused_cpu_ops
from batchgen.model.linear import Linear
from batchgen.model.lora import LayerLoRA
from batchgen_kernels.cpu_gemm import PackedExperts


@dataclass
class Expert:
    gate_up: Linear  # [gate; up] rows; built ``gated`` only where the unit is SiLU's
    down: Linear

    def hidden(self, x: torch.Tensor, unit: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``unit(gate_up(x))``, the MLP's hidden activation: in the GEMM's own pass where the
        kernel packed ``gate_up`` gated."""
        fused = self.gate_up.silu_mul(x)
        return unit(self.gate_up(x)) if fused is None else fused

    def __call__(
        self, x: torch.Tensor, unit: Callable[[torch.Tensor], torch.Tensor], lora: LayerLoRA | None = None
    ) -> torch.Tensor:
        """``down(unit(gate_up(x)))``; ``lora``: the rows' adapters of this layer (a dense MLP), added
        to each projection's output."""
        if lora is None:
            return self.down(self.hidden(x, unit))
        hidden = unit(lora.apply("gate_up", x, self.gate_up(x))) if lora.has("gate_up") else self.hidden(x, unit)
        return lora.apply("down", hidden, self.down(hidden))


def softmax_then_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: softmax over all experts in float32, the top ``k``, optionally
    renormalized to sum to one."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def topk_then_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the top ``k`` logits, softmax over those."""
    values, experts = torch.topk(logits, k, dim=-1)
    return torch.softmax(values, dim=1), experts


def swiglu(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if act is F.silu and gate_up.dim() == 2 and (ops := fused_cpu_ops(gate_up, kernel="silu_mul")) is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated unit: gate clamped above, up clamped both ways, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoE:
    """``router(x)`` gives logits [T, E]; ``route(logits)`` the weights and experts [T, k];
    ``unit(gate_up)`` the gated activation of an expert. A shared expert (Qwen2-MoE) is added
    to every token, scaled by ``sigmoid(shared_gate(x))``. ``seconds`` sums the time spent in the
    experts' GEMMs and activations (host time: exact on the CPU; with the grouped call, also its
    gather of the rows and its weighted sum)."""

    def __init__(
        self,
        router: Linear,
        route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        experts: list[Expert],
        unit: Callable[[torch.Tensor], torch.Tensor],
        shared: Expert | None = None,
        shared_gate: Linear | None = None,
    ) -> None:
        self.router, self.route, self.experts, self.unit = router, route, experts, unit
        self.shared, self.shared_gate = shared, shared_gate
        self.seconds = 0.0
        # one kernel call for all routed experts where the kernel packed them all (gated: SiLU's unit)
        self.grouped = PackedExperts.of([e.gate_up.kernel for e in experts], [e.down.kernel for e in experts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(self.router(x))
        out = self._grouped(x, weights, chosen) if self.grouped is not None else self._each(x, weights, chosen)
        if self.shared is not None and self.shared_gate is not None:
            shared = self.shared(x, self.unit)
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        assert self.grouped is not None
        t0 = time.perf_counter()
        out = self.grouped(x, weights, chosen)
        self.seconds += time.perf_counter() - t0
        return out

    def _each(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token = order // k
        t0 = time.perf_counter()
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = slice(start, start + count)
                ys[rows] = expert(xs[rows], self.unit)
                start += count
        self.seconds += time.perf_counter() - t0
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


def dense_unit(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda gate_up: swiglu(gate_up, act)

