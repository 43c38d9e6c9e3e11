"""A finished request's text: token ids decoded, split into reasoning and answer by the reasoning
parser, and log-probability entries with their decoded tokens."""

from __future__ import annotations

from typing import Any

from batchgen.outputs import LogprobsBuilder, TokenLogprobs
from batchgen.reasoning import ReasoningParser


class OutputText:
    def __init__(self, tokenizer: Any, reasoning: ReasoningParser | None) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning

    def decode(self, ids: list[int], skip_special: bool) -> str:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        except Exception:  # noqa: BLE001 - ids past the tokenizer's vocabulary
            known = [t for t in ids if t < len(self.tokenizer)]
            return self.tokenizer.decode(known, skip_special_tokens=skip_special)

    def decode_token(self, token: int) -> str:
        return self.decode([token], False)

    def split(self, token_ids: list[int], skip_special: bool, stopped: str | None) -> tuple[str | None, str]:
        """(reasoning, text) of a completion: without a reasoning parser, no reasoning and the
        whole text (``stopped``: the text a stop string cut, when one did)."""
        if self.reasoning is None:
            return None, stopped if stopped is not None else self.decode(token_ids, skip_special)
        if stopped is not None:  # split the cut text at the end tag's text
            end = self.decode(self.reasoning.end, False)
            start = self.decode(self.reasoning.start, False)
            if end in stopped:
                head, _, tail = stopped.partition(end)
                return head.replace(start, "", 1), tail
            return None, stopped
        thinking, answer = self.reasoning.split(token_ids, lambda ids: self.decode(ids, skip_special))
        return thinking, answer or ""

    def token_logprobs(self, k: int, tokens: list[int], values: list[Any]) -> TokenLogprobs:
        """``TokenLogprobs`` of ``tokens`` from their (log-probability, TopLogprobs) pairs."""
        builder = LogprobsBuilder(k)
        for tok, (lp, top) in zip(tokens, values, strict=True):
            builder.append(tok, lp, top.rank, top.ids, top.logprobs)
        return builder.build(self.decode_token)
