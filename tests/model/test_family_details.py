"""What some families load or compute beyond the common path: Phi-3's LongRoPE switching
frequencies at ``original_max_position_embeddings``, gpt-oss's MXFP4 expert weights, and the
errors for what batchgen does not run."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.model import mxfp4
from batchgen.model.families import SUPPORTED_ARCHITECTURES
from batchgen.model.loader import ModelLoadError
from batchgen.tiny import make_model
from batchgen_kernels.cpu_gemm import PackedBytes
from scripts.fixtures.quant import quantize_gpt_oss_mxfp4
from tests.oracle import hf_greedy, hf_model

_rng = random.Random(9)


def longrope_model(tmp_path: Path) -> str:
    """Phi-3 with LongRoPE: partial rotary (half of each 16-channel head: 4 factors per set),
    switching to the long factors past 32 positions."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.3, 2.1, 3.0],
        "long_factor": [2.0, 5.0, 11.0, 23.0],
        "original_max_position_embeddings": 32,
    }
    return str(
        make_model(
            tmp_path / "phi3-long",
            "phi3",
            seed=3,
            max_positions=256,
            rope_parameters=rope,
            original_max_position_embeddings=32,
        )
    )


@torch.no_grad()
def hf_generate(path: str, prompt: list[int], max_new: int) -> tuple[list[int], float]:
    """transformers' greedy ``generate`` (with its KV cache): tokens and their summed log-probability."""
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprob = sum(float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens))
    return tokens, logprob


def test_longrope_switches_like_transformers_generate(tmp_path):
    """A 20-token prompt starts with the short factors and crosses 32 while decoding, where its KV
    is recomputed with the long ones (as transformers ``generate`` drops its cache there); a
    40-token prompt uses the long ones throughout. Tokens and log-probabilities equal ``generate``'s,
    whole or chunked prompts, and a long prompt that starts like a short one does not reuse the
    short one's cached blocks."""
    path = longrope_model(tmp_path)
    start = [_rng.randrange(3, 384) for _ in range(16)]
    short = start + [_rng.randrange(3, 384) for _ in range(4)]
    long = start + [_rng.randrange(3, 384) for _ in range(24)]
    want = [hf_generate(path, p, 20) for p in (short, long)]
    # the switch matters: the short factors kept past 32 positions give other tokens
    llm = LLM(path, dtype="float32", device="cpu")
    llm.engine.scheduler.rope_switch = None
    kept = llm.generate([short], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert kept.token_ids != want[0][0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for kwargs in (dict(), dict(max_num_batched_tokens=8, block_size=8)):
        for order in ((0, 1), (1, 0)):
            llm = LLM(path, dtype="float32", device="cpu", **kwargs)
            cached = []
            for i in order:
                out = llm.generate([(short, long)[i]], params)[0]
                assert out.outputs[0].token_ids == want[i][0], (i, kwargs)
                assert abs(out.outputs[0].cumulative_logprob - want[i][1]) < 1e-4, (i, kwargs)
                cached.append(out.num_cached_tokens)
            assert llm.stats()["rope_recomputes"] == 1
            # The shared 16-token start: the long prompt reuses the short one's blocks once they
            # were recomputed with the long factors; the short prompt never reuses long blocks.
            bs = llm.engine.block_size
            assert cached == ([0, 16 // bs * bs] if order == (0, 1) else [0, 0]), (order, kwargs)


def quantize_experts(src: Path, dst: Path) -> None:
    """A gpt-oss checkpoint with MXFP4 experts in ``dst``; ``src`` rewritten with the dequantized values."""
    dequantized = quantize_gpt_oss_mxfp4(src, dst)
    save_file({**load_file(src / "model.safetensors"), **dequantized}, src / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_experts_dequantize_like_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 64)  # groups of very different scales
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    ours = mxfp4.dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)
    assert (ours - weight).abs().max() <= weight.abs().amax(-1, keepdim=True).max() / 4  # FP4 rounding

    float_dir = make_model(tmp_path / "gpt-oss", "gpt_oss", seed=5)
    quantize_experts(float_dir, tmp_path / "gpt-oss-mxfp4")
    prompts = [[5, 9, 11], [_rng.randrange(3, 384) for _ in range(30)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tmp_path / "gpt-oss-mxfp4"), dtype="float32", device="cpu")
    for p, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(str(float_dir), p, 8)
    # the experts stay MXFP4: half a byte a weight and a scale per 32, no dequantized copy
    model = llm.engine.runner.model
    experts = [layer for layer in model.linears if getattr(layer, "path", "dense") != "dense"]
    config = model.config
    assert len(experts) == 2 * config.num_local_experts * config.num_hidden_layers
    on_kernel = PackedBytes.of(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.ones(1), None, torch.float32)
    assert {layer.path for layer in experts} == {"mxfp4-weight" if on_kernel is not None else "reference"}
    assert llm.stats()["quantization"] == "mxfp4"
    for layer in experts:
        held = layer._fast.packed if on_kernel is not None else layer.qw.q
        assert held.dtype == torch.uint8 and held.numel() <= (layer.out_features + 15) // 16 * 16 * layer.in_features / 2


def test_what_is_not_supported_is_named(tmp_path, llama_dir):
    odd = tmp_path / "odd"
    shutil.copytree(llama_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as e:
        LLM(str(odd))
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantization 'bitsandbytes' is not supported"):
        LLM(str(odd))
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}  # but dense tensors
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="says gptq, but no projection is stored quantized"):
        LLM(str(odd))
    bidirectional = make_model(tmp_path / "g3", "gemma3", use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        LLM(str(bidirectional))
