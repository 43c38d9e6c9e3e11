"""Models, tokenizers and LoRA adapters named by Hugging Face hub id (``Qwen/Qwen3-0.6B``),
resolved through ``huggingface_hub`` and its cache, as transformers and vLLM resolve them.

A name that is a local directory is taken as it is. Anything else is a repository id: its snapshot
in the cache (``HF_HOME`` / ``HF_HUB_CACHE``, or ``download_dir``) is used when present at the
revision asked (a branch or tag through ``refs/``, or a commit hash); otherwise, when the hub is
reachable and ``HF_HUB_OFFLINE`` is not set, ``snapshot_download`` fetches the files a model needs
(configs, tokenizer files, safetensors weights) with its progress bar. A name that is neither is a
``ValueError`` of one line naming it, the revision and the cache. The snapshot's directory name is
the commit hash, which a job's fingerprint records.
"""

from __future__ import annotations

from pathlib import Path

from batchgen.model.loader import ModelLoadError

# what a model, its tokenizer or an adapter reads (no PyTorch .bin, no other frameworks' weights)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


def local_dir(name: str, revision: str | None = None, what: str = "model", cache_dir: str | None = None) -> str:
    """The local directory of ``name``: itself when it is a directory, else its hub snapshot."""
    if Path(name).is_dir():
        if revision is not None:
            raise ModelLoadError(f"{what} {name!r} is a local directory; a revision ({revision!r}) applies to hub ids only")
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    at = f" at revision {revision!r}" if revision else ""
    if not is_hub_id(name):
        raise ModelLoadError(f"{what} directory {name!r} does not exist (and it is not a hub id, org/name)")
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        return snapshot_download(
            name, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS,
            local_files_only=constants.HF_HUB_OFFLINE,
        )
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is not reachable"
        raise ModelLoadError(
            f"{what} {name!r}{at} is not a directory and not in the Hugging Face cache ({cache}), and "
            f"{offline}: download it where the hub is reachable (hf download {name})"
        ) from None
    except Exception as e:  # noqa: BLE001 - huggingface_hub's HTTP and repository errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{what} {name!r}{at}: {type(e).__name__}: {first}") from None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a hub repository id (``org/name`` or ``name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_revision(directory: str) -> str | None:
    """The commit hash of a hub cache snapshot directory (``.../snapshots/HASH``), else None."""
    path = Path(directory)
    return path.name if path.parent.name == "snapshots" else None
