"""``LLM``: the offline facade. ``generate`` queues every prompt, steps the engine until all are
done, and returns one ``RequestOutput`` per prompt in input order."""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from batchgen import metrics
from batchgen.config import EngineConfig
from batchgen.engine.admission import admission_plan
from batchgen.engine.engine import LLMEngine
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ContinuationScore,
    RequestOutput,
    ScoreOutput,
    TokenLogprobs,
)
from batchgen.params import BeamSearchParams, LoRARequest, SamplingParams, ScoreParams
from batchgen.scoring import as_continuation_list, continuation_ids
from batchgen.vllm_compat import from_vllm_kwargs, from_vllm_prompt

# generation_config.json keys that vLLM's get_default_sampling_params takes, and their names here
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

Params = SamplingParams | BeamSearchParams | ScoreParams


class LLM:
    """Load a local Hugging Face model directory into a paged engine.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed``,
    ``num_kv_blocks``, ``kv_cache_memory_gb``, ``max_model_len``, ...) or vLLM's engine keywords
    (``batchgen/vllm_compat.py`` says what each does here); unknown ones raise ValueError.
    ``profiler_config`` (vLLM's: ``{"profiler": "torch", "torch_profiler_dir": DIR}``) sets where
    ``start_profile`` / ``stop_profile`` write their trace.
    """

    def __init__(self, model: str, *, profiler_config: Any = None, **kwargs: Any) -> None:
        """``model``: a local directory or a hub id (``revision=``, ``download_dir=``; see
        ``batchgen/model/hub.py``)."""
        self.config = EngineConfig.from_kwargs(str(model), **from_vllm_kwargs(str(model), kwargs))
        self._profile_dir = _profile_dir(profiler_config)
        self.engine = LLMEngine(self.config)
        self.config = self.engine.cfg  # a hub id resolved to its local snapshot
        self._ids = itertools.count()
        self.duplicates_merged = 0  # identical deterministic requests computed once (admission_order="prefix")
        self._request_metrics = metrics.RequestMetrics()
        self._profiler: Any = None

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt. ``params`` (or vLLM's ``sampling_params=``): one for all
        prompts, or one per prompt. A prompt is text, token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``. ``lora_request`` (with ``enable_lora=True``): the LoRA adapter
        of every prompt, or one per prompt, None for the base model.

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
        prompt_list: list[Any] = [from_vllm_prompt(p) for p in ([prompts] if one else list(prompts))]
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, BeamSearchParams, ScoreParams)):
            per_prompt = [params] * len(prompt_list)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompt_list):
                raise ValueError(f"got {len(per_prompt)} parameter sets for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        engine = self.engine
        checked = []
        for i, (prompt, p, lora) in enumerate(zip(prompt_list, per_prompt, loras, strict=True)):
            try:
                checked.append((engine.prepare(prompt, p, lora), p, lora))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [str(next(self._ids)) for _ in checked]
        add, duplicates = admission_plan(
            [prepared.token_ids for prepared, _, _ in checked],
            [p for _, p, _ in checked],
            engine.block_size,
            engine.cfg.admission_order == "prefix",
            [0 if lora is None else lora.lora_int_id for _, _, lora in checked],
        )
        for i in add:
            engine.add_request(ids[i], *checked[i])
        copies = {ids[i]: ids[j] for i, j in duplicates.items()}  # a duplicate's id -> the id computed
        self.duplicates_merged += len(copies)

        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(ids) >= 32
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not show, dynamic_ncols=True)
        generated = 0
        started = time.perf_counter()
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    results[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    self._request_metrics.observe(
                        len(out.prompt_token_ids),
                        sum(len(c.token_ids) for c in out.outputs),
                        time.perf_counter() - started,
                        [c.finish_reason or "abort" for c in out.outputs] or ["error"],
                    )
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

    def score_continuations(
        self,
        prompts: str | Sequence[Any],
        continuations: Any,
        *,
        logprobs: int | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoreOutput]:
        """The log-probability of given continuations of each prompt under the model: a DPO
        reference pass (chosen and rejected), ranking candidates, perplexity filtering.

        ``prompts``: as for ``generate`` (text, token ids, vLLM's prompt dicts). ``continuations``:
        per prompt, a text, token ids, or a list of them scored against that prompt; with a single
        prompt, its continuations. A text continuation is tokenized with the prompt
        (``batchgen/scoring.py``). ``logprobs``: None for each continuation's total and token count;
        k >= 0 adds every token's log-probability and rank with its top k alternatives.

        The continuations of one prompt fork from the prompt's last block after its prefill,
        copy-on-write: the prompt is computed once however many continuations it has
        (``stats()``: ``score_prompt_tokens_computed``), and prefix caching shares it across
        prompts. vLLM's ``LLM.score`` is a cross-encoder's relevance score, another thing, hence
        this name."""
        one = isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)
        prompt_list = [from_vllm_prompt(p) for p in ([prompts] if one else list(prompts))]
        per_prompt = [continuations] if one else list(continuations)
        if len(per_prompt) != len(prompt_list):
            raise ValueError(f"got continuations for {len(per_prompt)} prompts, and {len(prompt_list)} prompts")
        engine = self.engine
        ids, params = [], []
        for i, (prompt, conts) in enumerate(zip(prompt_list, per_prompt, strict=True)):
            try:
                text, prompt_ids = engine.tokenize(prompt)
                token_lists = [
                    continuation_ids(engine.tokenizer, text, prompt_ids, c) for c in as_continuation_list(conts)
                ]
                params.append(ScoreParams(continuations=token_lists, logprobs=logprobs))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            ids.append(prompt_ids)
        outs = self.generate(ids, params, use_tqdm, lora_request=lora_request)
        results = []
        for out, prompt in zip(outs, prompt_list, strict=True):
            results.append(
                ScoreOutput(
                    request_id=out.request_id,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=out.prompt_token_ids,
                    num_cached_tokens=out.num_cached_tokens,
                    continuations=[
                        ContinuationScore(
                            c.index, c.text, c.token_ids, c.cumulative_logprob or 0.0, len(c.token_ids),
                            c.logprobs if isinstance(c.logprobs, TokenLogprobs) else None,
                        )
                        for c in out.outputs
                    ],
                    error=out.error,
                )
            )
        return results

    def stats(self) -> dict[str, float | int | str]:
        """KV-cache figures: pool size, peak blocks used, copy-on-write copies, prefix-cache hits,
        peak KV tokens held logically (sum over live sequences) and physically (slots in used blocks)."""
        return {**self.engine.stats(), "duplicate_requests_merged": self.duplicates_merged}

    def get_metrics(self) -> list[metrics.Metric]:
        """vLLM's ``LLM.get_metrics``: counters, gauges and histograms (``batchgen/metrics.py``)."""
        sched = self.engine.scheduler
        live = {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(sched.swapped),
            "used_blocks": self.engine.bm.num_used_blocks,
        }
        return metrics.collect(self.stats(), live, self._request_metrics, self.config.model)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: ``SamplingParams`` from the model's ``generation_config.json`` (its
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
        ``max_new_tokens`` as ``max_tokens``), or vLLM's defaults when it has none or the engine
        setting ``generation_config`` is ``"vllm"``. A directory there is read instead of the model's."""
        source = self.config.generation_config
        if source == "vllm":
            return SamplingParams()
        from transformers import GenerationConfig  # noqa: PLC0415

        directory = self.config.model if source == "auto" else source
        try:
            diff = GenerationConfig.from_pretrained(directory).to_diff_dict()
        except OSError:
            if source != "auto":
                raise ValueError(f"generation_config: no generation_config.json in {directory}") from None
            return SamplingParams()
        values = {ours: diff[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if diff.get(theirs) is not None}
        return SamplingParams(**values)

    def start_profile(self) -> None:
        """Start a torch profiler trace (vLLM's ``start_profile``); ``stop_profile`` writes it to the
        directory of ``profiler_config`` / ``$BATCHGEN_TORCH_PROFILER_DIR`` /
        ``$VLLM_TORCH_PROFILER_DIR``, one ``*.pt.trace.json`` per start, for TensorBoard or Perfetto."""
        import torch  # noqa: PLC0415

        if self._profile_dir is None:
            raise RuntimeError(
                "profiling is off: give LLM(..., profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': DIR}) or set BATCHGEN_TORCH_PROFILER_DIR=DIR"
            )
        if self._profiler is not None:
            raise RuntimeError("a profile is already running; call stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.engine.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        Path(self._profile_dir).mkdir(parents=True, exist_ok=True)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self._profile_dir, worker_name="batchgen"),
        )
        self._profiler.start()

    def stop_profile(self) -> None:
        """Stop the trace ``start_profile`` began and write it."""
        if self._profiler is None:
            raise RuntimeError("no profile is running; call start_profile() first")
        profiler, self._profiler = self._profiler, None
        profiler.stop()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{role, content}``) or a list of them,
        through the model's chat template (or ``chat_template``, a Jinja template text); one
        ``RequestOutput`` per conversation, its ``prompt`` the templated text.
        ``continue_final_message`` leaves the last (assistant) message open for the model to go on,
        instead of starting a new turn; it excludes ``add_generation_prompt``, as in vLLM.
        ``chat_template_kwargs`` go to the template (``enable_thinking=False``, say)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message; give add_generation_prompt=False with it"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts, ids = [], []
        for i, conv in enumerate(conversations):
            try:
                text = tok.apply_chat_template(
                    conv,
                    tokenize=False,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}),
                )
            except Exception as e:  # noqa: BLE001 - a template error names the conversation
                raise ValueError(f"conversation {i}: chat template failed: {e}") from None
            texts.append(text)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])  # the template has its specials
        outs = self.generate(ids, sampling_params, use_tqdm, lora_request=lora_request)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` shape (``outputs[i].sequences``, best first), with
        transformers' beam semantics (see the README); ``lora_request`` as in ``generate``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        results = []
        for out in self.generate(prompts, params, use_tqdm, lora_request=lora_request):
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


def _profile_dir(profiler_config: Any) -> str | None:
    """Where ``start_profile`` writes: vLLM's ``profiler_config`` (a dict or an object with
    ``profiler`` and ``torch_profiler_dir``), else ``$BATCHGEN_TORCH_PROFILER_DIR``, else vLLM's
    ``$VLLM_TORCH_PROFILER_DIR``; None when profiling is off."""
    if profiler_config is not None:
        get = profiler_config.get if isinstance(profiler_config, dict) else lambda k: getattr(profiler_config, k, None)
        kind = get("profiler")
        if kind not in (None, "torch"):
            raise ValueError(f"profiler_config: profiler must be 'torch', got {kind!r}")
        directory = get("torch_profiler_dir")
        if kind == "torch" and not directory:
            raise ValueError("profiler_config: give torch_profiler_dir, the directory for the trace")
        if directory:
            return str(directory)
    return os.environ.get("BATCHGEN_TORCH_PROFILER_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None
