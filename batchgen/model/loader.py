"""Load a local Hugging Face model directory: config via ``AutoConfig``, tokenizer via
``AutoTokenizer``, weights from safetensors (one file or a sharded index; ``pytorch_model*.bin``
as a fallback). Every failure names the directory, file or tensor at fault."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from batchgen.model.families import family_of


class ModelLoadError(ValueError):
    """The model directory cannot be used; the message says why."""


def load_config(model_dir: str | os.PathLike):
    from transformers import AutoConfig

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist (batchgen loads local directories only)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise ModelLoadError(f"cannot read the config in {str(path)!r}: {e}") from e
    try:
        family_of(config)
    except ValueError as e:
        raise ModelLoadError(f"{e} (in {str(path)!r})") from None
    return config


# Files one of which a tokenizer directory holds (fast, sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def tokenizer_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` cannot hold a tokenizer, or None: without any tokenizer file transformers
    would try to convert a slow tokenizer and fail with a message about missing packages."""
    path = Path(directory)
    if not path.is_dir():
        return f"tokenizer directory {str(path)!r} does not exist"
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return None
    return (
        f"no tokenizer in {str(path)!r}: expected tokenizer.json or tokenizer_config.json (or a "
        "sentencepiece tokenizer.model); give the directory of the model's tokenizer as "
        "engine.tokenizer in a job, or LLM(..., tokenizer=...)"
    )


def load_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    problem = tokenizer_problem(model_dir)
    if problem is not None:
        raise ModelLoadError(problem)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a tokenizer from {str(model_dir)!r}: {e}") from e


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"corrupt weight index {str(index)!r}: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"weight index {str(index)!r} names missing shard(s): {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if found:
        return found
    raise ModelLoadError(
        f"model directory {str(path)!r} has no weights (*.safetensors or pytorch_model*.bin)"
    )


def iter_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, one file at a time."""
    from safetensors import safe_open

    for file in weight_files(model_dir):
        if file.suffix == ".bin":
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read weights file {str(file)!r}: {e}") from e
