"""Structured outputs: grammars compiled by xgrammar, one matcher per sequence, a token mask per step.

- ``compile`` turns a request's ``StructuredOutputsParams`` into a compiled grammar, once per
  distinct text (a JSON schema with its keys sorted, a pattern, a choice list, an EBNF grammar),
  kept for the engine's life; it runs when a request is made (``LLMEngine.prepare``, or a job's
  reader thread), never inside a step, and a text that does not compile raises ``ValueError``.
- Each sequence of a constrained request holds a ``GrammarMatcher``. When the sequence forks
  (the ``n`` samples after the prompt, a beam chosen twice) the child gets ``matcher.fork()``, so
  every sample and beam advances its own state; preemption keeps the sequence, and so the state.
- Each step, ``bitmask`` fills one row of allowed tokens per constrained row (xgrammar's batch
  filler, on several threads); the sampler sets the other tokens to -inf before penalties,
  temperature and truncation, and beam search after its log-softmax (transformers applies logits
  processors there), so beam scores are the raw model's log-probabilities, masked and not
  renormalized. A stop token (the model's end tokens and the request's ``stop_token_ids``) is
  allowed only where the grammar may end. Token ids past the tokenizer's vocabulary (a model
  vocabulary padded past it) are never allowed. Rows without a grammar pay nothing.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from batchgen.engine.sampler import fused_kernels
from batchgen.params import StructuredOutputsParams


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured outputs need the xgrammar package: pip install xgrammar "
            "(or batchgen's 'structured' extra)"
        ) from None
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
        escaped = escaped.replace("\t", "\\t")
        return f'"{escaped}"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class StructuredOutputs:
    """The engine's grammars: the tokenizer's view for xgrammar, the compiled-grammar cache and its
    counts (``stats``), matchers for new sequences, and each step's token bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._cache: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        self.cache_hits = 0
        self.compile_s = 0.0
        self.mask_s = 0.0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``, from the cache or compiled now; ``ValueError`` naming
        the problem when it does not compile."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list",
                    "json_object": "JSON grammar"}[spec.kind]
            detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())  # xgrammar's time and source line
            raise ValueError(f"structured_outputs: invalid {what}: {detail[:300]}") from None
        with self._lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            return self._cache.setdefault(key, compiled)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        kind, compiler = spec.kind, self.compiler
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar takes any value)
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=not spec.disable_any_whitespace, strict_mode=False
            )
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choice or []))
        return compiler.compile_grammar(spec.grammar)

    def matcher(self, spec: StructuredOutputsParams, stop_ids: Iterable[int]) -> Any:
        """A matcher at the start of ``spec``'s grammar; ``stop_ids`` end it where the grammar may
        end (with none, the grammar's own end finishes the sequence)."""
        stops = sorted(set(stop_ids))
        return self._xgr.GrammarMatcher(
            self.compile(spec), override_stop_tokens=stops or None, terminate_without_stop_token=not stops
        )

    def bitmask(self, matchers: list[Any], rows: list[int], n_rows: int) -> torch.Tensor:
        """The allowed tokens of a step's ``n_rows`` rows (xgrammar's int32 bitmask): row
        ``rows[i]`` after ``matchers[i]``'s state, every other row all allowed."""
        t0 = time.perf_counter()
        mask = self._xgr.allocate_token_bitmask(n_rows, self.vocab_size)
        self.batch.batch_fill_next_token_bitmask(matchers, mask, indices=rows)
        self.mask_s += time.perf_counter() - t0
        return mask

    def apply(self, scores: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        """Set the tokens ``mask`` does not allow to -inf in ``scores``' ``rows`` (in place; ``mask``
        has a row for every row of ``scores``). On the CPU, float32 scores take the compiled kernel
        (``cpu_sampling.token_mask``: it skips all-allowed words and bytes and selects a byte's 8
        lanes at once, where xgrammar's kernel writes one token at a time) and anything else xgrammar's
        kernel; on a GPU batchgen's Triton kernel (``batchgen_kernels.token_mask``) takes the mask
        copied to the device."""
        if scores.is_cuda:
            from batchgen_kernels.token_mask import token_mask  # noqa: PLC0415 - imports triton

            token_mask(scores, mask.to(scores.device, non_blocking=True), rows)
            return
        t0 = time.perf_counter()
        kernels = fused_kernels("token_mask") if scores.dtype == torch.float32 and scores.stride(-1) == 1 else None
        if kernels is not None:
            kernels.token_mask(scores, mask, rows, self.vocab_size)
        else:
            self._xgr.apply_token_bitmask_inplace(scores, mask, vocab_size=self.vocab_size, indices=rows)
        self.mask_s += time.perf_counter() - t0

    @staticmethod
    def no_stats() -> dict[str, float | int]:
        return {"grammar_compiles": 0, "grammar_cache_hits": 0, "grammar_compile_s": 0.0, "grammar_mask_s": 0.0}

    def stats(self) -> dict[str, float | int]:
        return {
            "grammar_compiles": self.compiles,
            "grammar_cache_hits": self.cache_hits,
            "grammar_compile_s": self.compile_s,
            "grammar_mask_s": self.mask_s,
        }


def full_mask(n_rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask (xgrammar's layout) that allows every token in every row."""
    return torch.full((n_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(scores: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """``StructuredOutputs.apply`` without xgrammar: the tokens ``mask`` does not allow set to -inf
    in ``scores``' ``rows`` (for masks of forced tokens only)."""
    vocab = scores.shape[1]
    index = torch.tensor(rows, device=scores.device)
    words = mask[rows].to(scores.device).unsqueeze(-1)
    bits = (words >> torch.arange(32, dtype=torch.int32, device=scores.device)) & 1
    ok = bits.reshape(len(rows), -1)[:, :vocab].bool()
    scores[index] = scores[index].masked_fill(~ok, float("-inf"))


def allow_also(mask: torch.Tensor, row: int, token: int) -> None:
    """Allow ``token`` in ``row`` of ``mask`` besides what it allows."""
    word = int(mask[row, token // 32]) | (1 << (token % 32))
    mask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    """Whether ``mask`` allows ``token`` in ``row``."""
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def allow_only(mask: torch.Tensor, row: int, tokens: Iterable[int]) -> None:
    """Make ``row`` of ``mask`` allow exactly ``tokens``."""
    words = [0] * mask.shape[1]
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    mask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=mask.dtype)
