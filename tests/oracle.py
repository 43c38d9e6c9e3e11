"""The correctness oracle: transformers on the same weights, in float32."""

from __future__ import annotations

import torch

_HF_CACHE: dict[str, object] = {}


def hf_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if path not in _HF_CACHE:
        # Attention soft-capping (Gemma 2) exists only in eager attention, and some transformers
        # versions (5.17) load such a model with SDPA by default, silently without the cap.
        config = AutoConfig.from_pretrained(path)
        capped = getattr(config, "attn_logit_softcapping", None) is not None
        kwargs = {"attn_implementation": "eager"} if capped else {}
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    return _HF_CACHE[path]


@torch.no_grad()
def hf_greedy(path: str, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decode by full transformers forward passes (no cache, no generate)."""
    model = hf_model(path)
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def hf_logprob(path: str, prompt: list[int], completion: list[int]) -> float:
    """Sum of log-probabilities transformers gives ``completion`` after ``prompt``."""
    model = hf_model(path)
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    return float(sum(logp[n - 1 + i, t] for i, t in enumerate(completion)))
