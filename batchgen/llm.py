"""``LLM``: the offline facade. ``generate`` queues every prompt, steps the engine until all are
done, and returns one ``RequestOutput`` per prompt in input order."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from batchgen.config import EngineConfig
from batchgen.engine.admission import admission_plan
from batchgen.engine.engine import LLMEngine
from batchgen.model.families import SUPPORTED_ARCHITECTURES
from batchgen.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

Params = SamplingParams | BeamSearchParams


class LLM:
    """Load a local Hugging Face model directory into a paged engine.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed``,
    ``num_kv_blocks``, ``kv_cache_memory_gb``, ``max_model_len``, ...); unknown ones raise ValueError.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model), **_from_vllm_kwargs(str(model), kwargs))
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()
        self.duplicates_merged = 0  # identical deterministic requests computed once (admission_order="prefix")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's name)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: Params | Sequence[Params] | None = None,
        use_tqdm: bool | None = None,
        *,
        sampling_params: Params | Sequence[Params] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt. ``params`` (or vLLM's ``sampling_params=``): one for all
        prompts, or one per prompt. A prompt is text, token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``.

        Every prompt and parameter set is validated before any request enters the engine; a bad one
        raises ValueError naming the prompt's position and the problem. A request that passed
        validation always completes; should the engine still give up on one, its output carries
        ``error`` and the others are unaffected. An interrupt (Ctrl-C) drops the call's unfinished
        requests, so the engine stays usable.
        """
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give the parameters once: params or sampling_params, not both")
            params = sampling_params
        one = isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)
        prompt_list: list[Any] = [_from_vllm_prompt(p) for p in ([prompts] if one else list(prompts))]
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
        add, duplicates = admission_plan(
            [prepared.token_ids for prepared, _ in checked],
            [p for _, p in checked],
            engine.block_size,
            engine.cfg.admission_order == "prefix",
        )
        for i in add:
            engine.add_request(ids[i], *checked[i])
        copies = {ids[i]: ids[j] for i, j in duplicates.items()}  # a duplicate's id -> the id computed
        self.duplicates_merged += len(copies)

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
            for rid, leader in copies.items():  # identical requests: the same output, their own id
                results[rid] = copy.deepcopy(results[leader])
                results[rid].request_id = rid
                bar.update(1)
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
        return {**self.engine.stats(), "duplicate_requests_merged": self.duplicates_merged}

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{role, content}``) or a list of them,
        through the model's chat template; one ``RequestOutput`` per conversation, its ``prompt``
        the templated text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts, ids = [], []
        for i, conv in enumerate(conversations):
            try:
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception as e:  # noqa: BLE001 - a template error names the conversation
                raise ValueError(f"conversation {i}: chat template failed: {e}") from None
            texts.append(text)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])  # the template has its specials
        outs = self.generate(ids, sampling_params, use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def beam_search(
        self, prompts: Any, params: BeamSearchParams, use_tqdm: bool | None = None
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` shape (``outputs[i].sequences``, best first), with
        transformers' beam semantics (see the README)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        results = []
        for out in self.generate(prompts, params, use_tqdm):
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            tokens=out.prompt_token_ids + c.token_ids,
                            text=c.text,
                            cum_logprob=c.cumulative_logprob or 0.0,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            score=c.score,
                        )
                        for c in out.outputs
                    ]
                )
            )
        return results


def _from_vllm_prompt(prompt: Any) -> Any:
    """vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``) to text or ids."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


def _from_vllm_kwargs(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``LLM(...)`` settings that map onto batchgen's, and clear refusals for those that do not."""
    out = dict(kwargs)
    if "swap_space" in out:
        out["swap_space_gb"] = out.pop("swap_space")
    if "enforce_eager" in out:
        out["cuda_graphs"] = not out.pop("enforce_eager")
    tp = out.pop("tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(
            f"tensor_parallel_size={tp}: batchgen runs one engine per device; to use several devices, "
            "run a sharded job (run.shard) or one LLM per device"
        )
    if out.pop("trust_remote_code", False):
        raise ValueError(
            "trust_remote_code=True: batchgen runs only the architectures it implements "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}) and never executes code from a checkpoint"
        )
    tokenizer = out.get("tokenizer")
    if tokenizer is not None and Path(tokenizer).resolve() == Path(model).resolve():
        out.pop("tokenizer")
    return out
