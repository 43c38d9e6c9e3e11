"""vLLM's offline names: ``EngineArgs`` (with ``add_cli_args`` / ``from_cli_args``), the mapping of
vLLM's ``LLM(...)`` / ``EngineArgs`` keywords onto ``EngineConfig``, and vLLM's prompt dicts.

Every vLLM keyword falls in one of four kinds:

- **mapped** onto a batchgen setting (``swap_space`` -> ``swap_space_gb``, ``enforce_eager`` ->
  ``cuda_graphs``, ``tokenizer`` equal to the model -> the model's own);
- **no effect here** (logging, download and serving options, CUDA-graph capture sizes): accepted
  and ignored silently, whatever the value;
- **would change behaviour** in vLLM but is not honoured here (``kv_cache_dtype``,
  ``cpu_offload_gb``, ``quantization``, ...): accepted, with a warning when its value is not vLLM's
  default;
- **refused** where honouring it is impossible and ignoring it would give other results than the
  user asked for (``tensor_parallel_size > 1``, ``trust_remote_code=True``).

Any other keyword raises ``ValueError`` naming it, with a suggestion when a known name is close.
"""

from __future__ import annotations

import argparse
import difflib
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

from batchgen.config import EngineConfig

# vLLM keywords accepted and ignored, whatever their value: nothing they set exists in an offline
# batch engine without a server, a hub or a compiler cache.
NO_EFFECT = frozenset(
    {
        "disable_log_stats",
        "disable_log_requests",
        "enable_log_requests",
        "served_model_name",
        "load_format",
        "tokenizer_mode",
        "code_revision",
        "hf_token",
        "max_seq_len_to_capture",
        "cuda_graph_sizes",
        "compilation_config",
        "disable_custom_all_reduce",
        "distributed_executor_backend",
        "worker_cls",
        "max_logprobs",
        "disable_async_output_proc",
        "async_scheduling",
        "max_cpu_loras",  # every adapter read stays on the host
        "fully_sharded_loras",
    }
)

# vLLM keywords that would change what vLLM does, with vLLM's default: another value warns that it
# is ignored here, and why.
IGNORED_WITH_WARNING: dict[str, tuple[Any, str]] = {
    "kv_cache_dtype": ("auto", "the KV cache has the model's dtype"),
    "cpu_offload_gb": (0, "weights stay in device memory"),
    "quantization": (None, "a checkpoint's quantization_config is read from its config.json"),
    "enable_chunked_prefill": (True, "long prompts are always prefilled in chunks"),
    "disable_sliding_window": (False, "sliding windows follow the model's config"),
    "enable_sleep_mode": (False, "there is no sleep mode"),
    "speculative_config": (None, "there is no speculative decoding"),
    "hf_overrides": (None, "the config is read as saved"),
    "lora_dtype": ("auto", "adapters run in the model's dtype"),
    "max_num_partial_prefills": (1, "chunked prefills are scheduled by the token budget"),
    "scheduling_policy": ("fcfs", "requests are admitted in prefix order (admission_order)"),
}

# vLLM keywords accepted only at the value batchgen can honour.
ONLY_AT: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (
        1,
        "batchgen runs one engine per device; to use several devices, run a sharded job (run.shard) "
        "or one LLM per device",
    ),
    "pipeline_parallel_size": (1, "batchgen runs one engine per device"),
    "data_parallel_size": (1, "run a sharded job (run.shard) or the Ray executor for data parallelism"),
    "trust_remote_code": (
        False,
        "batchgen runs only the architectures it implements and never executes code from a checkpoint",
    ),
}

RENAMED = {"swap_space": "swap_space_gb"}


def _vllm_default(name: str) -> Any:
    if name in IGNORED_WITH_WARNING:
        return IGNORED_WITH_WARNING[name][0]
    if name in ONLY_AT:
        return ONLY_AT[name][0]
    return None


def from_vllm_kwargs(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``EngineConfig`` keywords from a mix of batchgen's and vLLM's, as described in the module
    docstring. ``None`` for a vLLM keyword means "not given"."""
    config_names = {f.name for f in fields(EngineConfig)} - {"model"}
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in config_names:
            out[key] = value
        elif key in RENAMED:
            if value is not None:
                out[RENAMED[key]] = value
        elif key == "enforce_eager":
            if value is not None:
                out["cuda_graphs"] = not value
        elif key in ONLY_AT:
            allowed, why = ONLY_AT[key]
            if value is not None and value != allowed:
                raise ValueError(f"{key}={value!r}: {why}")
        elif key in IGNORED_WITH_WARNING:
            default, why = IGNORED_WITH_WARNING[key]
            if value is not None and value != default:
                warnings.warn(f"{key}={value!r} is ignored: {why}", UserWarning, stacklevel=3)
        elif key in NO_EFFECT:
            continue
        else:
            known = sorted(config_names | known_vllm_names())
            hint = difflib.get_close_matches(key, known, n=1)
            raise ValueError(
                f"unknown engine setting {key!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; allowed: {', '.join(sorted(config_names))}, and vLLM's {', '.join(sorted(known_vllm_names()))}"
            )
    tokenizer = out.get("tokenizer")
    if tokenizer is not None and Path(tokenizer).resolve() == Path(model).resolve():
        out["tokenizer"] = None
    return out


def known_vllm_names() -> set[str]:
    return set(NO_EFFECT) | set(IGNORED_WITH_WARNING) | set(ONLY_AT) | set(RENAMED) | {"enforce_eager"}


def from_vllm_prompt(prompt: Any) -> Any:
    """vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``) to text or ids."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


@dataclass
class EngineArgs:
    """vLLM's ``EngineArgs``: every ``LLM(...)`` setting as a field, so that vLLM's scripts run with
    only their import changed: ``EngineArgs.add_cli_args(parser)``, ``EngineArgs.from_cli_args(args)``,
    ``LLM(**asdict(engine_args))``, ``LLMEngine.from_engine_args(engine_args)``.

    The first group are ``EngineConfig``'s fields with its defaults (see ``batchgen/config.py``); the
    second vLLM's names, ``None`` meaning "not given" (see the module docstring for what each does).
    """

    model: str = ""
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 4.0
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    preemption_mode: str = "auto"
    swap_space_gb: float = 4.0
    cuda_graphs: bool = True
    num_threads: int | None = None
    adapt_threads: bool = True
    debug_checks: bool = False
    tokenizer: str | None = None
    admission_order: str = "prefix"
    generation_config: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    reasoning_parser: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # vLLM's names
    swap_space: float | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    trust_remote_code: bool | None = None
    kv_cache_dtype: str | None = None
    cpu_offload_gb: float | None = None
    quantization: str | None = None
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool | None = None
    served_model_name: str | None = None
    load_format: str | None = None
    tokenizer_mode: str | None = None
    max_logprobs: int | None = None

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add ``--model``, ``--dtype``, ... (one option per field, dashes or underscores) to an
        ``argparse`` parser or argument group; returns it, as vLLM's does."""
        hints = get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            hint = str(hints[f.name])
            default = f.default if f.default is not MISSING else None
            flag = "--" + f.name.replace("_", "-")
            if "bool" in hint:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                continue
            kind: type = int if "int" in hint else float if "float" in hint else str
            parser.add_argument(flag, type=kind, default=default, metavar=f.name.upper())
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        values = asdict(self)
        model = values.pop("model")
        if not model:
            raise ValueError("EngineArgs.model is required: the path of a local Hugging Face model directory")
        return EngineConfig.from_kwargs(model, **from_vllm_kwargs(model, values))
