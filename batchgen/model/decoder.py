"""The decoder of every supported family (``batchgen/model/families.py``) as plain tensors,
running over a flattened batch of tokens (no padding) with a paged KV cache.

One layer is: optional norms before and after attention and before and after the MLP (Llama
normalizes before each, Gemma before and after, OLMo 2 after), attention with optional q/k norms,
per-layer RoPE tables, sliding windows, soft-capping and sinks, then a dense gated MLP or a
mixture of experts. q/k/v and gate/up projections are fused into one matrix each at load time
(fewer, larger GEMMs), and on the CPU every projection is packed for oneDNN's GEMM
(``batchgen/model/linear.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from batchgen.model import layers
from batchgen.model.attention import AttentionBackend, AttentionMetadata, LayerAttention
from batchgen.model.families import family_of
from batchgen.model.layers import ACTIVATIONS, Rotary, add_rms_norm, apply_rotary, rms_norm
from batchgen.model.linear import Linear, backends_for
from batchgen.model.loader import ModelLoadError, iter_weights
from batchgen.model.lora import LoRABatch
from batchgen.model.moe import (
    Expert,
    MoE,
    clamped_swiglu,
    dense_unit,
    softmax_then_topk,
    topk_then_softmax,
)
from batchgen.model.quant import ConcatLinear, QuantError, QuantFormat, QuantLinear, QWeight


@dataclass
class LayerWeights:
    norms: tuple[torch.Tensor | None, ...]  # before / after attention, before / after the MLP
    qkv: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn: LayerAttention
    rotary: Rotary
    mlp: Callable[..., torch.Tensor]  # (x) for a MoE; (x, lora=None) for a dense MLP


class _Weights:
    """The checkpoint's tensors by name (``model.`` stripped), taken once each, cast on the way."""

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> None:
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.w: dict[str, torch.Tensor] = {}
        for name, tensor in iter_weights(model_dir):
            self.w[name.removeprefix("model.")] = tensor

    def has(self, name: str) -> bool:
        return name in self.w

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.w:
            raise ModelLoadError(f"checkpoint in {self.model_dir!r} is missing tensor {name!r}")
        return self.w.pop(name)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.w else None

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor cast (to the model's dtype by default), as a copy of its own: one left a view
        of the file would keep the whole file's mapping (and every page of it read so far) alive
        as long as it lives."""
        raw = self.raw(name)
        t = raw.to(device=self.device, dtype=dtype or self.dtype).contiguous()
        return t.clone() if t.data_ptr() == raw.data_ptr() else t


class DecoderModel:
    def __init__(
        self,
        config,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        linear_backend: str = "auto",
    ) -> None:
        self.config = c = config
        try:
            self.family = family_of(config)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        self.device, self.dtype = device, dtype
        self.num_layers = c.num_hidden_layers
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.eps = c.rms_norm_eps
        self.final_softcap = getattr(c, "final_logit_softcapping", None)
        if getattr(c, "use_bidirectional_attention", False):
            raise ModelLoadError("use_bidirectional_attention=True (an embedding model) cannot generate")
        quant = getattr(c, "quantization_config", None)
        self.quant_method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if self.quant_method == "mxfp4" and self.family.moe != "gpt_oss":
            raise ModelLoadError("quantization 'mxfp4' is supported on gpt-oss's experts only")
        try:
            self.quant = QuantFormat.of(quant)  # GPTQ, AWQ, compressed-tensors: kept quantized (quant.py)
        except QuantError as e:
            raise ModelLoadError(str(e)) from None
        act_name = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
        if act_name not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {act_name!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act_name]
        self._max_positions = max_positions
        self._rotaries: dict[str | None, Rotary] = {}
        self._layer_caches: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.linears: list = []  # every projection, expert and router, and the LM head (Linear or quantized)
        self._backends = backends_for(linear_backend, device, dtype)
        self._strict = linear_backend in ("cpu", "onednn")
        self.gate_up_fused = False  # the checkpoint stores gate_up_proj (Phi-3)
        self._load(model_dir)
        if self.quant is not None and not any(hasattr(layer, "path") for layer in self.linears):
            raise ModelLoadError(
                f"quantization_config in {model_dir!r} says {self.quant.method}, but no projection is stored "
                "quantized (e.g. layers.0.self_attn.q_proj.qweight / .weight_packed / .weight_scale)"
            )
        self._moe_blocks = [lw.mlp for lw in self.layers if isinstance(lw.mlp, MoE)]
        # LongRoPE's switch length: the runner then provides each token's ``rope_lengths``.
        self.long_rope_after = next((r.long_after for r in self._rotaries.values() if r.long_after), None)

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> Linear:
        layer = Linear(weight, bias, backends=self._backends, strict=self._strict, gated=gated)
        self.linears.append(layer)
        return layer

    def _projection(
        self, w: _Weights, names: list[str], biases: list[torch.Tensor | None] | None = None, gated: bool = False
    ) -> Any:
        """The projections ``names`` (tensor names without ``.weight``) as one layer, their outputs
        stacked in order: quantized ones kept quantized (``quant.py``), others packed (``Linear``)."""
        biases = biases or [None] * len(names)
        present = [b for b in biases if b is not None]
        bias = (torch.cat(present) if len(present) == len(names) else None) if present else None
        if self.quant is not None and self.quant.is_quantized(w.has, names[0]):
            try:
                # copies: a tensor kept as read would keep the checkpoint file's pages mapped
                parts = [self.quant.read(lambda t: w.raw(t).clone(), w.has, n) for n in names]
            except QuantError as e:
                raise ModelLoadError(f"checkpoint in {w.model_dir!r}: {e}") from None
            fused = QWeight.concat(parts) if len(parts) > 1 else parts[0]
            layer: Any
            if fused is not None:
                layer = QuantLinear(fused, bias, self.device, self.dtype)
            else:
                layer = ConcatLinear([QuantLinear(p, b, self.device, self.dtype) for p, b in zip(parts, biases, strict=True)])
            self.linears.append(layer)
            return layer
        weights = [w.take(n + ".weight") for n in names]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights).contiguous()
        return self._linear(weight, bias, gated)

    # -- per-layer settings from the config -----------------------------------------------------
    def _layer_types(self) -> list[str | None]:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types else [None] * self.num_layers

    def _windows(self) -> list[int | None]:
        c = self.config
        window = getattr(c, "sliding_window", None)
        if window is None or getattr(c, "use_sliding_window", True) is False:
            return [None] * self.num_layers
        types = getattr(c, "layer_types", None)
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [window] * self.num_layers

    def _rotary(self, layer_type: str | None) -> Rotary:
        params = getattr(self.config, "rope_parameters", None) or {}
        key = layer_type if layer_type in params else None  # Gemma 3: RoPE per layer type
        if key not in self._rotaries:
            self._rotaries[key] = Rotary(self.config, self._max_positions, self.device, self.dtype, key)
        return self._rotaries[key]

    def _sparse(self, i: int) -> bool:
        c, moe = self.config, self.family.moe
        if moe in ("qwen2_moe", "qwen3_moe"):
            return (
                i not in (getattr(c, "mlp_only_layers", None) or [])
                and c.num_experts > 0
                and (i + 1) % getattr(c, "decoder_sparse_step", 1) == 0
            )
        return moe is not None

    # -- loading -------------------------------------------------------------------------------
    def _load(self, model_dir: str) -> None:
        w = _Weights(model_dir, self.device, self.dtype)
        fam, c = self.family, self.config
        self.embed: torch.Tensor | None = w.take("embed_tokens.weight")
        self.embed_scale = (
            torch.tensor(self.hidden_size**0.5, dtype=self.dtype, device=self.device) if fam.embed_scale else None
        )
        scale = (getattr(c, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        softcap = getattr(c, "attn_logit_softcapping", None)
        windows, types = self._windows(), self._layer_types()
        self.layers = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            if fam.qkv_fused:
                qkv = self._projection(w, [a + "qkv_proj"], [w.optional(a + "qkv_proj.bias")])
            else:
                qkv = self._projection(
                    w, [a + f"{x}_proj" for x in "qkv"], [w.optional(a + f"{x}_proj.bias") for x in "qkv"]
                )
            sinks = w.take(a + "sinks", torch.float32) if fam.sinks else None
            self.layers.append(
                LayerWeights(
                    norms=tuple(None if n is None else w.take(p + n + ".weight") for n in fam.norms),
                    qkv=qkv,
                    o_proj=self._projection(w, [a + "o_proj"], [w.optional(a + "o_proj.bias")]),
                    q_norm=w.take(a + "q_norm.weight") if fam.qk_norm else w.optional(a + "q_norm.weight"),
                    k_norm=w.take(a + "k_norm.weight") if fam.qk_norm else w.optional(a + "k_norm.weight"),
                    attn=LayerAttention(scale, windows[i], softcap, sinks),
                    rotary=self._rotary(types[i]),
                    mlp=self._moe(w, p) if self._sparse(i) else self._dense(w, p + "mlp."),
                )
            )
        self.norm = w.take("norm.weight")
        if w.has("lm_head.weight") or self.quant is not None and self.quant.is_quantized(w.has, "lm_head"):
            self.lm_head = self._projection(w, ["lm_head"])
        elif getattr(c, "tie_word_embeddings", False):
            self.lm_head = self._linear(self.embed)
            if self.lm_head.weight is None and self.lm_head.kernel is not None:
                self.embed = None  # looked up in the LM head's packed copy (``_embed``)
        else:
            raise ModelLoadError(f"checkpoint in {model_dir!r} is missing tensor 'lm_head.weight'")

    def _dense(self, w: _Weights, p: str, act=None) -> Callable[[torch.Tensor], torch.Tensor]:
        act = act or self.act
        expert = self._expert_from(w, p, gated=act is F.silu and layers.FUSED_CPU_OPS)
        unit = dense_unit(act)
        return partial(expert, unit=unit)

    def _expert_from(
        self, w: _Weights, p: str, names=("gate_proj", "up_proj", "down_proj"), gated: bool = False
    ) -> Expert:
        """``gated``: the unit is SiLU's, so the kernel may compute it in the gate_up GEMM."""
        fused = p + "gate_up_proj"
        if w.has(fused + ".weight") or self.quant is not None and self.quant.is_quantized(w.has, fused):  # Phi-3
            self.gate_up_fused = True
            gate_up = self._projection(w, [fused], gated=gated)
        else:
            gate_up = self._projection(w, [p + names[0], p + names[1]], gated=gated)
        return Expert(gate_up, self._projection(w, [p + names[2]]))

    def _moe(self, w: _Weights, p: str) -> MoE:
        c, kind = self.config, self.family.moe
        if kind == "gpt_oss":
            return self._gpt_oss_moe(w, p + "mlp.")
        k = c.num_experts_per_tok
        num = c.num_local_experts if kind == "mixtral" else c.num_experts
        mlp = p + ("block_sparse_moe." if w.has(p + "block_sparse_moe.gate.weight") else "mlp.")
        renormalize = True if kind == "mixtral" else bool(getattr(c, "norm_topk_prob", False))
        silu = self.act is F.silu and layers.FUSED_CPU_OPS
        router = self._linear(w.take(mlp + "gate.weight"))
        if w.has(mlp + "experts.gate_up_proj"):  # transformers >= 5's fused layout: [E, 2I, H], [E, H, I]
            gate_up, down = w.take(mlp + "experts.gate_up_proj"), w.take(mlp + "experts.down_proj")
            experts = [
                Expert(self._linear(gate_up[e].contiguous(), gated=silu), self._linear(down[e].contiguous()))
                for e in range(num)
            ]
        else:
            names = ("w1", "w3", "w2") if mlp.endswith("block_sparse_moe.") else ("gate_proj", "up_proj", "down_proj")
            experts = [self._expert_from(w, f"{mlp}experts.{e}.", names, gated=silu) for e in range(num)]
        shared = shared_gate = None
        if kind == "qwen2_moe":
            shared = self._expert_from(w, mlp + "shared_expert.", gated=silu)
            shared_gate = self._linear(w.take(mlp + "shared_expert_gate.weight"))
        return MoE(
            router,
            partial(softmax_then_topk, k=k, renormalize=renormalize),
            experts,
            dense_unit(self.act),
            shared,
            shared_gate,
        )

    def _gpt_oss_moe(self, w: _Weights, mlp: str) -> MoE:
        """gpt-oss stores experts fused and transposed ([E, H, 2I] with gate and up interleaved
        along the last axis, [E, I, H]) in bfloat16, or as MXFP4 blocks / scales ([E, 2I, ...],
        [E, H, ...]: already [out, in]), which stay MXFP4 (``quant.QWeight.mxfp4``). Both become one
        [gate; up] and one down projection per expert."""
        c = self.config

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        def projections(name: str, bias: torch.Tensor, interleaved: bool) -> list:
            """Each expert's projection ``name``, its rows de-interleaved to [gate; up] where ``interleaved``."""
            def rows(t: torch.Tensor) -> torch.Tensor:
                return torch.cat([t[0::2], t[1::2]]) if interleaved else t

            if w.has(name + "_blocks"):
                blocks, scales = w.raw(name + "_blocks"), w.raw(name + "_scales")
                if blocks.dim() != 4 or scales.dim() != 3 or blocks.shape[0] != c.num_local_experts:
                    raise ModelLoadError(
                        f"{name}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)} in {w.model_dir!r}: "
                        f"[{c.num_local_experts}, out, in / 32, 16] and [{c.num_local_experts}, out, in / 32] expected"
                    )
                layers = []
                for e in range(c.num_local_experts):
                    try:
                        qw = QWeight.mxfp4(rows(blocks[e]).clone(), rows(scales[e]).clone())
                    except QuantError as err:
                        raise ModelLoadError(f"{name} in {w.model_dir!r}: {err}") from None
                    layers.append(QuantLinear(qw, cast(rows(bias[e])), self.device, self.dtype))
                self.linears.extend(layers)
                return layers
            dense = w.raw(name).float().transpose(1, 2)  # [E, out, in]
            return [self._linear(cast(rows(dense[e])), cast(rows(bias[e]))) for e in range(c.num_local_experts)]

        gate_up = projections(mlp + "experts.gate_up_proj", w.take(mlp + "experts.gate_up_proj_bias", torch.float32), True)
        down = projections(mlp + "experts.down_proj", w.take(mlp + "experts.down_proj_bias", torch.float32), False)
        experts = [Expert(g, d) for g, d in zip(gate_up, down, strict=True)]
        router = self._linear(w.take(mlp + "router.weight"), w.take(mlp + "router.bias"))
        return MoE(
            router,
            partial(topk_then_softmax, k=c.num_experts_per_tok),
            experts,
            # older transformers (5.17 among them) keep 1.702 and 7.0 as constants, not config fields
            partial(
                clamped_swiglu,
                alpha=getattr(c, "swiglu_alpha", 1.702),
                limit=getattr(c, "swiglu_limit", 7.0),
            ),
        )

    @property
    def linear_backends(self) -> list[str]:
        """The backends each linear layer tries (``linear.backends_for``)."""
        return self._backends

    @property
    def is_moe(self) -> bool:
        return bool(self._moe_blocks)

    def expert_seconds(self) -> float:
        """Time spent in expert GEMMs so far (host time), summed over the MoE layers."""
        return sum(block.seconds for block in self._moe_blocks)

    # -- forward -------------------------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(input_ids, self.embed)
        assert self.lm_head.kernel is not None
        return self.lm_head.kernel.rows(input_ids)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.eps, self.family.norm_offset)

    def _add_norm(
        self, delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + delta), residual + delta)``: a sublayer's output added to the
        residual stream and the norm of the next sublayer's input, in one pass where it can."""
        return add_rms_norm(delta, residual, weight, self.eps, self.family.norm_offset)

    def _caches_of(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V cache views of ``kv_cache``, made once for the cache a runner keeps."""
        if self._layer_caches is None or self._layer_caches[0] is not kv_cache:
            self._layer_caches = (kv_cache, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])])
        return self._layer_caches[1]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,  # [layers, 2 (K, V), kv_heads, num_blocks + 1, block_size, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope_lengths: torch.Tensor | None = None,  # [T] the length LongRoPE sees (see ``Rotary``)
        lora: LoRABatch | None = None,  # the rows' LoRA adapters (``lora.py``)
    ) -> torch.Tensor:
        """Hidden states after the final norm for every token of the flattened batch."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        full_qk = self.family.qk_norm == "full"
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        tables = {id(r): r(positions, rope_lengths) for r in self._rotaries.values()}
        caches = self._caches_of(kv_cache)
        t = x.shape[0]
        residual, delta = x, None  # the residual stream is residual + delta once a layer has run
        for i, lw in enumerate(self.layers):
            cos, sin = tables[id(lw.rotary)]
            attn_in, attn_out, mlp_in, mlp_out = lw.norms
            if delta is None:
                normed = self._norm(x, attn_in)
            else:
                normed, residual = self._add_norm(delta, residual, attn_in)
            qkv = lw.qkv(normed)
            if lora is not None:
                qkv = lora.apply(i, "qkv", normed, qkv)
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
            if lw.q_norm is not None and lw.k_norm is not None:
                q, k = qkv[:, : h * d], qkv[:, h * d : (h + kvh) * d]
                if full_qk:  # OLMo 2: over all heads at once
                    q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
                q, k = q.reshape(t, h, d), k.reshape(t, kvh, d)
                if not full_qk:
                    q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            else:  # q and k side by side in qkv: rotate both in one pass
                qk = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)
                q, k = qk[:, :h], qk[:, h:]
            k_cache, v_cache = caches[i]
            o = backend.forward(q, k, v, k_cache, v_cache, meta, lw.attn)
            o = o.reshape(t, h * d)
            attn = lw.o_proj(o)
            if lora is not None:
                attn = lora.apply(i, "o", o, attn)
            delta = self._norm(attn, attn_out)
            normed, residual = self._add_norm(delta, residual, mlp_in)
            if lora is not None and not isinstance(lw.mlp, MoE):
                mlp = lw.mlp(normed, lora=lora.layer(i))
            else:
                mlp = lw.mlp(normed)
            delta = self._norm(mlp, mlp_out)
        if delta is None:
            return self._norm(x, self.norm)
        return self._add_norm(delta, residual, self.norm)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is None:
            return self.lm_head.widened(hidden)
        logits = self.lm_head(hidden)  # Gemma 2: the cap in the weights' dtype, as transformers
        return (torch.tanh(logits / self.final_softcap) * self.final_softcap).float()
