"""Engine configuration: one frozen dataclass, validated with errors that name the bad key."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Built by ``LLM(...)`` from its keyword arguments.

    ``num_kv_blocks`` pins the KV pool size (tests use tiny pools); when None the pool is sized
    from ``kv_cache_memory_gb`` (CPU) or ``gpu_memory_utilization`` (CUDA).
    ``max_model_len`` defaults to the model's ``max_position_embeddings``.
    ``max_num_batched_tokens`` is the token budget of one step; longer prompts are prefilled in chunks.
    ``linear_backend``: "auto" packs CPU weights for the compiled GEMM kernel, else for oneDNN's
    GEMM (oneDNN first for bfloat16 on a CPU with AMX; ``batchgen/model/linear.py``); "cpu" and
    "onednn" take that one or fail loudly where it cannot run; "torch" keeps ``F.linear``.
    ``preemption_mode``: "recompute" frees a preempted group's blocks and computes them again later;
    "swap" moves them to a host pool of ``swap_space_gb`` (pinned memory on CUDA) and back, falling
    back to recompute when that pool is full; "auto" swaps on CUDA and recomputes on the CPU (where
    the "host" is the same memory).
    ``cuda_graphs``: on CUDA with the Triton backend, decode steps of up to 256 sequences replay
    graphs captured at bucketed batch sizes (``batchgen/model/graphs.py``).
    ``admission_order``: "prefix" admits the requests of one ``generate`` call (or a job's lookahead
    window) so that those sharing a prompt prefix run together (``batchgen/engine/admission.py``),
    and computes identical deterministic requests once; "input" admits them in the order given.
    ``enable_lora``: requests may run on LoRA adapters (``batchgen/model/lora.py``); at most
    ``max_loras`` of them are resident and run in one step, each of rank at most ``max_lora_rank``.
    """

    model: str
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
    num_threads: int | None = None  # default: the CPUs this process may use (batchgen/cpus.py)
    adapt_threads: bool = True  # fewer threads while other processes use this process's CPUs
    debug_checks: bool = False
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    admission_order: str = "prefix"  # "prefix": rows sharing a prefix run together; "input"
    generation_config: str = "auto"  # LLM.get_default_sampling_params: "auto" (the model's), "vllm" (none), a directory
    enable_lora: bool = False  # requests may name a LoRA adapter (``LoRARequest``)
    max_loras: int = 1  # adapters resident at once (and run in one step)
    max_lora_rank: int = 16  # the largest rank an adapter may have
    # split each completion into its reasoning and its answer (batchgen/reasoning.py): qwen3,
    # deepseek_r1, gpt_oss (vLLM's names); grammars then constrain the answer only
    reasoning_parser: str | None = None
    # a hub id's revision (a branch, tag or commit hash) for the model and the tokenizer, and the
    # hub cache to look in (default: huggingface_hub's, HF_HOME / HF_HUB_CACHE); batchgen/model/hub.py
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None

    def __post_init__(self) -> None:
        def bad(key: str, rule: str) -> ValueError:
            return ValueError(f"engine setting {key} must be {rule}, got {getattr(self, key)!r}")

        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise bad("dtype", "one of auto, float32, float16, bfloat16")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise bad("device", "one of auto, cpu, cuda, cuda:N")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise bad("block_size", "one of 8, 16, 32, 64, 128")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "an integer >= 1")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise bad("max_model_len", "an integer >= 1 or None")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise bad("num_kv_blocks", "an integer >= 2 or None")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.kv_cache_memory_gb <= 0:
            raise bad("kv_cache_memory_gb", "> 0")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise bad("attention_backend", "one of auto, torch, cpu, triton")
        if self.linear_backend not in ("auto", "cpu", "onednn", "torch"):
            raise bad("linear_backend", "one of auto, cpu, onednn, torch")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise bad("preemption_mode", "one of auto, recompute, swap")
        if not self.swap_space_gb > 0:
            raise bad("swap_space_gb", "> 0")
        if self.admission_order not in ("prefix", "input"):
            raise bad("admission_order", "one of prefix, input")
        for key in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, key), int) or isinstance(getattr(self, key), bool) or getattr(self, key) < 1:
                raise bad(key, "an integer >= 1")
        if self.reasoning_parser is not None:
            from batchgen.reasoning import parser_names  # noqa: PLC0415

            if self.reasoning_parser not in parser_names():
                raise bad("reasoning_parser", f"one of {', '.join(parser_names())} or None")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad("generation_config", "auto, vllm or a directory holding generation_config.json")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in names:
                raise ValueError(
                    f"unknown engine setting {key!r}; allowed: {', '.join(sorted(names - {'model'}))}"
                )
        return cls(model=model, **kwargs)
