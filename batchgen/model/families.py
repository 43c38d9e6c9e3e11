"""The model families batchgen runs, by the ``architectures`` name in ``config.json``, and what
sets each apart from the Llama layout. One decoder (``batchgen/model/decoder.py``) reads these;
everything that a config states (head sizes, windows, soft-capping, RoPE type, expert counts) is
read from the config itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    # Checkpoint names of the four norms around a layer's attention and MLP (None: absent):
    # before attention, after attention, before the MLP, after the MLP.
    norms: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm",
        None,
        "post_attention_layernorm",
        None,
    )
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    qk_norm: str | None = None  # "head": per head (Qwen3, Gemma 3); "full": over all heads (OLMo 2)
    qkv_fused: bool = False  # Phi-3: one qkv_proj and one gate_up_proj in the checkpoint
    moe: str | None = None  # the router / expert layout: mixtral, qwen2_moe, qwen3_moe, gpt_oss
    sinks: bool = False  # gpt-oss: a learned logit per head in the softmax denominator


_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

LLAMA = Family("llama")
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2"),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm="head"),
    "Gemma2ForCausalLM": Family("gemma2", norms=_SANDWICH, norm_offset=1.0, embed_scale=True),
    "Gemma3ForCausalLM": Family("gemma3", norms=_SANDWICH, norm_offset=1.0, embed_scale=True, qk_norm="head"),
    "Phi3ForCausalLM": Family("phi3", qkv_fused=True),
    "Olmo2ForCausalLM": Family(
        "olmo2", norms=(None, "post_attention_layernorm", None, "post_feedforward_layernorm"), qk_norm="full"
    ),
    "MixtralForCausalLM": Family("mixtral", moe="mixtral"),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", moe="qwen2_moe"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", moe="qwen3_moe", qk_norm="head"),
    "GptOssForCausalLM": Family("gpt_oss", moe="gpt_oss", sinks=True),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of(config) -> Family:
    for arch in getattr(config, "architectures", None) or []:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ValueError(
        f"unsupported architecture {getattr(config, 'architectures', None) or config.model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
