"""Scoring given continuations: how a continuation's text becomes token ids after a prompt.

A continuation's tokens are the tokens the prompt and continuation get when tokenized together,
past the prompt's own tokens (lm-evaluation-harness's ``loglikelihood`` split): a word that starts
in the continuation is scored with the tokenization the model would have produced for the whole
text. Where the joint tokenization does not start with the prompt's tokens (a merge across the
boundary), the continuation is tokenized alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def continuation_ids(
    tokenizer: Any, prompt_text: str | None, prompt_ids: Sequence[int], continuation: str | Sequence[int],
    add_special_tokens: bool = True,
) -> list[int]:
    """The token ids of ``continuation`` after a prompt (``prompt_text``, tokenized as
    ``prompt_ids``; None for a prompt given as token ids). Token ids are taken as they are."""
    if not isinstance(continuation, str):
        return [int(t) for t in continuation]
    if not continuation:
        raise ValueError("continuation is empty")
    if prompt_text is not None:
        whole = tokenizer(prompt_text + continuation, add_special_tokens=add_special_tokens)["input_ids"]
        n = len(prompt_ids)
        if len(whole) > n and list(whole[:n]) == list(prompt_ids):
            return list(whole[n:])
    return list(tokenizer(continuation, add_special_tokens=False)["input_ids"])


def as_continuation_list(value: Any) -> list[str | list[int]]:
    """One prompt's continuations: a text or token ids (one continuation), or a list of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    if isinstance(value, (list, tuple)) and value:
        out: list[str | list[int]] = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, (list, tuple)) and item and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item
            ):
                out.append(list(item))
            else:
                raise ValueError(
                    f"a continuation must be text or a non-empty list of token ids, got {type(item).__name__}"
                )
        return out
    raise ValueError(
        "continuations must be a text, a list of token ids, or a non-empty list of them, "
        f"got {value!r:.60}"
    )
