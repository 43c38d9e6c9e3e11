"""Loading local checkpoints: sharded safetensors, tied embeddings, llama3 RoPE scaling, and errors
that name what is wrong. Also: batchgen's top-level ``kernels`` package does not confuse transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from batchgen import LLM, SamplingParams
from batchgen.model.loader import ModelLoadError
from batchgen.tiny import make_model
from tests.oracle import hf_greedy

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]


def greedy(path, **kw):
    llm = LLM(str(path), dtype="float32", device="cpu", **kw)
    return (
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )


def test_sharded_checkpoint(tmp_path):
    path = make_model(tmp_path / "sharded", "llama", seed=5, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert greedy(path) == hf_greedy(str(path), PROMPT, 8)


def test_tied_embeddings_and_llama3_rope(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    path = make_model(tmp_path / "tied", "llama", seed=6, tie_word_embeddings=True, rope_parameters=rope)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    assert greedy(path) == hf_greedy(str(path), PROMPT, 8)


def test_linear_rope_qwen2(tmp_path):
    path = make_model(
        tmp_path / "lin",
        "qwen2",
        seed=7,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    assert greedy(path) == hf_greedy(str(path), PROMPT, 8)


def test_errors_name_what_is_wrong(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    empty = tmp_path / "noweights"
    shutil.copytree(llama_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no weights"):
        LLM(str(empty))
    gpt = tmp_path / "gpt"
    shutil.copytree(llama_dir, gpt)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(gpt))
    missing = tmp_path / "missing"
    shutil.copytree(llama_dir, missing)
    from safetensors.torch import load_file, save_file

    state = load_file(str(missing / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensor 'layers.1.mlp.down_proj.weight'"):
        LLM(str(missing))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(llama_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read weights file"):
        LLM(str(corrupt))
