"""Shared fixtures: small random-weight models of each architecture, built once per session with
``save_pretrained``, and the transformers oracle on the same weights."""

from __future__ import annotations

import os

import pytest
import torch

from batchgen.tiny import ARCHS, make_model
from scripts.fixtures.models import make_adapter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny model per architecture (vocab 384, 2 layers); qwen2 carries qkv bias, qwen3 q/k norm."""
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(root / arch, arch, seed=i)) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def beam_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Small-vocabulary models (24 tokens, EOS = 2) so that EOS ends beams at different steps."""
    root = tmp_path_factory.mktemp("beam_models")
    return {
        arch: str(make_model(root / arch, arch, seed=10 + i, vocab_size=24, initializer_range=0.3))
        for i, arch in enumerate(ARCHS)
    }


@pytest.fixture(scope="session")
def head64_dir(tmp_path_factory) -> str:
    """Head size 64, 4 query heads per KV head: the compiled decode and prefill kernels' vector paths
    (on the bf16 dot instruction where the CPU has it); the tiny models' head size 16 takes their
    general loops or torch's kernel."""
    return str(
        make_model(
            tmp_path_factory.mktemp("h64") / "m",
            "llama",
            seed=5,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=1,
        )
    )


@pytest.fixture(scope="session")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    """Three adapters of the tiny Llama: ranks 4, 8 and 16 with different alphas, one rsLoRA, one on
    the attention projections only with a per-module alpha."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r4": str(make_adapter(root / "r4", llama_dir, rank=4, alpha=8, seed=1, scale=0.15)),
        "r8": str(
            make_adapter(root / "r8", llama_dir, rank=8, alpha=32, seed=2, scale=0.1, use_rslora=True)
        ),
        "r16": str(
            make_adapter(
                root / "r16", llama_dir, rank=16, alpha=16, seed=3, scale=0.1,
                targets=["q_proj", "k_proj", "v_proj", "o_proj"], alpha_pattern={"v_proj": 48},
            )
        ),
    }


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 for the session (scripts/fixtures/s3server.py)."""
    from scripts.fixtures.s3server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()
