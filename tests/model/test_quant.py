"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) kept quantized, against transformers in
float32 on the dequantized weights (for W8A8 with the activations fake-quantized per token):
greedy tokens, beam width 2 with scores, sampled log-probabilities, on Llama and Qwen3-MoE. Each
format's writer round-trips through a dequantizer written here from the formats' descriptions, a
wrong nibble order or zero-point offset in the loader fails the comparison, the resident memory is
measured in a subprocess, and bad checkpoints get errors naming the tensor or field. int4 in bf16
on AMX tiles is compared with the dense bf16 model of the weights the tiles multiply."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.model import quant
from batchgen.tiny import make_model
from batchgen_kernels.cpu_gemm import PackedBytes, amx, amx_int8
from scripts.fixtures.quant import quantize_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [3, 4, 40, 50], [7, 100, 200, 17]]
CASES = {
    "gptq-4bit-g32-sym": ("gptq", dict(bits=4, group=32), 5e-3),
    "gptq-4bit-g32-asym-desc_act": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True), 5e-3),
    "gptq_v2-4bit-g32-asym": ("gptq", dict(bits=4, group=32, sym=False, v2=True), 5e-3),
    "gptq-4bit-per-row": ("gptq", dict(bits=4, group=-1), 5e-3),
    "gptq-8bit-g32-asym": ("gptq", dict(bits=8, group=32, sym=False), 2e-3),
    "gptq-8bit-per-row": ("gptq", dict(bits=8, group=-1), 2e-3),
    "awq-4bit-g32": ("awq", dict(group=32, sym=False), 5e-3),
    "ct-int4-g32": ("ct-int4", dict(group=32), 5e-3),
    "ct-int4-g32-asym": ("ct-int4", dict(group=32, sym=False), 5e-3),
    "ct-int8-per-row": ("ct-int8", dict(group=-1), 2e-3),
    "ct-w8a8": ("ct-w8a8", {}, 2e-3),
    "ct-fp8-tensor": ("ct-fp8", {}, 2e-3),
    "ct-fp8-per-row": ("ct-fp8", dict(per_channel=True), 2e-3),
    # block-wise FP8: blocks of 48 rows x 32 or 48 inputs (the last partial where 48 does not divide)
    "ct-fp8-block": ("ct-fp8", dict(per_channel="block", block=(48, 32)), 2e-3),
    "fp8-block": ("fp8", dict(block=(48, 48)), 2e-3),
    "fp8-block-ue8m0": ("fp8", dict(block=(48, 48), ue8m0=True), 2e-3),  # scales as float8_e8m0fnu (DeepSeek V3.2)
    "fp8-tensor": ("fp8", dict(block=None), 2e-3),
}


def case_params(names) -> list:
    """The cases as test parameters; those whose scales are stored as float8_e8m0fnu need a torch
    that has the dtype (2.7 and later)."""
    no_e8m0 = not hasattr(torch, "float8_e8m0fnu")
    return [
        pytest.param(c, marks=pytest.mark.skipif(
            no_e8m0 and c in CASES and CASES[c][1].get("ue8m0", False), reason="this torch has no float8_e8m0fnu"))
        for c in names
    ]


# compressed-tensors' mixed precision: attention in FP8 per row, the MLP in asymmetric int4 per group
MIXED = [("re:.*self_attn.*", "ct-fp8", dict(per_channel=True)), ("re:.*mlp.*", "ct-int4", dict(group=32, sym=False))]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- an independent dequantizer, from the formats' descriptions ----------------------------------
def _nibbles(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words -> their 32/bits values, lowest bits first, along a new last axis."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.stack([(u >> (bits * k)) & (2**bits - 1) for k in range(32 // bits)], axis=-1)


def dequantize(fmt: str, t: dict[str, torch.Tensor], bits: int, v2: bool = False, block=None) -> torch.Tensor:
    if fmt == "gptq":  # qweight [in/per, out] along the inputs; qzeros [groups, out/per] along the outputs, minus 1 (v1)
        q = np.moveaxis(_nibbles(t["qweight"].numpy(), bits), -1, 1).reshape(-1, t["qweight"].shape[1])
        z = _nibbles(t["qzeros"].numpy(), bits).reshape(t["qzeros"].shape[0], -1) + (0 if v2 else 1)
        g = t["g_idx"].numpy().astype(np.int64)
        w = (q - z[g]) * t["scales"].float().numpy()[g]
        return torch.from_numpy(w.T.astype(np.float32))
    if fmt == "awq":  # [in, out/8] along the outputs, an int32's values in columns 0 2 4 6 1 3 5 7
        def cols(words):
            v = _nibbles(words.numpy(), 4)
            out = np.empty_like(v)
            out[..., [0, 2, 4, 6, 1, 3, 5, 7]] = v
            return out.reshape(words.shape[0], -1)

        q, z = cols(t["qweight"]), cols(t["qzeros"])
        group = q.shape[0] // z.shape[0]
        s = t["scales"].float().numpy()
        w = (q - np.repeat(z, group, axis=0)) * np.repeat(s, group, axis=0)
        return torch.from_numpy(w.T.astype(np.float32))
    if fmt in ("ct-int4", "ct-int8"):  # [out, in/per] along the inputs, signed values + 2**(bits-1)
        q = _nibbles(t["weight_packed"].numpy(), bits).reshape(t["weight_packed"].shape[0], -1) - 2 ** (bits - 1)
        s = t["weight_scale"].float().numpy()
        if "weight_zero_point" in t:  # [out/per, groups], packed along the outputs, offset like the values
            z = np.moveaxis(_nibbles(t["weight_zero_point"].numpy(), bits), -1, 1).reshape(-1, s.shape[1])
            q = q - np.repeat(z - 2 ** (bits - 1), q.shape[1] // s.shape[1], axis=1)
        return torch.from_numpy((q * np.repeat(s, q.shape[1] // s.shape[1], axis=1)).astype(np.float32))
    s = (t["weight_scale_inv"] if fmt == "fp8" else t["weight_scale"]).float().numpy()
    w = t["weight"].float().numpy()
    if block:  # a scale per block of [rows, inputs], the last ones partial
        s = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return torch.from_numpy((w * s).astype(np.float32))  # int8 / fp8 values, per-row or per-tensor scale


@pytest.mark.parametrize("case", case_params(CASES))
def test_each_writer_round_trips_through_an_independent_dequantizer(case):
    fmt, opts, _ = CASES[case]
    from scripts.fixtures.quant import quantize_weight

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    tensors, deq = quantize_weight(w, fmt, **opts)
    bits = 8 if fmt in ("ct-int8", "ct-w8a8", "ct-fp8", "fp8") else opts.get("bits", 4)
    block = opts.get("block") if fmt == "fp8" or opts.get("per_channel") == "block" else None
    assert torch.allclose(dequantize(fmt, tensors, bits, opts.get("v2", False), block), deq, atol=1e-6)
    # close to the weight it encodes: within half a step of its grid (fp8: 3 mantissa bits)
    bound = {4: 1 / 14, 8: 1 / 250}[bits] if fmt not in ("ct-fp8", "fp8") else 1 / 16
    assert (deq - w).abs().max() / w.abs().max() < bound
    # batchgen's reader gives the same weight
    qfmt = quant.QuantFormat.of(__import__("scripts.fixtures.quant", fromlist=["x"]).quantization_config(fmt, **opts))
    named = {f"p.{k}": v for k, v in tensors.items()}
    qw = qfmt.read(lambda n: named.pop(n), lambda n: n in named, "p")
    assert torch.allclose(qw.dequantize(), deq, atol=1e-6)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # run_compressed=False: decompress at load
@pytest.mark.parametrize("case", case_params(["ct-int4-g32", "ct-int4-g32-asym", "ct-int8-per-row", "ct-w8a8",
                                              "ct-fp8-tensor", "ct-fp8-per-row", "ct-fp8-block", "ct-mixed",
                                              "fp8-block", "fp8-block-ue8m0", "fp8-tensor"]))
def test_compressed_tensors_checkpoints_load_in_the_formats_own_library(tmp_path, case):
    """The compressed-tensors and fine-grained FP8 writers against the formats' own loaders:
    transformers (with ``compressed-tensors``; FP8 with ``dequantize=True``) dequantizes the
    checkpoint to the same weights as the writer's dequantized ones (and so as batchgen's reader,
    checked above). Mixed precision, which transformers decompresses with one config group for
    every dense module: each module with the package's compressor of the group that targets it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_name
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig, FineGrainedFP8Config

    fmt, opts, _ = CASES[case] if case != "ct-mixed" else ("ct-mixed", dict(schemes=MIXED), None)
    if opts.get("block"):  # transformers' FP8 dequantizer takes whole blocks only
        opts = {**opts, "block": (32, 32)}
    src = make_model(tmp_path / "src", "llama", seed=2)
    dequantized = quantize_model(src, tmp_path / "q", fmt, **opts)
    if fmt == "ct-mixed":
        config = QuantizationConfig.model_validate(
            json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"])
        tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
        state = {}
        for name in dequantized:
            module = name.removesuffix(".weight")
            (scheme,) = [g for g in config.config_groups.values() if any(match_name(module, t) for t in g.targets)]
            own = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
            state[name] = BaseCompressor.get_value_from_registry(scheme.format).decompress(own, scheme)["weight"]
        assert {s.format for s in config.config_groups.values()} == {"float-quantized", "pack-quantized"}
    else:
        loading = (FineGrainedFP8Config(dequantize=True, weight_block_size=opts["block"],
                                        scale_fmt="ue8m0" if opts.get("ue8m0") else "float") if fmt == "fp8"
                   else CompressedTensorsConfig(run_compressed=False))
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype=torch.float32, quantization_config=loading)
        state = model.state_dict()
    assert dequantized and set(dequantized) <= set(state)
    for name, want in dequantized.items():
        assert torch.allclose(state[name].float(), want, rtol=1e-3, atol=1e-6), name


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("q") / "llama", "llama", seed=3))


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("q") / "moe", "qwen3_moe", seed=4, moe_intermediate_size=64))


def build(src: str, tmp: Path, case: str, activations: str | None = None):
    """The checkpoint of ``case``, its oracle (``activations``: "int8" / "fp8", each projection's
    input rounded per token as the engine rounds it; W8A8: int8) and the log-probability tolerance."""
    fmt, opts, tol = CASES[case]
    quantize_model(src, tmp / "q", fmt, oracle=tmp / "oracle", **opts)
    return str(tmp / "q"), oracle_model(str(tmp / "oracle"), activations or ("int8" if fmt == "ct-w8a8" else None)), tol


def oracle_model(path: str, fake_quant_activations: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    capped = getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None) is not None
    kwargs = {"attn_implementation": "eager"} if capped else {}  # soft-capping exists only in eager attention
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                                 **kwargs).eval()
    if fake_quant_activations:  # each projection's input rounded per token: to int8 (W8A8) or FP8 (E4M3)
        def round_rows(x):
            if fake_quant_activations == "fp8":
                s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
                return (x / s).to(torch.float8_e4m3fn).float() * s
            s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
            return torch.round(x / s).clamp(-128, 127) * s

        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                module.register_forward_pre_hook(lambda _module, args: (round_rows(args[0]),))
        round_expert_inputs(model, round_rows)
    return model


def round_expert_inputs(model, round_rows) -> None:
    """A MoE's experts are one fused module (3D parameters, each expert's GEMMs ``F.linear`` calls on
    slices of them, in its eager implementation): during the model's forward, ``F.linear`` rounds
    the input of every call on an expert's weight, row by row (a row is a token's, for one expert)."""
    experts = {p.untyped_storage().data_ptr() for n, p in model.named_parameters()
               if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    if not experts:
        return
    linear, forward = F.linear, model.forward

    def rounded_linear(x, weight, bias=None):
        return linear(round_rows(x) if weight.untyped_storage().data_ptr() in experts else x, weight, bias)

    def rounded_forward(*args, **kwargs):
        F.linear = rounded_linear
        try:
            return forward(*args, **kwargs)
        finally:
            F.linear = linear

    model.forward = rounded_forward


@torch.no_grad()
def greedy(model, prompt, n=8):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def logprob(model, prompt, completion):
    logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(completion)))


def failures(path: str, oracle, tol: float, beams: bool = True, stats: dict | None = None) -> list[str]:
    """What differs from the oracle: greedy tokens, beam width 2 (sequences, scores within 1e-3),
    sampled log-probabilities within ``tol``. ``stats``: filled with the engine's."""
    llm = LLM(path, dtype="float32")
    problems = []
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        if o.outputs[0].token_ids != greedy(oracle, p):
            problems.append(f"greedy {p}")
    if beams:
        with torch.no_grad():
            g = oracle.generate(torch.tensor([PROMPTS[0]]), num_beams=2, num_return_sequences=2, max_new_tokens=6,
                                do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                                eos_token_id=None)
        out = llm.generate([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0]
        if [c.token_ids for c in out.outputs] != g.sequences[:, len(PROMPTS[0]) :].tolist():
            problems.append("beam sequences")
        elif any(abs(c.score - s) > 1e-3 for c, s in zip(out.outputs, g.sequences_scores.tolist())):
            problems.append("beam scores")
    sampled = llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True))
    for p, o in zip(PROMPTS, sampled):
        for c in o.outputs:
            if abs(c.cumulative_logprob - logprob(oracle, p, c.token_ids)) > tol:
                problems.append(f"logprob {p}")
    if stats is not None:
        stats.update(llm.stats())
    return problems


def test_mixed_precision_config_groups_each_take_their_projections(llama_src, tmp_path):
    """compressed-tensors with a config group per module kind (FP8 attention, asymmetric int4 MLP),
    each group naming its format: every projection read in its own group's format."""
    quantize_model(llama_src, tmp_path / "q", "ct-mixed", oracle=tmp_path / "oracle", schemes=MIXED)
    stats: dict = {}
    assert failures(str(tmp_path / "q"), oracle_model(str(tmp_path / "oracle"), None), 5e-3, stats=stats) == []
    fp8 = "fp8-weight" if byte_kernel_runs() else "reference"
    paths = {"dense": 1, fp8: 4, "int4-weight": 4}  # 2 layers: qkv, o; gate_up, down
    assert stats["quantized_paths"] == ", ".join(f"{path} x {n}" for path, n in sorted(paths.items()))


def test_gptqmodel_dynamic_rules_override_or_skip_modules(llama_src, tmp_path):
    """GPTQModel's ``dynamic`` rules: the MLP's down projection in 8 bits per row, o_proj left in
    float, the rest in the config's 4 bits per 32; each read in its own settings."""
    dynamic = {r"+:.*mlp\.down_proj": {"bits": 8, "group_size": -1}, r"-:.*self_attn\.o_proj": {}}
    quantize_model(llama_src, tmp_path / "q", "gptq", oracle=tmp_path / "oracle", dynamic=dynamic, bits=4, group=32)
    stats: dict = {}
    assert failures(str(tmp_path / "q"), oracle_model(str(tmp_path / "oracle"), None), 5e-3, stats=stats) == []
    int8 = "int8-kernel" if byte_kernel_runs() else "int8-weight"
    assert stats["quantized_paths"] == f"dense x 3, int4-weight x 4, {int8} x 2"  # dense: o_proj x 2, LM head


@pytest.mark.parametrize("case", case_params(CASES))
def test_llama_in_each_format_equals_the_dequantized_oracle(llama_src, tmp_path, case):
    path, oracle, tol = build(llama_src, tmp_path, case)
    stats: dict = {}
    assert failures(path, oracle, tol, stats=stats) == []
    assert stats["quantization"] == CASES[case][0].split("-")[0].replace("ct", "compressed-tensors")
    assert "dense x 1" in stats["quantized_paths"]  # the LM head; every projection quantized
    if case in KERNEL_PATHS and byte_kernel_runs():  # widened in the compiled GEMM kernel's registers
        assert stats["quantized_paths"] == f"dense x 1, {KERNEL_PATHS[case]} x 8"  # 2 layers: qkv, o, gate_up, down


def byte_kernel_runs() -> bool:
    return PackedBytes.of(torch.zeros(16, 16, dtype=torch.int8), torch.ones(1), None, torch.float32) is not None


# the formats the compiled GEMM kernel runs (where it builds: AVX2 with FMA and F16C, or AVX-512)
KERNEL_PATHS = {"ct-fp8-tensor": "fp8-weight", "ct-fp8-per-row": "fp8-weight", "ct-fp8-block": "fp8-block-weight",
                "fp8-block": "fp8-block-weight", "fp8-block-ue8m0": "fp8-block-weight", "fp8-tensor": "fp8-weight", "ct-int8-per-row": "int8-kernel",
                "ct-w8a8": "w8a8-amx" if amx_int8() else "w8a8-kernel", "gptq-8bit-per-row": "int8-kernel"}


@pytest.mark.skipif(not amx_int8(), reason="no AMX-INT8 tiles here: W8A8 takes the widening path anyway")
def test_w8a8_without_its_tiles_rounds_then_widens(llama_src, tmp_path, monkeypatch):
    """On a CPU with AMX-INT8, the W8A8 path of every other CPU (a rounding pass, then the int8
    weights widened in the GEMM's registers) still equals the oracle."""
    monkeypatch.setattr(quant.PackedInt8Tiles, "of", classmethod(lambda cls, *args: None))
    path, oracle, tol = build(llama_src, tmp_path, "ct-w8a8")
    stats: dict = {}
    assert failures(path, oracle, tol, beams=False, stats=stats) == []
    assert stats["quantized_paths"] == "dense x 1, w8a8-kernel x 8"


@pytest.mark.skipif(not amx(), reason="no AMX tiles here: int4 in bf16 takes torch's int4 GEMM")
@pytest.mark.parametrize("case", ["gptq-4bit-g32-sym", "awq-4bit-g32", "ct-int4-g32-asym"])
def test_int4_on_the_bf16_tiles_equals_the_bf16_model_of_its_weights(llama_src, tmp_path, case):
    """int4 in bf16 on AMX (``int4-amx``) end to end: each weight is ``(code - zero) * scale`` with
    the scale kept in bf16, rounded to bf16, then the bf16 tiles. A dense bf16 model holding exactly
    those weights (computed here by the independent dequantizer) runs the same tiles, so the two
    give the same greedy tokens and log-probabilities; the dense model on the checkpoint's own
    scales is the control, showing that the comparison sees the scales' rounding."""
    fmt, opts, _ = CASES[case]
    quantize_model(llama_src, tmp_path / "q", fmt, oracle=tmp_path / "oracle", **opts)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    dense = load_file(str(tmp_path / "oracle" / "model.safetensors"))
    widened = 0
    for key in [k for k in tensors if k.endswith((".qweight", ".weight_packed"))]:
        prefix = key.rsplit(".", 1)[0]
        own = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        for name in ("scales", "weight_scale"):  # kept in bf16 by the tiles' path
            if name in own:
                own[name] = own[name].bfloat16().float()
        dense[prefix + ".weight"] = dequantize(fmt, own, 4).bfloat16().float().contiguous()
        widened += 1
    assert widened == 14  # 2 layers x 7 projections
    for name in ("tiles", "control"):
        (tmp_path / name).mkdir()
        for f in (tmp_path / "oracle").iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp_path / name / f.name)
    save_file(dense, str(tmp_path / "tiles" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "oracle" / "model.safetensors", tmp_path / "control" / "model.safetensors")

    def run(path: Path) -> tuple[list, list, dict]:
        llm = LLM(str(path), dtype="bfloat16")
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        sampled = llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True))
        return ([o.outputs[0].token_ids for o in greedy],
                [(c.token_ids, c.cumulative_logprob) for o in sampled for c in o.outputs], llm.stats())

    got, want, control = run(tmp_path / "q"), run(tmp_path / "tiles"), run(tmp_path / "control")
    assert got[2]["quantized_paths"] == "dense x 1, int4-amx x 8"
    assert got[0] == want[0]
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got[1], want[1])) < 1e-4
    # the checkpoint's float16 scales, not rounded to bf16: visibly other log-probabilities
    assert got[1] != control[1]


@pytest.mark.parametrize("case", ["ct-fp8-tensor", "ct-fp8-per-row"])
def test_fp8_with_fp8_activations_on_scaled_mm(llama_src, tmp_path, monkeypatch, case):
    """Where the device multiplies FP8 by FP8 (forced here on the CPU, where torch runs it too),
    the checkpoint's dynamic per-token FP8 activations are kept: ``torch._scaled_mm`` equals the
    oracle whose projections' inputs are rounded to FP8 per token."""
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
                         scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):  # torch 2.6 has it on CUDA only
        pytest.skip("this torch has no FP8 x FP8 product (torch._scaled_mm) on the CPU")
    monkeypatch.setattr(quant, "FP8_SCALED_MM", True)
    path, oracle, tol = build(llama_src, tmp_path, case, activations="fp8")
    stats: dict = {}
    assert failures(path, oracle, tol, stats=stats) == []
    assert stats["quantized_paths"] == "dense x 1, fp8-scaled-mm x 8"


@pytest.mark.skipif(not byte_kernel_runs(), reason="no compiled int8 GEMM kernel on this CPU")
def test_int8_falls_back_to_torchs_gemm_when_told(llama_src, tmp_path, monkeypatch):
    """``BATCHGEN_LIBRARY_KERNELS=int8_gemm``: int8 and W8A8 run on ``torch._weight_int8pack_mm``
    (what the kernel's gain is measured against), still equal to the oracle."""
    from batchgen_kernels import cpu

    monkeypatch.setenv("BATCHGEN_LIBRARY_KERNELS", "int8_gemm")
    cpu.library_kernels.cache_clear()
    try:
        for case, path in (("ct-w8a8", "w8a8-int8pack"), ("ct-int8-per-row", "int8-weight")):
            q, oracle, tol = build(llama_src, tmp_path / case, case)
            stats: dict = {}
            assert failures(q, oracle, tol, beams=False, stats=stats) == []
            assert stats["quantized_paths"] == f"dense x 1, {path} x 8"
    finally:
        monkeypatch.delenv("BATCHGEN_LIBRARY_KERNELS")
        cpu.library_kernels.cache_clear()


@pytest.mark.parametrize("case", ["gptq-4bit-g32-sym", "awq-4bit-g32", "ct-int8-per-row", "ct-w8a8", "ct-fp8-per-row",
                                  "fp8-block"])
def test_moe_experts_in_each_format_equal_the_dequantized_oracle(moe_src, tmp_path, case):
    path, oracle, tol = build(moe_src, tmp_path, case)
    assert failures(path, oracle, tol) == []


@pytest.mark.parametrize("arch,case", [("mixtral", "gptq-4bit-g32-sym"), ("mixtral", "ct-fp8-per-row"),
                                       ("qwen2_moe", "awq-4bit-g32")])
def test_other_moe_families_keep_their_experts_quantized(tmp_path, arch, case):
    """Mixtral's experts (``block_sparse_moe.experts.N.w1 / w3 / w2``) and Qwen2-MoE's routed and
    shared experts stored quantized: each expert's projections stay quantized, the routers dense."""
    sizes = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64) if arch == "qwen2_moe" else {}
    src = str(make_model(tmp_path / arch, arch, seed=7, **sizes))  # inputs in whole groups of 32
    path, oracle, tol = build(src, tmp_path, case)
    stats: dict = {}
    assert failures(path, oracle, tol, stats=stats) == []
    stored = load_file(str(Path(path) / "model.safetensors"))
    # dense: the LM head, the routers and Qwen2-MoE's shared_expert_gate; quantized: per o_proj
    # (attention: qkv and o) and per down projection (an expert, shared expert or dense MLP: gate_up and down)
    dense = 1 + sum(k.endswith("gate.weight") for k in stored)
    quantized = 2 * sum(k.endswith(("o_proj.qweight", "o_proj.weight_scale", "down_proj.qweight",
                                    "down_proj.weight_scale", "w2.qweight", "w2.weight_scale")) for k in stored)
    assert any(".experts.0." in k and k.endswith((".qweight", ".weight_scale")) for k in stored)
    paths = dict(p.split(" x ") for p in stats["quantized_paths"].split(", "))
    assert int(paths.pop("dense")) == dense and sum(map(int, paths.values())) == quantized, stats["quantized_paths"]


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "phi3"])
def test_other_dense_families_run_quantized(tmp_path, arch):
    """Qwen2's q/k/v biases beside quantized weights, Gemma 2's norms and soft-capping, Phi-3's
    fused ``qkv_proj`` / ``gate_up_proj`` stored quantized."""
    src = str(make_model(tmp_path / arch, arch, seed=6))
    path, oracle, tol = build(src, tmp_path, "gptq-4bit-g32-asym-desc_act")
    assert failures(path, oracle, tol, beams=False) == []


@pytest.mark.parametrize(
    "case,mutate",
    [("awq-4bit-g32", ("AWQ_ORDER", (0, 1, 2, 3, 4, 5, 6, 7))), ("gptq-4bit-g32-asym-desc_act", ("GPTQ_V1_ZERO_OFFSET", 0))],
    ids=["awq-nibble-order", "gptq-zero-offset"],
)
def test_a_wrong_nibble_order_or_zero_offset_fails_the_comparison(llama_src, tmp_path, monkeypatch, case, mutate):
    path, oracle, tol = build(llama_src, tmp_path, case)
    monkeypatch.setattr(quant, *mutate)
    assert failures(path, oracle, tol, beams=False) != []


def test_resident_memory_of_packed_and_quantized_models(tmp_path):
    """Measured in fresh processes: the resident growth of loading the model (after warming the
    same code on a small one), against the same model's on ``F.linear`` (its weights alone): one
    copy on the packed backends, a fraction of bf16's when quantized."""
    shape = dict(hidden_size=512, intermediate_size=2048, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=512)
    big = make_model(tmp_path / "big", "llama", seed=0, **shape)
    small = make_model(tmp_path / "small", "llama", seed=1, **{**shape, "hidden_size": 128, "intermediate_size": 256,
                                                                "num_layers": 1, "num_heads": 4})
    script = (
        "import sys, gc, ctypes, torch\n"
        "from batchgen.model.loader import load_config\n"
        "from batchgen.model.decoder import DecoderModel\n"
        "def rss():\n"
        "    gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0)\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS'))\n"
        "def load(p):\n"
        "    dtype = getattr(torch, sys.argv[4])\n"
        "    return DecoderModel(load_config(p), p, torch.device('cpu'), dtype, 256, linear_backend=sys.argv[3])\n"
        "load(sys.argv[1]); before = rss(); m = load(sys.argv[2]); print(rss() - before)\n"
    )
    # the kernels' variant and build (BATCHGEN_CPU_CAPABILITY, BATCHGEN_KERNEL_DEBUG) and the emulated
    # CPU's caps on torch (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY: cpu.emulation_env) go with it
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}", "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k.startswith(("BATCHGEN_", "ONEDNN_", "ATEN_CPU_"))}}

    def grown(warm, path, backend="auto", dtype="bfloat16") -> int:
        res = subprocess.run([sys.executable, "-c", script, str(warm), str(path), backend, dtype], capture_output=True,
                             text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        return int(res.stdout.split()[-1])

    # (GPTQ and AWQ int4 end in the same packed int4 layer as compressed-tensors int4)
    formats = {"ct-int4": (dict(group=128), 0.35), "ct-int8": (dict(group=-1), 0.6), "ct-w8a8": ({}, 0.6),
               "fp8": (dict(block=(128, 128)), 0.6)}
    for fmt, (opts, _) in formats.items():
        quantize_model(big, tmp_path / f"big-{fmt}", fmt, **opts)
        quantize_model(small, tmp_path / f"small-{fmt}", fmt, **opts)
    runs = {
        "bf16": (small, big, "torch", "bfloat16"),
        "f32": (small, big, "torch", "float32"),
        "f32-auto": (small, big, "auto", "float32"),
        "f32-onednn": (small, big, "onednn", "float32"),
        **({} if amx() else {"bf16-auto": (small, big, "auto", "bfloat16")}),
        **{fmt: (tmp_path / f"small-{fmt}", tmp_path / f"big-{fmt}", "auto", "bfloat16") for fmt in formats},
    }
    with ThreadPoolExecutor(2) as pool:  # one process per measurement, two at a time
        rss = dict(zip(runs, pool.map(lambda args: grown(*args), runs.values())))
    bf16, f32 = rss["bf16"], rss["f32"]
    assert bf16 > 25e6  # about 15M parameters in bf16
    # a layer on a packed backend keeps its packed copy alone (bf16 on AMX tiles keeps both)
    for backend in ("auto", "onednn"):
        assert rss[f"f32-{backend}"] / f32 <= 1.15, (backend, "float32")
    if not amx():
        assert rss["bf16-auto"] / bf16 <= 1.15, ("auto", "bfloat16")
    for fmt, (_, limit) in formats.items():
        assert rss[fmt] / bf16 <= limit, (fmt, rss[fmt] / bf16)


def _edit(src: Path, dst: Path, tensors=None, config=None) -> str:
    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_quantized_checkpoints_name_the_tensor_or_field(llama_src, tmp_path):
    quantize_model(llama_src, tmp_path / "gptq", "gptq", bits=4, group=32)
    quantize_model(llama_src, tmp_path / "ct", "ct-int4", group=32)
    name = "model.layers.0.self_attn.q_proj"

    def refused(path: str, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            LLM(path, dtype="float32")

    refused(_edit(tmp_path / "gptq", tmp_path / "a", tensors=lambda s: s.pop(name + ".scales")),
            "missing tensor 'layers.0.self_attn.q_proj.scales'")
    refused(_edit(tmp_path / "gptq", tmp_path / "b", tensors=lambda s: s.update({name + ".qweight": s[name + ".qweight"][:4].contiguous()})),
            "layers.0.self_attn.q_proj")
    refused(_edit(tmp_path / "ct", tmp_path / "c", tensors=lambda s: s.update({name + ".weight_packed": s[name + ".weight_packed"][:, :4].contiguous()})),
            r"q_proj.weight_packed: .* does not hold weight_shape")
    refused(_edit(tmp_path / "gptq", tmp_path / "d", config=lambda q: q.update(bits=3)), "bits=3")
    refused(_edit(tmp_path / "ct", tmp_path / "e", config=lambda q: q.update(format="marlin-24")), "format='marlin-24'")
    refused(_edit(tmp_path / "gptq", tmp_path / "f", config=lambda q: q.update(quant_method="bitsandbytes")),
            "quantization 'bitsandbytes' is not supported")
    # compressed-tensors' config, as its own package reads it
    weights = lambda q: q["config_groups"]["group_0"]["weights"]  # noqa: E731
    refused(_edit(tmp_path / "ct", tmp_path / "g", config=lambda q: weights(q).update(num_bits="four")),
            r"quantization_config.config_groups.group_0.weights.num_bits: Input should be a valid integer.* \(got 'four'\)")
    refused(_edit(tmp_path / "ct", tmp_path / "h", config=lambda q: weights(q).update(strategy="block", group_size=None, block_structure=[32, 32])),
            r"config_groups.group_0.weights.strategy='block'")
    refused(_edit(tmp_path / "ct", tmp_path / "i", config=lambda q: q["config_groups"]["group_0"].update(targets=["re:.*mlp.*"])),
            r"layers.0.self_attn.q_proj: stored quantized, but quantization_config's config_groups' targets and ignore "
            "leave it unquantized")
    refused(_edit(tmp_path / "ct", tmp_path / "j", config=lambda q: weights(q).update(symmetric=False)),
            r"q_proj.weight_zero_point: missing")
    # fine-grained FP8
    quantize_model(llama_src, tmp_path / "fp8", "fp8", block=(32, 32))
    refused(_edit(tmp_path / "fp8", tmp_path / "m", tensors=lambda s: s.update({name + ".weight_scale_inv": s[name + ".weight_scale_inv"][:1].contiguous()})),
            r"q_proj.weight_scale_inv: shape \(1, 2\), expected \(2, 2\) for blocks of 32 x 32")
    refused(_edit(tmp_path / "fp8", tmp_path / "n", config=lambda q: q.update(activation_scheme="static")),
            "activation_scheme='static'")
    refused(_edit(tmp_path / "fp8", tmp_path / "o", config=lambda q: q.update(expert_dtype="fp4")), "expert_dtype='fp4'")
    # GPTQModel's dynamic rules
    refused(_edit(tmp_path / "gptq", tmp_path / "k", config=lambda q: q.update(dynamic={r".*mlp.*": {"bits": 2}})),
            r"quantization_config.dynamic\['.\*mlp.\*'\].bits=2")
    refused(_edit(tmp_path / "gptq", tmp_path / "l", config=lambda q: q.update(dynamic={r"-:.*q_proj": {}})),
            r"layers.0.self_attn.q_proj: stored quantized, but quantization_config's dynamic rules leave it")


def test_compressed_tensors_checkpoints_name_the_package_they_need(llama_src, tmp_path, monkeypatch):
    quantize_model(llama_src, tmp_path / "ct", "ct-int4", group=32)
    monkeypatch.setitem(sys.modules, "compressed_tensors.quantization", None)  # not installed
    with pytest.raises(ValueError, match=r"compressed-tensors package: pip install compressed-tensors"):
        LLM(str(tmp_path / "ct"), dtype="float32")
