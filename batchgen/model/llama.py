"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) as plain tensors,
running over a flattened batch of tokens (no padding) with a paged KV cache.

q/k/v and gate/up projections are fused into one matrix each at load time (fewer, larger GEMMs),
and on the CPU every projection is packed for oneDNN's GEMM (``batchgen/model/linear.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.model.attention import AttentionBackend, AttentionMetadata
from batchgen.model.layers import Rotary, apply_rotary, rms_norm
from batchgen.model.linear import Linear, packing_wanted
from batchgen.model.loader import ModelLoadError, iter_weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    sliding_window: int | None


class LlamaModel:
    def __init__(
        self,
        config,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        linear_backend: str = "auto",
    ) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rotary = Rotary(config, max_positions, device, dtype)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} (only silu)")
        self._pack = packing_wanted(linear_backend, device, dtype)
        self._strict = linear_backend == "onednn"
        self._load(model_dir)

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, pack=self._pack, strict=self._strict)

    # -- loading -------------------------------------------------------------------------------
    def _windows(self) -> list[int | None]:
        c = self.config
        window = getattr(c, "sliding_window", None)
        if window is None or getattr(c, "use_sliding_window", True) is False:
            return [None] * self.num_layers
        types = getattr(c, "layer_types", None)
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [window] * self.num_layers

    def _load(self, model_dir: str) -> None:
        w: dict[str, torch.Tensor] = {}
        for name, tensor in iter_weights(model_dir):
            if name.startswith("model."):
                name = name[len("model.") :]
            w[name] = tensor

        def take_optional(name: str) -> torch.Tensor | None:
            t = w.pop(name, None)
            return None if t is None else t.to(device=self.device, dtype=self.dtype).contiguous()

        def take(name: str) -> torch.Tensor:
            t = take_optional(name)
            if t is None:
                raise ModelLoadError(f"checkpoint in {model_dir!r} is missing tensor {name!r}")
            return t

        self.embed = take("embed_tokens.weight")
        windows = self._windows()
        self.layers = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            q, k, v = (take(p + f"self_attn.{x}_proj.weight") for x in "qkv")
            biases = [take_optional(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            present = [b for b in biases if b is not None]
            bias = torch.cat(present) if len(present) == len(biases) else None
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=self._linear(torch.cat([q, k, v]).contiguous(), bias),
                    o_proj=self._linear(take(p + "self_attn.o_proj.weight")),
                    q_norm=take_optional(p + "self_attn.q_norm.weight"),
                    k_norm=take_optional(p + "self_attn.k_norm.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=self._linear(
                        torch.cat(
                            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                        ).contiguous()
                    ),
                    down=self._linear(take(p + "mlp.down_proj.weight")),
                    sliding_window=windows[i],
                )
            )
        self.norm = take("norm.weight")
        lm_head = w.pop("lm_head.weight", None)
        if lm_head is None:
            if not getattr(self.config, "tie_word_embeddings", False):
                raise ModelLoadError(f"checkpoint in {model_dir!r} is missing tensor 'lm_head.weight'")
            self.lm_head = self._linear(self.embed)
        else:
            self.lm_head = self._linear(lm_head.to(device=self.device, dtype=self.dtype).contiguous())

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,  # [layers, 2 (K, V), kv_heads, num_blocks + 1, block_size, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm for every token of the flattened batch."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(positions)
        t = x.shape[0]
        for i, lw in enumerate(self.layers):
            residual = x
            y = rms_norm(x, lw.input_norm, self.eps)
            qkv = lw.qkv(y)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            if lw.q_norm is not None and lw.k_norm is not None:
                q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
                q = apply_rotary(rms_norm(q, lw.q_norm, self.eps), cos, sin)
                k = apply_rotary(rms_norm(k, lw.k_norm, self.eps), cos, sin)
            else:  # q and k side by side in qkv: rotate both in one pass
                qk = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)
                q, k = qk[:, :h], qk[:, h:]
            o = backend.forward(q, k, v, kv_cache[i, 0], kv_cache[i, 1], meta, self.scale, lw.sliding_window)
            x = residual + lw.o_proj(o.reshape(t, h * d))
            residual = x
            y = rms_norm(x, lw.post_norm, self.eps)
            gate, up = lw.gate_up(y).chunk(2, dim=-1)
            x = residual + lw.down(F.silu(gate) * up)
        return rms_norm(x, self.norm, self.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
