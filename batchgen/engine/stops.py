"""Stop conditions of a sampled sequence: end tokens, stop token ids, stop strings (found by
incremental detokenization with ``tokenizers``' ``DecodeStream``) and length limits."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from batchgen.engine.sequence import Sequence
from batchgen.params import SamplingParams


class StopStringWatcher:
    """Streams a sequence's text and finds the first stop string in it."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stops: list[str] = list(params.stop or [])
        self.keep_stop = params.include_stop_str_in_output
        self.longest = max(len(s) for s in self.stops)
        self.text = ""

    def copy_for(self, token_ids: list[int], tokenizer, params: SamplingParams) -> StopStringWatcher:
        w = StopStringWatcher(tokenizer, params)
        for t in token_ids:
            w.feed(t)
        return w

    def feed(self, token_id: int) -> tuple[str, int] | None:
        """Add a token; return (stop string, where the text ends) once one appears."""
        try:
            chunk = self.stream.step(self.backend, token_id)
        except Exception:  # noqa: BLE001 - ids past the tokenizer's vocabulary decode to nothing
            chunk = None
        if not chunk:
            return None
        start = max(0, len(self.text) - self.longest + 1)
        self.text += chunk
        best = None
        for s in self.stops:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[1]):
                best = (s, pos)
        if best is None:
            return None
        s, pos = best
        return s, pos + (len(s) if self.keep_stop else 0)


def check_stop(seq: Sequence, params: SamplingParams, eos_ids: frozenset[int], max_model_len: int) -> bool:
    """Set ``finish_reason`` / ``stop_reason`` when the newest token ends ``seq``."""
    tok = seq.token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= params.min_tokens:
        if not params.ignore_eos and tok in eos_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
            return True
        if tok in params.stop_token_ids:  # type: ignore[operator]
            seq.finish_reason, seq.stop_reason = "stop", tok
            return True
        if seq.detok is not None:
            found = seq.detok.feed(tok)
            if found is not None:
                seq.finish_reason, seq.stop_reason = "stop", found[0]
                seq.text_end = found[1]
                return True
    elif seq.detok is not None:
        seq.detok.feed(tok)
    if (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        return True
    return False
