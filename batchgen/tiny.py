"""Build small random-weight models of the supported architectures in a local directory, with a
byte-level BPE tokenizer and a chat template, through ``save_pretrained``. Used by the demo, the
tests and the benchmarks (no model hub is ever contacted). The benchmark models that
``batchgen make-model --bench`` writes are here too; the other benchmark builders, LoRA adapters and
quantized checkpoints, which only the tests and scripts use, are in ``scripts/fixtures/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = """\
batchgen turns a dataset of prompts into a dataset of generations. The engine keeps the KV cache
in fixed-size blocks, shares blocks copy-on-write between samples, beams and requests whose prompts
start alike, and keeps the batch full with continuous batching. The quick brown fox jumps over the
lazy dog. Translate to French: the cat sat on the mat. Question: what is two plus two? Answer: four.
Once upon a time there was a small model with random weights that spoke in riddles and numbers.
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # the Llama family
FAMILY_ARCHS = ("gemma2", "gemma3", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
ALL_ARCHS = ARCHS + FAMILY_ARCHS
ARCHITECTURE_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def _gpt_oss_swiglu_limit() -> float:
    """1.0, low enough for gpt-oss's clamps to act on random weights; 7.0 (the value of every real
    checkpoint) where the installed transformers fixes the clamp at 7.0 and ignores the config's
    field (``GptOssConfig`` without ``swiglu_limit``), so that the model means the same to both."""
    from transformers import GptOssConfig

    return 1.0 if hasattr(GptOssConfig(), "swiglu_limit") else 7.0


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (specials <pad>=0, <s>=1, </s>=2) with at most ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 3 + 256),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _family_defaults(
    arch: str, num_layers: int, head_dim: int, rope_parameters: dict | None
) -> dict[str, Any]:
    """What makes a small model of ``arch`` exercise its family's features: sliding windows
    shorter than the tests' prompts, soft-caps that bite at these weights' scale, dense and sparse
    layers side by side, a few experts."""
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    experts = dict(num_experts_per_tok=2)
    if arch == "gemma2":
        return dict(
            sliding_window=12,
            layer_types=alternating,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "gemma3":
        return dict(
            sliding_window=12,
            layer_types=alternating,
            query_pre_attn_scalar=24,
            rope_parameters=rope_parameters
            or {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    if arch == "phi3":
        return dict(rope_parameters=rope_parameters or {"rope_type": "default", "partial_rotary_factor": 0.5})
    if arch == "mixtral":
        return dict(num_local_experts=4, **experts)
    if arch == "qwen2_moe":  # layer 1 dense through mlp_only_layers
        return dict(
            num_experts=6,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **experts,
        )
    if arch == "qwen3_moe":  # layer 0 dense through decoder_sparse_step
        return dict(
            num_experts=8, moe_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=True, **experts
        )
    if arch == "gpt_oss":
        return dict(
            num_local_experts=4,
            sliding_window=12,
            layer_types=alternating,
            swiglu_limit=_gpt_oss_swiglu_limit(),
            rope_parameters=rope_parameters
            or {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 256,
                "rope_theta": 150000.0,
            },
            **experts,
        )
    return {}


def make_config(
    arch: str = "llama",
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 1024,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.2,
    rope_parameters: dict | None = None,
    head_dim: int | None = None,
    **extra: Any,
):
    """A transformers config of ``arch`` (see ``ALL_ARCHS``); ``extra`` overrides family settings."""
    import transformers as tf

    cls = {
        "llama": tf.LlamaConfig,
        "mistral": tf.MistralConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "gemma2": tf.Gemma2Config,
        "gemma3": tf.Gemma3TextConfig,
        "phi3": tf.Phi3Config,
        "olmo2": tf.Olmo2Config,
        "mixtral": tf.MixtralConfig,
        "qwen2_moe": tf.Qwen2MoeConfig,
        "qwen3_moe": tf.Qwen3MoeConfig,
        "gpt_oss": tf.GptOssConfig,
    }
    if arch not in cls:
        raise ValueError(f"arch must be one of {', '.join(ALL_ARCHS)}, got {arch!r}")
    head_dim = head_dim or hidden_size // num_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        head_dim=head_dim,
    )
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(_family_defaults(arch, num_layers, head_dim, rope_parameters))
    kwargs.update(extra)
    config = cls[arch](**kwargs)
    config.architectures = [ARCHITECTURE_NAMES[arch]]
    return config


def make_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer_vocab: int | None = None,
    **config_kwargs,
) -> Path:
    """Write a random-weight model of ``arch`` (one of ``ALL_ARCHS``) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = make_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    build_tokenizer(min(tokenizer_vocab or config.vocab_size, 512)).save_pretrained(str(path))
    (path / "batchgen_model.json").write_text(
        json.dumps({"arch": arch, "seed": seed, **config_kwargs}, default=str)
    )
    return path


BENCH_SHAPE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    max_positions=4096,
    initializer_range=0.02,
)


def make_bench_model(path: str | Path, max_positions: int = 4096) -> Path:
    """docs/benchmarks.md "bench-56m": Llama, vocab 32000, hidden 512, 8 layers, 8 heads, 2 KV heads
    (``max_positions=32768``: workload L's long-context variant, the same weights)."""
    return make_model(path, "llama", seed=0, **{**BENCH_SHAPE, "max_positions": max_positions})


def make_bench_moe_model(path: str | Path) -> Path:
    """docs/benchmarks.md "M": Qwen3-MoE of bench-56m's size, vocab 32000, hidden 512, 8 layers, 8 heads,
    2 KV heads, 16 experts of 384, top-4 (so 4 x 384 = 1536 active, bench-56m's MLP width)."""
    return make_model(
        path,
        "qwen3_moe",
        seed=0,
        **BENCH_SHAPE,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=384,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
