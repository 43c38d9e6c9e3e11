"""Quantized checkpoints of small random models, written in each format's own layout: what the tests
and workload Q load. ``quantize_model(src, dst, fmt)`` quantizes every q/k/v/o and gate/up/down
projection of the float model in ``src`` (embeddings and the LM head stay as they are), writes
``dst`` (config with its ``quantization_config``, safetensors, tokenizer) and returns the
dequantized float32 weights by parameter name: loaded into transformers, they are the oracle.

Formats (``FORMATS``): ``gptq`` (4 or 8 bits, ``group`` 32..128 or -1 per row, ``sym``, ``desc_act``
with a shuffled ``g_idx``), ``awq`` (GEMM layout, 4 bits, zero points), ``ct-int4`` / ``ct-int8``
(compressed-tensors pack-quantized, weight-only, ``sym`` or with packed zero points), ``ct-w8a8``
(int-quantized, per-row weights, dynamic per-token activations), ``ct-fp8`` (float-quantized, per
tensor, per row or, ``per_channel="block"``, per ``block``) and ``fp8`` (transformers' fine-grained
FP8: a ``weight_scale_inv`` per ``block``, as the hub's DeepSeek and Qwen FP8 checkpoints).
``quantize_gpt_oss_mxfp4(src, dst)`` writes a gpt-oss model's experts as its hub checkpoints hold
them, MXFP4 blocks and scales.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

FORMATS = ("gptq", "awq", "ct-int4", "ct-int8", "ct-w8a8", "ct-fp8", "fp8")
# Mixtral's experts: w1 (gate), w3 (up), w2 (down)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] values (0 .. 2**bits - 1) -> int32 [R * bits / 32, C], value k of each int32 at bits k*bits."""
    per = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // per, per, q.shape[1])
    out = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int64)
    for k in range(per):
        out |= q[:, k] << (bits * k)
    return _to_int32(out)


def pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] values -> int32 [R, C * bits / 32] along the columns (``order``: AWQ's column order)."""
    per = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // per, per)
    out = torch.zeros(q.shape[0], q.shape[1], dtype=torch.int64)
    for k in range(per):
        out |= q[..., order[k] if order else k] << (bits * k)
    return _to_int32(out)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _groups(w: torch.Tensor, group: int) -> int:
    return w.shape[1] if group in (-1, 0) else group


def quantize_weight(w: torch.Tensor, fmt: str, bits: int = 4, group: int = 128, sym: bool = True,
                    desc_act: bool = False, per_channel: bool | str = False, seed: int = 0, v2: bool = False,
                    block: tuple[int, int] | None = (128, 128), ue8m0: bool = False):
    """One [out, in] float32 weight in ``fmt``: (tensors by suffix, dequantized float32 weight).
    ``v2``: GPTQ's ``gptq_v2`` checkpoint format (zero points stored as they are, not minus one).
    ``block``: FP8's blocks of [rows, inputs] with a scale each (``fp8``: transformers' fine-grained
    FP8, None one scale; ``ct-fp8``: compressed-tensors' block strategy where ``per_channel="block"``);
    ``ue8m0``: ``fp8``'s scales powers of two stored as float8_e8m0fnu (``scale_fmt: ue8m0``)."""
    gen = torch.Generator().manual_seed(seed)
    out, inp = w.shape
    if fmt == "fp8" or fmt == "ct-fp8" and per_channel == "block":
        rows, cols = block or (out, inp)
        grid = (-(-out // rows), -(-inp // cols))
        padded = torch.zeros(grid[0] * rows, grid[1] * cols)
        padded[:out, :inp] = w
        scale = (padded.view(grid[0], rows, grid[1], cols).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        if ue8m0:  # the next power of two: a byte of exponent
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out, :inp]
        q = (w / full).to(torch.float8_e4m3fn)
        stored = (scale if block else scale.reshape(())).to(torch.float8_e8m0fnu if ue8m0 else torch.float32)
        return {"weight": q, "weight_scale_inv" if fmt == "fp8" else "weight_scale": stored}, q.float() * full
    if fmt == "ct-fp8":
        scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.float()}, q.float() * scale
    if fmt == "ct-w8a8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).half().float()
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    if fmt in ("ct-int4", "ct-int8"):
        bits = 4 if fmt == "ct-int4" else 8
    g = _groups(w, group)
    g_idx = torch.arange(inp) // g
    if desc_act:  # inputs assigned to groups in a shuffled order, as GPTQ's act-order leaves them
        g_idx = g_idx[torch.randperm(inp, generator=gen)]
    groups = inp // g
    members = [torch.nonzero(g_idx == k).flatten() for k in range(groups)]
    scale = torch.empty(groups, out)
    zero = torch.empty(groups, out)
    q = torch.empty(inp, out, dtype=torch.int64)  # [in, out]
    wt = w.T
    top = 2**bits - 1
    for k, idx in enumerate(members):
        members_w = wt[idx]  # [g, out]
        if sym:
            s = (members_w.abs().amax(0) / (2 ** (bits - 1) - 1)).clamp(min=1e-8)
            z = torch.full((out,), float(2 ** (bits - 1)))
        else:
            lo, hi = members_w.amin(0).clamp(max=0), members_w.amax(0).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-8)
            # GPTQ's v1 layout stores zero - 1: a zero of 0 does not survive it, so its zeros start at 1
            z = torch.round(-lo / s.half().float()).clamp(1 if fmt == "gptq" and not v2 else 0, top)
        s = s.half().float()  # the checkpoint stores float16 scales
        scale[k], zero[k] = s, z
        q[idx] = (torch.round(members_w / s) + z).clamp(0, top).long()
    deq = ((q.float() - zero[g_idx]) * scale[g_idx]).T.contiguous()
    if fmt == "gptq":
        return {
            "qweight": pack_rows(q, bits),
            "qzeros": pack_cols((zero.long() - (0 if v2 else 1)) % (2**bits), bits),  # v1 stores zero - 1
            "scales": scale.half(),
            "g_idx": g_idx.to(torch.int32),
        }, deq
    if fmt == "awq":
        return {"qweight": pack_cols(q, 4, AWQ_ORDER), "qzeros": pack_cols(zero.long(), 4, AWQ_ORDER),
                "scales": scale.half()}, deq
    if fmt in ("ct-int4", "ct-int8"):  # signed values stored with an offset of 2**(bits - 1)
        # q is unsigned: the signed value plus 2**(bits - 1) (symmetric: z is that offset)
        tensors = {"weight_packed": pack_cols(q.T, bits), "weight_scale": scale.T.contiguous().half(),
                   "weight_shape": torch.tensor([out, inp])}
        if not sym:  # the zero points, signed and offset like the values, packed along the outputs
            tensors["weight_zero_point"] = pack_rows(zero.T.long(), bits)
        return tensors, deq
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def quantization_config(fmt: str, bits: int = 4, group: int = 128, sym: bool = True, desc_act: bool = False,
                        per_channel: bool | str = False, v2: bool = False,
                        block: tuple[int, int] | None = (128, 128), ue8m0: bool = False) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt == "fp8":  # as the hub's DeepSeek / Qwen FP8 checkpoints state it
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block) if block else None, "scale_fmt": "ue8m0" if ue8m0 else "float"}
    weights: dict = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    acts = None
    if fmt in ("ct-int4", "ct-int8"):
        weights.update(num_bits=4 if fmt == "ct-int4" else 8, symmetric=sym,
                       strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group)
        form = "pack-quantized"
    elif fmt == "ct-w8a8":
        weights.update(strategy="channel")
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
        form = "int-quantized"
    else:
        weights.update(type="float", strategy="channel" if per_channel else "tensor")
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        if per_channel == "block":  # llm-compressor's FP8_BLOCK: activations per group of 128 inputs
            weights.update(strategy="block", block_structure=list(block or (128, 128)))
            acts.update(strategy="group", group_size=128)
        form = "float-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }


def mixed_config(schemes: list[tuple[str, str, dict]]) -> dict:
    """compressed-tensors' ``mixed-precision`` config: one config group per (target, format, options),
    each naming its own format."""
    groups = {}
    for i, (target, fmt, opts) in enumerate(schemes):
        one = quantization_config(fmt, **opts)
        (group,) = one["config_groups"].values()
        groups[f"group_{i}"] = {**group, "targets": [target], "format": one["format"]}
    return {**quantization_config("ct-fp8"), "format": "mixed-precision", "config_groups": groups}


def quantize_model(
    src: str | Path, dst: str | Path, fmt: str, oracle: str | Path | None = None,
    schemes: list[tuple[str, str, dict]] | None = None, dynamic: dict[str, dict] | None = None, **opts
) -> dict[str, torch.Tensor]:
    """Write ``src``'s model quantized in ``fmt`` to ``dst``; returns the dequantized weights, and
    writes them as a float model to ``oracle`` when given (transformers loads it as the oracle).
    ``fmt="ct-mixed"``: compressed-tensors formats per projection, ``schemes`` a list of (``re:``
    pattern on the module name, format, options); the first that matches a projection holds it.
    ``dynamic`` (GPTQ): GPTQModel's per-module rules, pattern -> overrides of ``bits``,
    ``group_size``, ``sym``, ``desc_act`` ("-:pattern": left in float)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{src}: one safetensors file expected")
    state = load_file(str(files[0]))
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(sorted(state.items())):
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in PROJECTIONS and module[2] == "weight" and ".layers." in name:
            one, one_opts = fmt, opts
            path = module[0] + "." + module[1]
            if fmt == "ct-mixed":
                assert schemes, "ct-mixed: schemes expected"
                one, one_opts = next((f, o) for t, f, o in schemes if re.match(t.removeprefix("re:"), path))
            rule = next((p for p in dynamic or {} if re.match(p.removeprefix("-:").removeprefix("+:"), path)), None)
            if rule is not None and rule.startswith("-:"):
                out[name] = tensor
                continue
            if rule is not None:
                renamed = {"group_size": "group"}
                one_opts = {**opts, **{renamed.get(k, k): v for k, v in dynamic[rule].items()}}  # type: ignore[index]
            tensors, deq = quantize_weight(tensor.float(), one, seed=i, **one_opts)
            prefix = name[: -len(".weight")]
            for suffix, t in tensors.items():
                out[f"{prefix}.{suffix}"] = t.contiguous()
            dequantized[name] = deq
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if oracle is not None:
        oracle = Path(oracle)
        oracle.mkdir(parents=True, exist_ok=True)
        float_state = {k: (dequantized[k].to(v.dtype) if k in dequantized else v) for k, v in state.items()}
        save_file(float_state, str(oracle / "model.safetensors"), metadata={"format": "pt"})
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, oracle / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = mixed_config(schemes or []) if fmt == "ct-mixed" else quantization_config(fmt, **opts)
    if dynamic:
        config["quantization_config"]["dynamic"] = dynamic
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dequantized


def quantize_gpt_oss_mxfp4(src: str | Path, dst: str | Path) -> dict[str, torch.Tensor]:
    """Write the gpt-oss model in ``src`` to ``dst`` with MXFP4 experts (the hub's layout:
    ``*_blocks`` [E, out, in / 32, 16] and ``*_scales`` [E, out, in / 32], with ``quant_method``
    mxfp4); returns the dequantized expert tensors by name, in the float checkpoint's layout."""
    from safetensors.torch import load_file, save_file

    from batchgen.model import mxfp4

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(tensor.float().transpose(1, 2))  # [E, out, in]
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous().to(tensor.dtype)
        else:
            quantized[name] = tensor
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized
