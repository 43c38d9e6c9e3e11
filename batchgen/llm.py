"""``LLM``: the offline facade. ``generate`` queues every prompt, steps the engine until all are
done, and returns one ``RequestOutput`` per prompt in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from batchgen.config import EngineConfig
from batchgen.engine.engine import LLMEngine
from batchgen.outputs import RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

Params = SamplingParams | BeamSearchParams


class LLM:
    """Load a local Hugging Face model directory into a paged engine.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed``,
    ``num_kv_blocks``, ``kv_cache_memory_gb``, ``max_model_len``, ...); unknown ones raise ValueError.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model), **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: Params | Sequence[Params] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt. ``params``: one for all prompts, or one per prompt.

        Every prompt and parameter set is validated before any request enters the engine; a bad one
        raises ValueError naming the prompt's position and the problem. A request that passed
        validation always completes; should the engine still give up on one, its output carries
        ``error`` and the others are unaffected. An interrupt (Ctrl-C) drops the call's unfinished
        requests, so the engine stays usable.
        """
        one = isinstance(prompts, str) or bool(prompts) and isinstance(prompts[0], int)
        prompt_list: list[Any] = [prompts] if one else list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, BeamSearchParams)):
            per_prompt = [params] * len(prompt_list)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompt_list):
                raise ValueError(f"got {len(per_prompt)} parameter sets for {len(prompt_list)} prompts")
        engine = self.engine
        checked = []
        for i, (prompt, p) in enumerate(zip(prompt_list, per_prompt, strict=True)):
            try:
                checked.append((engine.prepare(prompt, p), p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [str(next(self._ids)) for _ in checked]
        for rid, (prepared, p) in zip(ids, checked, strict=True):
            engine.add_request(rid, prepared, p)

        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(ids) >= 32
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not show, dynamic_ncols=True)
        generated = 0
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    results[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix(gen_tokens=generated, refresh=False)
        except BaseException:
            # An interrupt or an error mid-run: drop this call's requests so the engine stays usable.
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, float | int | str]:
        """KV-cache figures: pool size, peak blocks used, copy-on-write copies, prefix-cache hits,
        peak KV tokens held logically (sum over live sequences) and physically (slots in used blocks)."""
        return self.engine.stats()
