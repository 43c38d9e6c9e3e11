"""LoRA adapters in PEFT's format, applied per row over a mixed batch.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``) with ``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] per target module; a module's output gains
``scaling * B @ A @ x``, ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA; per-module alphas
from ``alpha_pattern``), as in PEFT.

The model fuses q/k/v and gate/up into one projection each (``decoder.py``), so an adapter is kept
per fused module: its A matrices stacked ([sum of ranks, in]) and its B matrices block-diagonal
([out, sum of ranks], the scaling folded in), one shrink and one expand GEMM per adapter and module.

``LoRAManager`` reads each adapter from disk once (``add``: parsed and checked against the model's
shapes before anything runs) and keeps at most ``max_loras`` of them resident in the model's device
and dtype, evicting the least recently used one that the current step does not need (the
scheduler never runs more than ``max_loras`` adapters in one step). Each step the runner orders the
batch so that the rows of one adapter are contiguous (``LoRABatch.segments``). On the CPU each
segment runs its two GEMMs on the project's linear layers (``linear.py``); with the Triton
attention backend every adapter's segments run in one shrink and one expand kernel per module over
slot-stacked weights (``batchgen_kernels.lora``, punica's SGMV).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from batchgen.model.hub import local_dir
from batchgen.model.linear import Linear
from batchgen.params import LoRARequest


class DecoderModel(Protocol):
    """What adapters read of ``decoder.DecoderModel`` (which imports this module)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_layers: int
    layers: list
    family: Any
    gate_up_fused: bool
    device: torch.device
    dtype: torch.dtype

# PEFT's module name -> (the model's fused module, the part of it; None: the whole module)
PARTS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "qkv_proj": ("qkv", None),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None),
    "down_proj": ("down", None),
}
MODULES = ("qkv", "o", "gate_up", "down")
_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class ModuleShape:
    """A fused module of one layer: its input width and the output widths of its parts."""

    in_features: int
    parts: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.parts)


def model_shapes(model: DecoderModel) -> dict[tuple[int, str], ModuleShape]:
    """Every (layer, module) an adapter may target; MoE layers have no MLP entries."""
    h, kvh, d, hidden = model.num_heads, model.num_kv_heads, model.head_dim, model.hidden_size
    shapes = {}
    for i, lw in enumerate(model.layers):
        shapes[(i, "qkv")] = ModuleShape(hidden, (h * d, kvh * d, kvh * d))
        shapes[(i, "o")] = ModuleShape(h * d, (hidden,))
        expert = getattr(lw.mlp, "func", None)  # a dense MLP is partial(Expert, unit=...)
        if expert is not None and hasattr(expert, "gate_up"):
            inter = expert.gate_up.out_features // 2
            shapes[(i, "gate_up")] = ModuleShape(hidden, (inter, inter))
            shapes[(i, "down")] = ModuleShape(inter, (hidden,))
    return shapes


def module_names(model: DecoderModel) -> set[str]:
    """PEFT's names of the modules this model has (Phi-3 fuses q/k/v and gate/up in the checkpoint)."""
    names = {"o_proj", "down_proj"}
    names |= {"qkv_proj"} if model.family.qkv_fused else {"q_proj", "k_proj", "v_proj"}
    names |= {"gate_up_proj"} if model.gate_up_fused else {"gate_proj", "up_proj"}
    return names


def _pattern(patterns: dict, name: str) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: a key matches a module name exactly or as
    its dotted suffix (a regular expression)."""
    for key, value in patterns.items():
        if key == name or re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


@dataclass
class Adapter:
    """An adapter read from disk, in float32 on the host: per (layer, module), A stacked and B
    block-diagonal with the scaling folded in."""

    request: LoRARequest
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    max_rank: int
    files: tuple[str, ...]  # what the adapter was read from (a job's fingerprint hashes them)


def read_adapter(request: LoRARequest, model: DecoderModel, max_lora_rank: int) -> Adapter:
    """Read and check an adapter directory against the model; ``ValueError`` names what is wrong."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    path = Path(request.lora_path)
    if not path.is_dir():  # a hub id: its cached (or downloaded) snapshot
        path = Path(local_dir(request.lora_path, None, f"LoRA adapter {request.lora_name!r}"))
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA (use_dora=true) is not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported (full module copies)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported (adapters with trained biases)")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out=true (Conv1D layers) is not supported")
    targets = cfg.get("target_modules")
    have = module_names(model)
    if isinstance(targets, list):
        for t in targets:
            if t in ("embed_tokens", "lm_head"):
                raise ValueError(f"{where}: target module {t!r}: embedding and LM-head adapters are not supported")
            if t not in have and t not in PARTS:
                raise ValueError(
                    f"{where}: target module {t!r} is not a module of this model (it has {', '.join(sorted(have))})"
                )
    tensors = _load_tensors(path, where)
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    alpha_pattern = cfg.get("alpha_pattern") or {}
    shapes = model_shapes(model)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
            raise ValueError(f"{where}: {name}: embedding and LM-head adapters are not supported")
        if "lora_magnitude" in name:
            raise ValueError(f"{where}: {name}: DoRA is not supported")
        if any(k in name for k in ("experts", "block_sparse_moe", "shared_expert")):
            raise ValueError(f"{where}: {name}: adapters on MoE experts are not supported")
        m = _TENSOR.search(name)
        if m is None or m.group(3) not in have:
            raise ValueError(f"{where}: tensor {name!r} targets a module this model does not have")
        layer, sub = int(m.group(1)), m.group(3)
        module, _ = PARTS[sub]
        if layer >= model.num_layers:
            raise ValueError(f"{where}: tensor {name!r}: the model has {model.num_layers} layers")
        if (layer, module) not in shapes:
            raise ValueError(f"{where}: tensor {name!r}: layer {layer}'s MLP is a mixture of experts; "
                             "adapters on MoE experts are not supported")
        pairs.setdefault((layer, sub), {})[m.group(4)] = tensor.float()
    if not pairs:
        raise ValueError(f"{where}: adapter_model holds no LoRA weights")
    parts: dict[tuple[int, str], list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    max_rank = 0
    for (layer, sub), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: layer {layer} {sub} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        module, part = PARTS[sub]
        shape = shapes[(layer, module)]
        out = shape.out_features if part is None else shape.parts[part]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape != (out, r):
            raise ValueError(
                f"{where}: layer {layer} {sub}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"this model's [{out}, {shape.in_features}] projection (an adapter of another base model?)"
            )
        if r > max_lora_rank:
            raise ValueError(f"{where}: layer {layer} {sub} has rank {r}, above max_lora_rank={max_lora_rank}")
        full = f"model.layers.{layer}.{_kind(sub)}.{sub}"
        a_ = _pattern(alpha_pattern, full)
        module_alpha = float(a_) if a_ is not None else alpha
        scaling = module_alpha / (math.sqrt(r) if rslora else r)
        max_rank = max(max_rank, r)
        parts.setdefault((layer, module), []).append((part, a, b * scaling))
    weights = {key: _fuse(shapes[key], entries) for key, entries in parts.items()}
    files = tuple(str(p) for p in sorted(path.iterdir()) if p.is_file())
    return Adapter(request, weights, max_rank, files)


def _kind(sub: str) -> str:
    return "self_attn" if PARTS[sub][0] in ("qkv", "o") else "mlp"


def _load_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    st, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file  # noqa: PLC0415

            return load_file(str(st))
        if binary.is_file():
            return torch.load(str(binary), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file names itself
        raise ValueError(f"{where}: cannot read {st.name if st.is_file() else binary.name}: {e}") from None
    raise ValueError(f"{where}: no adapter_model.safetensors or adapter_model.bin")


def _fuse(shape: ModuleShape, entries: list[tuple[int | None, torch.Tensor, torch.Tensor]]):
    """A stacked [R, in] and B block-diagonal [out, R] over the parts an adapter targets."""
    a = torch.cat([e[1] for e in entries])
    b = torch.zeros(shape.out_features, a.shape[0])
    offsets = np.cumsum((0,) + shape.parts)
    col = 0
    for part, _, bp in entries:
        r = bp.shape[1]
        row = 0 if part is None else int(offsets[part])
        b[row : row + bp.shape[0], col : col + r] = bp
        col += r
    return a.contiguous(), b.contiguous()


class _Resident:
    """An adapter in the model's device and dtype: per (layer, module) its shrink and expand."""

    def __init__(self, adapter: Adapter, device, dtype, backends, slot: int) -> None:
        self.adapter, self.slot = adapter, slot
        self.mats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.linears: dict[tuple[int, str], tuple[Linear, Linear]] = {}
        for key, (a, b) in adapter.weights.items():
            a_, b_ = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
            self.mats[key] = (a_, b_)
            if backends is not None:
                self.linears[key] = (Linear(a_, backends=backends), Linear(b_, backends=backends))


class LoRABatch:
    """One step's adapters: ``segments`` are (start, end, resident) runs of rows of one adapter in
    the flattened batch. ``apply`` adds each segment's LoRA output to a module's output."""

    def __init__(self, segments: list[tuple[int, int, _Resident]], stacks: _Stacks | None, device) -> None:
        self.segments = segments
        self.stacks = stacks
        if stacks is not None:
            self.seg = torch.tensor(
                [[s, e - s, r.slot] for s, e, r in segments], dtype=torch.int32, device=device
            ).T.contiguous()  # [3, segments]: start, length, slot
            self.max_len = max(e - s for s, e, _ in segments)

    def has(self, layer: int, module: str) -> bool:
        return any((layer, module) in r.mats for _, _, r in self.segments)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the module's output for input ``x``) plus each row's adapter's LoRA output."""
        if self.stacks is not None:
            stacked = self.stacks.get(layer, module)
            if stacked is not None:
                from batchgen_kernels.lora import lora_expand, lora_shrink  # noqa: PLC0415

                a, b = stacked
                t = lora_shrink(x, a, self.seg, self.max_len)
                lora_expand(t, b, y, self.seg, self.max_len)
            return y
        for start, end, res in self.segments:
            lin = res.linears.get((layer, module))
            if lin is not None:
                shrink, expand = lin
                y[start:end] += expand(shrink(x[start:end]))
        return y


    def layer(self, layer: int) -> LayerLoRA:
        return LayerLoRA(self, layer)


class LayerLoRA(NamedTuple):
    """A ``LoRABatch`` seen from one layer (the MLP's projections)."""

    batch: LoRABatch
    layer: int

    def has(self, module: str) -> bool:
        return self.batch.has(self.layer, module)

    def apply(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.batch.apply(self.layer, module, x, y)


class _Stacks:
    """Slot-stacked weights for the Triton kernels: per (layer, module) A [slots, R, in] and
    B [slots, out, R] with R = ``max_lora_rank`` x the module's parts, zero where unused."""

    def __init__(self, shapes: dict[tuple[int, str], ModuleShape], slots: int, max_rank: int, device, dtype) -> None:
        self.shapes, self.slots, self.max_rank = shapes, slots, max_rank
        self.device, self.dtype = device, dtype
        self.bufs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.used: dict[tuple[int, str], set[int]] = {}

    def get(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.bufs.get((layer, module)) if self.used.get((layer, module)) else None

    def load(self, slot: int, res: _Resident) -> None:
        for key in list(self.used):
            self.used[key].discard(slot)
            if key in self.bufs:
                self.bufs[key][0][slot].zero_()
                self.bufs[key][1][slot].zero_()
        for key, (a, b) in res.mats.items():
            if key not in self.bufs:
                shape = self.shapes[key]
                rank = self.max_rank * len(shape.parts)
                self.bufs[key] = (
                    torch.zeros(self.slots, rank, shape.in_features, device=self.device, dtype=self.dtype),
                    torch.zeros(self.slots, shape.out_features, rank, device=self.device, dtype=self.dtype),
                )
            abuf, bbuf = self.bufs[key]
            abuf[slot, : a.shape[0]] = a
            bbuf[slot, :, : b.shape[1]] = b
            self.used.setdefault(key, set()).add(slot)


class LoRAManager:
    """The adapters of one engine: read once (``add``), at most ``max_loras`` resident (LRU)."""

    def __init__(self, model: DecoderModel, max_loras: int, max_lora_rank: int, backends, triton: bool) -> None:
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.backends = None if triton else backends
        self.host: dict[int, Adapter] = {}
        self.resident: OrderedDict[int, _Resident] = OrderedDict()
        self.stacks = (
            _Stacks(model_shapes(model), max_loras, max_lora_rank, model.device, model.dtype) if triton else None
        )
        self.disk_loads = 0
        self.activations = 0
        self.evictions = 0

    def add(self, request: LoRARequest) -> Adapter:
        """Read ``request``'s adapter (once per id) and check it against the model."""
        known = self.host.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_path, known.request.lora_name) != (request.lora_path, request.lora_name):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.request.lora_name!r} "
                    f"({known.request.lora_path}); give {request.lora_name!r} ({request.lora_path}) another id"
                )
            return known
        adapter = read_adapter(request, self.model, self.max_lora_rank)
        self.host[request.lora_int_id] = adapter
        self.disk_loads += 1
        return adapter

    def batch(self, token_adapters: np.ndarray) -> LoRABatch | None:
        """The step's ``LoRABatch`` from each row's adapter id (0: the base model), rows of one
        adapter contiguous; the adapters become resident first."""
        if not token_adapters.any():
            return None
        change = np.flatnonzero(np.diff(token_adapters)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [len(token_adapters)]))
        needed = {int(i) for i in np.unique(token_adapters) if i}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, max_loras={self.max_loras}")
        segments = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            adapter_id = int(token_adapters[s])
            if adapter_id:
                segments.append((s, e, self._resident(adapter_id, needed)))
        return LoRABatch(segments, self.stacks, self.model.device)

    def _resident(self, adapter_id: int, needed: set[int]) -> _Resident:
        res = self.resident.get(adapter_id)
        if res is not None:
            self.resident.move_to_end(adapter_id)
            return res
        slot = len(self.resident)
        if slot >= self.max_loras:
            victim = next(i for i in self.resident if i not in needed)
            slot = self.resident.pop(victim).slot
            self.evictions += 1
        res = _Resident(self.host[adapter_id], self.model.device, self.model.dtype, self.backends, slot)
        if self.stacks is not None:
            self.stacks.load(slot, res)
        self.resident[adapter_id] = res
        self.activations += 1
        return res
