"""Quantized checkpoints, kept quantized: GPTQ, AWQ (GEMM layout) and compressed-tensors.

``QuantFormat.of(config)`` reads ``quantization_config``; ``QuantFormat.read(weights, name)`` reads one
projection's tensors in its format's layout into one canonical form, ``QWeight``: integer values
``q`` [out, in] with ``w = (q - zero) * scale`` per output row and group of ``group`` inputs (groups
in input order after ``perm``: GPTQ's ``desc_act`` reorders inputs), or FP8 values with a per-tensor
or per-row scale. ``QuantLinear`` runs it with the weights kept quantized:

- 4 bits: in bf16 on a CPU with AMX, the compiled kernel's bf16 tiles (``PackedInt4Tiles``: half
  a byte a weight, each rounded to bf16 inside the call); elsewhere torch's CPU int4 GEMM
  (``torch._weight_int4pack_mm_for_cpu``; the weights in its packed layout, half a byte each,
  groups of 32 / 64 / 128 / 256, dequantized inside the GEMM);
- 8 bits, one symmetric scale per row: the compiled GEMM kernel's int8 path
  (``batchgen_kernels.cpu_gemm.PackedBytes``: one byte a weight, widened in registers), else
  ``torch._weight_int8pack_mm`` (``BATCHGEN_LIBRARY_KERNELS=int8_gemm`` forces it);
- W8A8 (compressed-tensors ``int-quantized`` with dynamic per-token activations): on a CPU with
  AMX-INT8, the compiled kernel's int8 x int8 tile GEMM (``PackedInt8Tiles``: each row rounded to
  its int8 grid inside the call, int32 sums, both scales in the epilogue); elsewhere activations
  rounded to their per-token int8 grid inside the step, then the int8 GEMM above (``torch._int_mm``,
  the int8 x int8 GEMM, kept a weight-sized buffer per layer on the CPU: twice the memory);
- FP8 (E4M3) weights: the compiled GEMM kernel's FP8 path (``PackedBytes`` again, widened through
  float16; block-wise scales, ``PackedFP8Blocks``, multiply the widened weights per group; torch's ``_scaled_mm`` on the CPU quantizes the activations to FP8 too and ran 10x
  slower than a bf16 GEMM here); on a GPU with FP8 tensor cores, checkpoints with dynamic
  per-token FP8 activations run ``torch._scaled_mm`` (activations quantized per token, as vLLM
  runs them; ``FP8_SCALED_MM``); elsewhere FP8 is weight-only (activations in the model's dtype);
- MXFP4 (gpt-oss's experts): the compiled kernel's MXFP4 path (``PackedMXFP4``: half a byte a
  weight and a float32 scale per 32, widened in registers);
- anything else (other group sizes, 8-bit groups, a CPU without the compiled kernels, a device
  without those ops): the reference path, which keeps the weights quantized and widens them for
  each call.

``QuantLinear.path`` says which one a layer took (``LLM.stats()["quantized_paths"]``).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from batchgen.model import mxfp4
from batchgen_kernels.cpu import library_kernels
from batchgen_kernels.cpu_gemm import (
    PackedBytes,
    PackedFP8Blocks,
    PackedInt4Tiles,
    PackedInt8Tiles,
    PackedMXFP4,
)
from batchgen_kernels.cpu_ops import round_tokens_int8

# AWQ's GEMM layout stores the 8 values of an int32 in this column order (AutoAWQ's pack order)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INT4_GROUPS = (32, 64, 128, 256)
GPTQ_V1_ZERO_OFFSET = 1  # GPTQ's v1 layout stores each zero point minus one


class QuantError(ValueError):
    """A quantized checkpoint that cannot be used; the message names the field or tensor."""


@dataclass
class QWeight:
    """One projection's quantized weight in canonical form (see the module docstring)."""

    kind: str  # "int" | "fp8" | "mxfp4"
    bits: int
    # int: uint8 / int8 values [out, in] (after ``perm``); fp8: float8_e4m3fn [out, in]; mxfp4:
    # uint8 [out, in / 2], two E2M1 codes a byte (``batchgen.model.mxfp4``)
    q: torch.Tensor
    # float32 [out, groups] (fp8: [out, 1] or [1, 1]); mxfp4: uint8 [out, in / 32], biased exponents
    scale: torch.Tensor
    zero: torch.Tensor | None  # float32 [out, groups] in q's units, None = 0
    group: int  # inputs per group (the input width for one group per row)
    perm: torch.Tensor | None = None  # input channel order (x[:, perm]) that makes groups contiguous
    # "int8-token": activations quantized per token (W8A8); "fp8-token": FP8 per token, where the
    # device multiplies FP8 by FP8 (``FP8_SCALED_MM``), weight-only elsewhere
    activations: str | None = None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.kind == "mxfp4" else 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in the checkpoint's input order (float32, or ``dtype``)."""
        if self.kind == "mxfp4":
            blocks = self.q.view(self.out_features, -1, mxfp4.GROUP // 2)
            return mxfp4.dequantize(blocks, self.scale, dtype).view(self.out_features, self.in_features)
        # int and FP8 values [out, groups, group] against their scales (and zeros) per row and group
        w = self.q.float().view(self.out_features, -1, self.group)
        if self.zero is not None:
            w = w - self.zero.unsqueeze(-1)
        w = (w * self.scale.unsqueeze(-1)).view(self.out_features, self.in_features)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    @staticmethod
    def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QWeight:
        """One projection of gpt-oss's MXFP4 experts: blocks [out, in / 32, 16], scales [out, in / 32]."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3 or (
            blocks.shape[:2] != scales.shape or blocks.shape[2] != mxfp4.GROUP // 2
        ):
            raise QuantError(
                f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales {tuple(scales.shape)} "
                f"{scales.dtype} (expected uint8 [out, in / 32, 16] and [out, in / 32])"
            )
        return QWeight("mxfp4", 4, blocks.reshape(blocks.shape[0], -1).contiguous(), scales.contiguous(), None,
                       mxfp4.GROUP)

    @staticmethod
    def concat(parts: list[QWeight]) -> QWeight | None:
        """The parts stacked along the output (q/k/v, gate/up) where they share a layout; None otherwise."""
        a = parts[0]
        for p in parts[1:]:
            if (p.kind, p.bits, p.group, p.activations, p.zero is None) != (
                a.kind, a.bits, a.group, a.activations, a.zero is None
            ) or p.perm is not None or a.perm is not None or p.scale.shape[1] != a.scale.shape[1]:
                return None
        zero = None if a.zero is None else torch.cat([p.zero for p in parts])  # type: ignore[misc]
        return replace(a, q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]), zero=zero)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each along the rows (value k at bits k*bits..) -> [R*32/bits, C]."""
    per = 32 // bits
    out = torch.empty(packed.shape[0], per, packed.shape[1], dtype=torch.uint8)
    for k in range(per):  # one value position at a time: no int32 copy of the whole weight
        out[:, k] = (packed >> (bits * k)) & ((1 << bits) - 1)
    return out.view(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each along the columns -> [R, C*32/bits]; ``order``: the
    column each of an int32's values belongs to (AWQ), else in place."""
    per = 32 // bits
    out = torch.empty(packed.shape[0], packed.shape[1], per, dtype=torch.uint8)
    for k in range(per):  # value k of each int32 at bits k*bits goes to column ``order[k]``
        out[..., order[k] if order is not None else k] = (packed >> (bits * k)) & ((1 << bits) - 1)
    return out.view(packed.shape[0], packed.shape[1] * per)


def _first_error(e: ValueError) -> str:
    """pydantic's first error of a ``quantization_config``: its field, what is wrong, the value."""
    errors = getattr(e, "errors", None)
    if errors is None:
        return f"quantization_config: {e}"
    first = errors()[0]
    # the path without pydantic's validator and union steps ("function-after[...]", "list[str]")
    field = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and "[" in p))
    value = repr(first.get("input"))
    return f"quantization_config.{field}: {first['msg']} (got {value[:80] + '...' if len(value) > 80 else value})"


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantization: ``method`` gptq | awq | compressed-tensors | fp8 and its settings."""

    method: str
    bits: int = 4
    group: int = 128  # -1: one group per row
    sym: bool = True
    desc_act: bool = False
    zero_plus_one: bool = True  # GPTQ v1: stored zeros are one less than the real ones
    ct_format: str | None = None  # compressed-tensors: pack-quantized | int-quantized | float-quantized
    activations: str | None = None
    block: tuple[int, int] | None = None  # FP8 block-wise scales: [rows, inputs] per scale
    # per module: (targets, its format or None = not quantized), the first that matches decides
    # (``scheme_for``); compressed-tensors' config groups after its ignore list, GPTQModel's
    # ``dynamic`` rules before the format itself; empty: the format itself for every projection
    schemes: tuple[tuple[tuple[str, ...], QuantFormat | None], ...] = ()

    @classmethod
    def of(cls, config: Any) -> QuantFormat | None:
        """The format of a ``quantization_config`` (dict or object); None for MXFP4 (handled by the
        gpt-oss experts) or no config; ``QuantError`` for what is not supported."""
        if config is None:
            return None
        c = config if isinstance(config, dict) else config.to_dict()
        method = c.get("quant_method")
        if method in (None, "mxfp4"):
            return None
        if method == "gptq":
            return cls._gptq_config(c)
        if method == "awq":
            if c.get("bits", 4) != 4:
                raise QuantError(f"quantization_config.bits={c.get('bits')!r}: AWQ checkpoints of 4 bits are supported")
            version = str(c.get("version", "gemm")).lower()
            if version != "gemm":
                raise QuantError(f"quantization_config.version={version!r}: AWQ's GEMM layout is supported")
            if not c.get("zero_point", True):
                raise QuantError("quantization_config.zero_point=false: AWQ with zero points is supported")
            return cls("awq", 4, int(c.get("group_size", 128)), sym=False)
        if method == "compressed-tensors":
            return cls._compressed_tensors(c)
        if method == "fp8":
            return cls._fp8_config(c)
        raise QuantError(
            f"quantization {method!r} is not supported; supported: gptq, awq, compressed-tensors, fp8 "
            "and gpt-oss's mxfp4 experts"
        )

    @classmethod
    def _fp8_config(cls, c: dict) -> QuantFormat:
        """transformers' fine-grained FP8 (``FineGrainedFP8Config``, the hub's DeepSeek / Qwen FP8
        checkpoints): E4M3 weights, ``weight_scale_inv`` per block of ``weight_block_size`` [rows,
        inputs] (None: one per tensor), activations quantized dynamically where the device
        multiplies FP8 (weight-only here)."""
        scheme = str(c.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise QuantError(f"quantization_config.activation_scheme={scheme!r}: dynamic is supported")
        if c.get("expert_dtype", "fp8") != "fp8":
            raise QuantError(f"quantization_config.expert_dtype={c['expert_dtype']!r}: fp8 experts are supported")
        block = c.get("weight_block_size", (128, 128))
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantError(f"quantization_config.weight_block_size={block!r}: two positive integers expected")
        return cls("fp8", 8, block=(block[0], block[1]) if block else None)

    @classmethod
    def _gptq_config(cls, c: dict) -> QuantFormat:
        """GPTQ, with GPTQModel's per-module ``dynamic`` rules: ``"-:pattern"`` leaves the modules
        it matches unquantized, ``"+:pattern"`` (or a bare pattern) overrides ``bits``,
        ``group_size``, ``sym`` and ``desc_act`` for them; the first rule that matches decides."""
        fmt = c.get("checkpoint_format") or c.get("format") or "gptq"  # GPTQModel's newer configs: format
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantError(f"quantization_config.checkpoint_format={fmt!r}: gptq or gptq_v2 are supported")

        def one(settings: dict, where: str) -> QuantFormat:
            bits = settings.get("bits")
            if bits not in (4, 8):
                raise QuantError(f"{where}.bits={bits!r}: GPTQ checkpoints of 4 or 8 bits are supported")
            return cls("gptq", bits, int(settings.get("group_size", 128)), bool(settings.get("sym", True)),
                       bool(settings.get("desc_act", False)), zero_plus_one=fmt == "gptq")

        base = one(c, "quantization_config")
        dynamic = c.get("dynamic") or {}
        if not dynamic:
            return base
        rules: list[tuple[tuple[str, ...], QuantFormat | None]] = []
        for pattern, overrides in dynamic.items():
            target = ("re:" + pattern.removeprefix("-:").removeprefix("+:"),)
            if pattern.startswith("-:"):
                rules.append((target, None))
            else:
                rules.append((target, one({**c, **(overrides or {})}, f"quantization_config.dynamic[{pattern!r}]")))
        return replace(base, schemes=(*rules, (("Linear",), base)))

    @classmethod
    def _compressed_tensors(cls, c: dict) -> QuantFormat:
        """compressed-tensors, read by its own package (``QuantizationConfig``): one format per config
        group, chosen per projection by the group's ``targets`` less ``ignore`` (``scheme_for``)."""
        try:
            from compressed_tensors.quantization import QuantizationConfig
        except ImportError:
            raise QuantError(
                "quantization_config.quant_method='compressed-tensors' is read with the compressed-tensors "
                "package: pip install compressed-tensors (batchgen's quant extra)"
            ) from None
        try:
            config = QuantizationConfig.model_validate(c)
        except ValueError as e:  # pydantic's ValidationError
            raise QuantError(_first_error(e)) from None
        if not config.config_groups:
            raise QuantError("quantization_config.config_groups: at least one group expected")
        schemes: list[tuple[tuple[str, ...], QuantFormat | None]] = []
        for name, scheme in config.config_groups.items():
            where = f"quantization_config.config_groups.{name}"
            fmt = scheme.format or config.format
            if fmt == "mixed-precision":
                raise QuantError(f"{where}.format: mixed-precision checkpoints name each group's format")
            schemes.append((tuple(scheme.targets), cls._ct_scheme(where, fmt, scheme)))
        ignore = tuple(t for t in config.ignore or () if t != "Linear")
        return cls("compressed-tensors", schemes=((ignore, None), *schemes))

    @classmethod
    def _ct_scheme(cls, where: str, fmt: str | None, scheme: Any) -> QuantFormat:
        """One config group (a ``QuantizationScheme``) in the checkpoint format ``fmt``."""
        wts, acts = scheme.weights, scheme.input_activations
        if wts is None:
            raise QuantError(f"{where}.weights: missing (activation-only quantization is not supported)")
        bits, kind, strategy = wts.num_bits, wts.type, wts.strategy
        weights = where + ".weights"
        block = None
        if strategy == "block" and fmt == "float-quantized" and wts.block_structure:
            block = (wts.block_structure[0], wts.block_structure[1])  # FP8 block-wise: a scale per [rows, inputs]
        elif strategy not in ("channel", "group", "tensor"):
            raise QuantError(f"{weights}.strategy={strategy!r}: channel, group or tensor is supported "
                             "(block for float-quantized FP8)")
        group_size = int(wts.group_size or -1) if strategy == "group" else -1
        activations = None
        if fmt == "pack-quantized":
            if kind != "int" or bits not in (4, 8) or acts is not None or strategy == "tensor":
                raise QuantError(f"{weights}: pack-quantized int4 / int8 weight-only, per channel or group, "
                                 f"is supported ({kind} {bits} bits, {strategy})")
        elif fmt == "int-quantized":
            if kind != "int" or bits != 8:
                raise QuantError(f"{weights}: int-quantized 8-bit integers are supported ({kind} {bits} bits)")
            if acts is not None:
                if not (acts.type == "int" and acts.num_bits == 8 and acts.dynamic is True
                        and acts.strategy == "token" and acts.symmetric):
                    raise QuantError(f"{where}.input_activations: dynamic symmetric per-token "
                                     f"int8 is supported, got {acts.model_dump()}")
                activations = "int8-token"
        elif fmt == "float-quantized":
            if kind != "float" or bits != 8 or strategy == "group":
                raise QuantError(f"{weights}: FP8 (float, 8 bits) per tensor, per channel or per block is supported")
            if block is None and acts is not None and acts.type == "float" and acts.num_bits == 8 and (
                acts.dynamic is True and acts.strategy == "token"
            ):
                activations = "fp8-token"
        else:
            raise QuantError(
                f"quantization_config.format={fmt!r}: pack-quantized, int-quantized or float-quantized is supported"
            )
        return cls("compressed-tensors", int(bits), group_size, bool(wts.symmetric), ct_format=fmt,
                   activations=activations, block=block)

    def scheme_for(self, name: str) -> QuantFormat:
        """The format of the projection ``name`` (``layers.0.mlp.down_proj``): the first of
        ``schemes`` whose targets match it, by compressed-tensors' rule (``match_name``: ``Linear``
        every projection, ``re:`` a pattern matched from the start, else the module's name; the
        decoder's modules are named under ``model.`` as in transformers)."""
        if not self.schemes:
            return self
        names = (name, "model." + name)

        def matches(target: str) -> bool:
            if target == "Linear":
                return True
            if target.startswith("re:"):
                return any(re.match(target.removeprefix("re:"), n) for n in names)
            return target in names

        for targets, scheme in self.schemes:
            if any(matches(t) for t in targets):
                if scheme is None:
                    break
                return scheme
        rules = "dynamic rules" if self.method == "gptq" else "config_groups' targets and ignore"
        raise QuantError(f"{name}: stored quantized, but quantization_config's {rules} leave it unquantized")

    # -- reading one projection ------------------------------------------------------------------
    def is_quantized(self, has, name: str) -> bool:
        """Whether the projection ``name`` (``layers.0.self_attn.q_proj``) is stored quantized."""
        if self.method in ("gptq", "awq"):
            return has(name + ".qweight")
        if self.method == "fp8":
            return has(name + ".weight_scale_inv")
        return has(name + ".weight_packed") or has(name + ".weight_scale")

    def read(self, raw, has, name: str) -> QWeight:
        """``raw(tensor name)`` pops a checkpoint tensor, ``has(name)`` asks for one."""
        try:
            fmt = self.scheme_for(name)
            if fmt.method == "gptq":
                return fmt._gptq(raw, has, name)
            if fmt.method == "awq":
                return fmt._awq(raw, name)
            if fmt.method == "fp8":
                return fmt._fp8_blocks(raw(name + ".weight"), raw(name + ".weight_scale_inv"), name, "weight_scale_inv")
            return fmt._ct(raw, has, name)
        except QuantError:
            raise
        except (RuntimeError, ValueError, IndexError) as e:
            raise QuantError(f"{name}: the quantized tensors do not fit together ({e})") from None

    def _group(self, name: str, in_features: int, groups: int) -> int:
        group = in_features if self.group in (-1, 0) else self.group
        if in_features % group or in_features // group != groups:
            raise QuantError(
                f"{name}: {groups} groups of scales for {in_features} inputs do not match group_size {self.group}"
            )
        return group

    def _gptq(self, raw, has, name: str) -> QWeight:
        qweight, qzeros, scales = raw(name + ".qweight"), raw(name + ".qzeros"), raw(name + ".scales")
        g_idx = raw(name + ".g_idx") if has(name + ".g_idx") else None
        for t, what in ((qweight, "qweight"), (qzeros, "qzeros")):
            if t.dtype != torch.int32:
                raise QuantError(f"{name}.{what}: int32 expected, got {t.dtype}")
        q = unpack_rows(qweight, self.bits).T.contiguous()  # [out, in]
        out, inp = q.shape
        zeros = unpack_cols(qzeros, self.bits)[:, :out]  # [groups, out]
        if scales.shape != (zeros.shape[0], out):
            raise QuantError(f"{name}.scales: shape {tuple(scales.shape)}, expected {(zeros.shape[0], out)}")
        zeros = zeros.int() + GPTQ_V1_ZERO_OFFSET if self.zero_plus_one else zeros.int()
        groups = scales.shape[0]
        group = self._group(name, inp, groups)
        perm = None
        if g_idx is not None:
            if g_idx.shape != (inp,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise QuantError(f"{name}.g_idx: {inp} group indices below {groups} expected")
            if not torch.equal(g_idx.long(), torch.arange(inp) // group):
                # desc_act: order the inputs by group, so that each group is contiguous
                perm = torch.argsort(g_idx.long(), stable=True)
                if not torch.equal(torch.bincount(g_idx.long(), minlength=groups), torch.full((groups,), group)):
                    raise QuantError(f"{name}.g_idx: every group must hold {group} inputs")
                q = q[:, perm]
        return QWeight("int", self.bits, q.contiguous(), scales.float().T.contiguous(),
                       zeros.float().T.contiguous(), group, perm)

    def _awq(self, raw, name: str) -> QWeight:
        qweight, qzeros, scales = raw(name + ".qweight"), raw(name + ".qzeros"), raw(name + ".scales")
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise QuantError(f"{name}: AWQ's qweight and qzeros are int32")
        q = unpack_cols(qweight, 4, AWQ_ORDER).T.contiguous()  # [out, in]
        zeros = unpack_cols(qzeros, 4, AWQ_ORDER)  # [groups, out]
        out, inp = q.shape
        if scales.shape != zeros.shape or scales.shape[1] != out:
            raise QuantError(f"{name}.scales: shape {tuple(scales.shape)}, expected {tuple(zeros.shape)}")
        group = self._group(name, inp, scales.shape[0])
        return QWeight("int", 4, q, scales.float().T.contiguous(), zeros.float().T.contiguous(), group)

    def _fp8_blocks(self, q: torch.Tensor, scale: torch.Tensor, name: str, scale_name: str) -> QWeight:
        """FP8 with a scale per block of ``self.block`` [rows, inputs] (the last blocks may be
        partial; None: one scale), as ``QWeight``'s scale per row and group of inputs."""
        if q.dtype != torch.float8_e4m3fn:
            raise QuantError(f"{name}.weight: {torch.float8_e4m3fn} expected, got {q.dtype}")
        out, inp = q.shape
        scale = scale.float()
        if self.block is None:
            if scale.numel() != 1:
                raise QuantError(f"{name}.{scale_name}: one scale expected (no weight_block_size), got {tuple(scale.shape)}")
            return QWeight("fp8", 8, q.contiguous(), scale.reshape(1, 1).expand(out, 1).contiguous(), None, inp,
                           activations=self.activations)
        rows, cols = self.block
        want = (-(-out // rows), -(-inp // cols))
        if tuple(scale.shape) != want:
            raise QuantError(f"{name}.{scale_name}: shape {tuple(scale.shape)}, expected {want} for blocks of "
                             f"{rows} x {cols}")
        per_row = scale.repeat_interleave(rows, dim=0)[:out]  # [out, ceil(in / cols)]
        if inp % cols:  # a partial last block of inputs: the same scales over groups that divide both
            group = math.gcd(inp, cols)
            per_row, cols = per_row.repeat_interleave(cols // group, dim=1)[:, : inp // group], group
        return QWeight("fp8", 8, q.contiguous(), per_row.contiguous(), None, cols, activations=self.activations)

    def _ct(self, raw, has, name: str) -> QWeight:
        if self.block is not None:
            return self._fp8_blocks(raw(name + ".weight"), raw(name + ".weight_scale"), name, "weight_scale")
        scale = raw(name + ".weight_scale").float()
        zero_point = raw(name + ".weight_zero_point") if has(name + ".weight_zero_point") else None
        if self.ct_format == "pack-quantized":
            packed = raw(name + ".weight_packed")
            shape = raw(name + ".weight_shape").tolist() if has(name + ".weight_shape") else None
            if packed.dtype != torch.int32:
                raise QuantError(f"{name}.weight_packed: int32 expected, got {packed.dtype}")
            q = unpack_cols(packed, self.bits)
            if shape is not None:
                if len(shape) != 2 or q.shape[0] != shape[0] or not 0 <= q.shape[1] - shape[1] < 32 // self.bits:
                    raise QuantError(
                        f"{name}.weight_packed: {tuple(packed.shape)} int32 of {self.bits}-bit values does not "
                        f"hold weight_shape {shape}"
                    )
                q = q[:, : shape[1]]
            if self.sym:  # stored with an offset of 2**(bits - 1): signed values
                q = (q.to(torch.int16) - (1 << (self.bits - 1))).to(torch.int8)
        else:
            q = raw(name + ".weight")
            want = torch.int8 if self.ct_format == "int-quantized" else torch.float8_e4m3fn
            if q.dtype != want:
                raise QuantError(f"{name}.weight: {want} expected, got {q.dtype}")
        out, inp = q.shape
        if scale.dim() == 0 or scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(out, 1).contiguous()
        if scale.dim() != 2 or scale.shape[0] != out:
            raise QuantError(f"{name}.weight_scale: shape {tuple(scale.shape)} does not fit {out} rows")
        if self.ct_format == "float-quantized":
            return QWeight("fp8", 8, q.contiguous(), scale, None, inp, activations=self.activations)
        group = self._group(name, inp, scale.shape[1])
        zero = None
        if not self.sym:
            if zero_point is None:
                raise QuantError(f"{name}.weight_zero_point: missing (the config group's weights are asymmetric)")
            if self.ct_format == "pack-quantized":  # offset like the values, packed along the outputs
                if zero_point.dtype != torch.int32 or not 0 <= zero_point.shape[0] * 32 // self.bits - out < 32 // self.bits:
                    raise QuantError(f"{name}.weight_zero_point: {tuple(zero_point.shape)} {zero_point.dtype} does "
                                     f"not hold {out} rows of {self.bits}-bit values packed in int32")
                zero_point = unpack_rows(zero_point, self.bits)[:out]  # in the unsigned values' units, like q
            if zero_point.shape != scale.shape:
                raise QuantError(f"{name}.weight_zero_point: shape {tuple(zero_point.shape)}, expected {tuple(scale.shape)}")
            zero = zero_point.float()
        return QWeight("int", self.bits, q.contiguous(), scale, zero, group, activations=self.activations)


class _QuantLayer(ABC):
    """What a quantized layer answers like ``linear.Linear``: its path as ``backend``, its shape as
    ``out_features`` / ``in_features``, no fused SwiGLU, no compiled-kernel packing."""

    path: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    kernel = None  # the compiled GEMM kernel's packing: never (MoE's grouped call needs one)

    @property
    def backend(self) -> str:
        return self.path

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).float()


class QuantLinear(_QuantLayer):
    """``y = x @ dequantize(weight).T + bias`` with the weight kept quantized (see the module
    docstring); the same calls as ``linear.Linear``."""

    def __init__(
        self, qw: QWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
        triton: bool | None = None,
    ) -> None:
        """``triton``: run on the Triton kernel (``batchgen_kernels.quant_gemm``); default: on CUDA."""
        self.bias = bias
        self.dtype, self.device = dtype, device
        if qw.kind == "int" and qw.zero is not None and bool((qw.zero == 2 ** (qw.bits - 1)).all()):
            signed = (qw.q.to(torch.int16) - 2 ** (qw.bits - 1)).to(torch.int8)
            qw = replace(qw, q=signed, zero=None)  # symmetric: signed values
        self.out_features, self.in_features = qw.out_features, qw.in_features
        self.perm = None if qw.perm is None else qw.perm.to(device)
        self.path = "reference"
        self._fast: Any = None
        cpu = device.type == "cpu"
        if qw.kind == "fp8" and qw.activations == "fp8-token" and qw.scale.shape[1] == 1 and (
            scaled_mm_runs(device, dtype, qw)
        ):
            self._fast = self._fp8_scaled(qw)
        elif triton if triton is not None else device.type == "cuda":
            self._fast = self._triton(qw)
        elif cpu and qw.kind == "int" and qw.bits == 4:
            self._fast = self._int4(qw)
        elif cpu and qw.kind == "int" and qw.bits == 8 and qw.zero is None and qw.scale.shape[1] == 1:
            # int8 per row, weight-only or W8A8: the compiled kernel's int8 path, else torch's
            w8a8 = qw.activations == "int8-token"
            library = "int8_gemm" in library_kernels()
            # W8A8 on AMX-INT8: int8 x int8 tile products, the rounding inside the kernel's call
            tiles = None if library or not w8a8 else PackedInt8Tiles.of(qw.q, qw.scale, None, dtype)
            kernel = None if library or tiles else PackedBytes.of(qw.q, qw.scale, None, dtype)
            self.int8: Callable[[torch.Tensor], torch.Tensor]
            self.round_tokens: Callable[[torch.Tensor], torch.Tensor]
            if tiles is not None:  # rounds the activations itself
                self.int8 = tiles
                self.path = "w8a8-amx"
            elif kernel is not None:  # W8A8's rounding in one compiled pass too
                self.int8, self.round_tokens = kernel, round_tokens_int8
                self.path = "w8a8-kernel" if w8a8 else "int8-kernel"
            else:
                q8, s8 = qw.q.to(torch.int8).contiguous(), qw.scale[:, 0].to(device=device, dtype=dtype)
                self.int8 = lambda x: torch._weight_int8pack_mm(x, q8, s8)
                self.round_tokens = lambda x: fake_quantize_tokens(x.float()).to(x.dtype)
                self.path = "w8a8-int8pack" if w8a8 else "int8-weight"
            self._fast = self._w8a8 if w8a8 and tiles is None else self.int8
        elif cpu and qw.kind == "fp8" and qw.scale.shape[1] > 1:  # block-wise: a scale per row and group
            if (blocks := PackedFP8Blocks.of(qw.q, qw.scale, qw.group, None, dtype)) is not None:
                self.path, self._fast = "fp8-block-weight", blocks
        elif cpu and qw.kind == "fp8" and (packed := PackedBytes.of(qw.q, qw.scale, None, dtype)) is not None:
            self.path, self._fast = "fp8-weight", packed
        elif cpu and qw.kind == "mxfp4" and (fp4 := PackedMXFP4.of(qw.q, qw.scale, None, dtype)) is not None:
            self.path, self._fast = "mxfp4-weight", fp4
        if self._fast is not None and not self._agrees(qw):
            self._fast, self.path = None, "reference"
        if self._fast is None:  # the reference path: quantized values in the smallest integer type
            self.qw = replace(
                qw,
                q=qw.q.to(device),
                scale=qw.scale.to(device), zero=None if qw.zero is None else qw.zero.to(device), perm=None,
            )
        if qw.activations == "int8-token" and self.path == "reference":
            self.path = "w8a8-reference"

    def _int4(self, qw: QWeight):
        if "int4_gemm" not in library_kernels():  # bf16 on AMX: the codes widened to bf16 for the tiles
            # signed codes (no zero point) are stored minus 8: counted from 0-15, their zero is 8
            codes = qw.q.to(torch.int8) if qw.zero is None else qw.q.to(torch.uint8)
            tiles = PackedInt4Tiles.of(codes, qw.scale, qw.zero, qw.group, None, self.dtype)
            if tiles is not None:
                self.path = "int4-amx"
                return tiles
        group = qw.group
        scale, zero = qw.scale, qw.zero if qw.zero is not None else torch.zeros_like(qw.scale)
        if group not in _INT4_GROUPS:  # one group per row (or a larger group): smaller groups, repeated scales
            sub = next((g for g in reversed(_INT4_GROUPS) if group % g == 0), None)
            if sub is None:
                return None
            scale, zero = scale.repeat_interleave(group // sub, 1), zero.repeat_interleave(group // sub, 1)
            group = sub
        offset = 0 if qw.zero is not None else 8  # torch's layout: unsigned 0..15 around 8
        zero = zero + offset
        try:  # in blocks of rows (the packed layout is row by row): no int32 copy of the whole weight
            self.packed = torch.cat([
                torch._convert_weight_to_int4pack_for_cpu((qw.q[r : r + 4096].int() + offset).contiguous(), 1)
                for r in range(0, qw.out_features, 4096)
            ])
        except RuntimeError:
            return None
        # torch dequantizes (q - 8) * scale + z4: with w = (q - zero) * scale, z4 = (8 - zero) * scale
        self.scales_zeros = torch.stack([scale.T, ((8 - zero) * scale).T], dim=-1).to(self.dtype).contiguous()
        self.group = group
        self.path = "int4-weight"
        return self._int4_mm

    def _fp8_scaled(self, qw: QWeight):
        """FP8 x FP8 on ``torch._scaled_mm``: the activations quantized to FP8 per token (the
        checkpoint's dynamic per-token scheme), the weight as stored, both scales per row."""
        self.w8 = qw.q.to(self.device)
        self.w8_scale = qw.scale.reshape(1, -1).expand(1, qw.out_features).float().contiguous().to(self.device)
        self.path = "fp8-scaled-mm"
        return self._fp8_scaled_mm

    def _fp8_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.device.type == "cuda" and rows % 16:  # the FP8 GEMM takes whole 16-row tiles
            x = F.pad(x, (0, 0, 0, 16 - rows % 16))
        xq, scale = fp8_tokens(x.float())
        out_dtype = self.dtype if self.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(xq, self.w8.t(), scale_a=scale, scale_b=self.w8_scale, out_dtype=out_dtype)
        return y[:rows].to(self.dtype)

    def _triton(self, qw: QWeight):
        """The Triton kernel's layout: int4 two per byte, int8, FP8 and MXFP4's codes as they are;
        float32 scales and zeros."""
        from batchgen_kernels.quant_gemm import pack_int4  # noqa: PLC0415

        dev = self.device
        zero = qw.zero
        if qw.group % 16:  # the kernel's K steps: a power of two of at least 16 dividing the group
            return None
        if qw.kind == "mxfp4":  # the codes as stored, the exponents as float32 powers of two
            self.t_kind, packed, scale, group = "mxfp4", qw.q, mxfp4.scales_of(qw.scale), qw.group
        elif qw.kind == "fp8":
            self.t_kind, packed, scale, group = "fp8", qw.q, qw.scale, qw.group  # per row, or per row and block
        elif qw.bits == 4:
            q = qw.q.to(torch.int16)
            if zero is None:  # signed values: unsigned around 8
                q, zero = q + 8, torch.full_like(qw.scale, 8.0)
            if qw.in_features % 2:
                return None
            self.t_kind, packed, scale, group = "int4", pack_int4(q), qw.scale, qw.group
        else:
            self.t_kind, packed, scale, group = "int8", qw.q, qw.scale, qw.group
        self.t_packed = packed.contiguous().to(dev)
        self.t_scale = scale.float().contiguous().to(dev)
        self.t_zero = None if zero is None else zero.float().contiguous().to(dev)
        self.t_group = group
        self.t_tokens = qw.activations == "int8-token"
        self.path = f"triton-{self.t_kind}" + ("-w8a8" if self.t_tokens else "")
        return self._triton_mm

    def _triton_mm(self, x: torch.Tensor) -> torch.Tensor:
        from batchgen_kernels.quant_gemm import quant_gemm  # noqa: PLC0415

        if self.t_tokens:
            x = fake_quantize_tokens(x.float()).to(x.dtype)
        return quant_gemm(x, self.t_kind, self.t_packed, self.t_scale, self.t_zero, self.t_group)

    def _int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        # the activations on their per-token int8 grid, then the int8 weights widened in the GEMM:
        # W8A8's result (products of int8 values, summed in float32)
        return self.int8(self.round_tokens(x))

    def _agrees(self, qw: QWeight) -> bool:
        """The fast path against the dequantized weight on a probe (a kernel that misbehaves on this
        CPU or shape is not used)."""
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        try:
            got = self._fast(probe if qw.perm is None else probe[:, qw.perm].contiguous()).float()
        except RuntimeError:
            return False
        x = probe.float()
        if qw.activations == "int8-token":
            x = fake_quantize_tokens(x)
        elif self.path == "fp8-scaled-mm":
            xq, scale = fp8_tokens(x)
            x = xq.float() * scale
        rows = slice(0, 256)  # the first rows: a whole dequantized weight would double the load's peak
        head = replace(qw, q=qw.q[rows], scale=qw.scale[rows], zero=None if qw.zero is None else qw.zero[rows])
        want = x @ head.dequantize().T
        got = got[:, rows]
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        return bool(((got - want).abs().max() / want.abs().max().clamp(min=1.0)) < tol)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if self._fast is not None:
            y = self._fast(x2.contiguous())
        else:
            qw = self.qw
            if qw.activations == "int8-token":
                x2 = fake_quantize_tokens(x2.float()).to(x2.dtype)
            y = F.linear(x2, qw.dequantize(self.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, y.shape[-1])


# FP8 x FP8 GEMMs for checkpoints with dynamic per-token FP8 activations: None = where the device
# has them (CUDA compute capability 8.9 or later, bf16 models), True also elsewhere (tests on the CPU)
FP8_SCALED_MM: bool | None = None
_FP8_MAX = 448.0  # E4M3's largest finite value


def scaled_mm_runs(device: torch.device, dtype: torch.dtype, qw: QWeight) -> bool:
    """Whether ``torch._scaled_mm`` runs ``qw`` (FP8) here: see ``FP8_SCALED_MM``."""
    if FP8_SCALED_MM is not None:
        return FP8_SCALED_MM
    return (
        device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 9)
        and qw.in_features % 16 == 0 and qw.out_features % 16 == 0
    )


def fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] float32 as FP8 (E4M3) per token: values [T, in] and float32 scales [T, 1] with
    x ~ values * scale (scale: max|x| / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / _FP8_MAX
    return (x / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [T, in] float32 rounded to int8 per token (symmetric, scale max|x| / 127) and back: what
    W8A8's dynamic activation quantization does to a step's inputs."""
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x / s).clamp(-128, 127) * s


class ConcatLinear(_QuantLayer):
    """Projections that cannot be stacked into one (GPTQ ``desc_act`` orders each one's inputs
    differently): each runs on its own and the outputs are concatenated."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        self.parts = parts
        self.path = parts[0].path
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.dtype = parts[0].dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def path_counts(layers: list) -> dict[str, int]:
    """How many projections took each path (``QuantLinear.path``; "dense" for the rest)."""
    return dict(Counter(getattr(layer, "path", "dense") for layer in layers))
