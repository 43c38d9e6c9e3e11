"""One input row to a request, one finished request to an output row: what the local runner and the
Ray executor share, so that both write the same rows for the same input."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.engine.sampler import splitmix64
from batchgen.job.config import JobConfig
from batchgen.job.sink import as_text, duplicate_id_error, row_identity
from batchgen.outputs import RequestOutput, TokenLogprobs
from batchgen.params import BeamSearchParams, LoRARequest, SamplingParams, ScoreParams
from batchgen.scoring import as_continuation_list, continuation_ids


@dataclass
class Request:
    row: dict[str, Any]
    rid: str
    token_ids: list[int] | None = None
    params: SamplingParams | BeamSearchParams | ScoreParams | None = None
    error: str | None = None
    chat: bool = False
    lora: LoRARequest | None = None  # the row's adapter (``input.lora_column``)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora is None else self.lora.lora_int_id


def input_row_id(row: dict[str, Any], key: str | None, position: int) -> str:
    """A job row's identity (``row_identity``): its id (``key``: the id column, or ``custom_id`` for
    OpenAI batch input), its input position when there is no id column, ``#POSITION`` when the row
    lacks the id."""
    return str(position) if key is None else row_identity(row.get(key), position)


class RowIdentities:
    """The identities of a job's input rows, in input order: a row whose id an earlier row has is
    known by its position and becomes an error row (``duplicate_id_error``), so that every input
    row is in the output exactly once, and a rerun knows each of them."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.first: dict[str, int] = {}  # identity -> the position of the first row with it

    def __call__(self, row: dict[str, Any], position: int) -> tuple[str, str | None]:
        """(identity, error): ``error`` is set for a repeated id."""
        rid = input_row_id(row, self.key, position)
        first = self.first.setdefault(rid, position)
        if first == position or self.key is None:
            return rid, None
        return f"#{position}", duplicate_id_error(self.key, str(row.get(self.key)), first)


def stable_seed(seed: int, row_id: str) -> int:
    h = splitmix64(seed & (2**64 - 1))
    for byte in row_id.encode("utf-8", "surrogatepass"):
        h = splitmix64(h ^ byte)
    return h & (2**63 - 1)


def _overrides(raw: Any) -> dict[str, Any]:
    """A row's generation overrides: a struct (dict) or JSON-object text; null fields left out."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"not a JSON object of generation parameters ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"must hold an object of generation parameters, got {type(raw).__name__}")
    return {str(k): v for k, v in raw.items() if v is not None}


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as ``structured_outputs``: ``json_schema`` (its ``schema``),
    ``json_object``, or ``text`` (none)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return {"json": schema}
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


class RowCodec:
    """Builds requests from input rows (prompt or chat messages, per-row parameters, the row's own
    seed) and output rows from finished requests, for one job config."""

    def __init__(self, cfg: JobConfig, openai_in: bool) -> None:
        self.cfg = cfg
        self.openai_in = openai_in
        self.loras = cfg.lora.requests()
        self.scoring = cfg.task == "score"

    def build(
        self, tokenizer, row: dict[str, Any], rid: str, compile_grammar: Callable[[Any], None] | None = None
    ) -> Request:
        """The request of one input row, or the row with ``error`` set: whatever the row holds,
        this returns, and the error names the field at fault (the prompt or messages column, the
        params column, ``body`` of an OpenAI batch line). ``compile_grammar`` (the engine's)
        compiles a row's structured-output grammar here, in the reader, off the engine's steps."""
        req = Request(row=row, rid=rid)
        inp = self.cfg.input
        field = "row"
        try:
            if "__error__" in row:
                req.error = str(row["__error__"])
                return req
            overrides: dict[str, Any] = {}
            if self.openai_in:
                field = "body"
                body = row.get("body")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
                prompt, messages = body.get("prompt"), body.get("messages")
                overrides = {
                    k: v
                    for k, v in body.items()
                    if k not in ("prompt", "messages", "model", "stream", "user")
                }
                if "max_completion_tokens" in overrides:
                    overrides["max_tokens"] = overrides.pop("max_completion_tokens")
                if isinstance(overrides.get("logprobs"), bool) or "top_logprobs" in overrides:
                    # the chat API's logprobs: true with top_logprobs: k (vLLM's server maps them so)
                    top = overrides.pop("top_logprobs", None)
                    overrides["logprobs"] = (top or 0) if overrides.pop("logprobs", False) else None
                if "response_format" in overrides:
                    structured = _response_format(overrides.pop("response_format"))
                    if structured is not None:
                        overrides["structured_outputs"] = structured
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                prompt_field, messages_field, params_field = "body.prompt", "body.messages", "body"
            else:
                prompt = row.get(inp.prompt_column) if inp.prompt_column else None
                messages = row.get(inp.messages_column) if inp.messages_column else None
                prompt_field = inp.prompt_column or "prompt"
                messages_field = inp.messages_column or "messages"
                params_field = inp.params_column or "generation"
                if inp.params_column and row.get(inp.params_column) is not None:
                    field = inp.params_column
                    overrides = _overrides(row[inp.params_column])
            if messages is not None or (inp.messages_column and not self.openai_in):
                field = messages_field
                if isinstance(messages, str):  # a column of chat messages stored as JSON text
                    try:
                        messages = json.loads(messages)
                    except ValueError:
                        raise ValueError(f"{field} is text that is not a JSON list of messages") from None
                if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
                ):
                    raise ValueError(f"{field} must be a non-empty list of {{role, content}} objects")
                template_kwargs = self.cfg.template_kwargs(overrides)
                try:
                    prompt_text = tokenizer.apply_chat_template(
                        messages,
                        tokenize=False,
                        add_generation_prompt=self.cfg.run.add_generation_prompt or self.scoring,
                        **template_kwargs,
                    )
                except Exception as e:  # noqa: BLE001 - any template failure is this row's
                    raise ValueError(f"chat template failed: {e}") from None
                req.chat = True
                req.token_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            else:
                field = prompt_field
                if prompt is None:
                    raise ValueError(f"{field} is null")
                if not isinstance(prompt, str):
                    raise ValueError(f"{field} must be text, got {type(prompt).__name__}")
                if not prompt.strip():
                    raise ValueError(f"{field} is empty")
                prompt_text = prompt
                req.token_ids = tokenizer(prompt)["input_ids"]
            if not isinstance(req.token_ids, list) or not all(isinstance(t, int) for t in req.token_ids):
                raise ValueError("did not tokenize to one list of token ids")
            if inp.lora_column and not self.openai_in:
                field = inp.lora_column
                req.lora = self._adapter(row.get(inp.lora_column))
            if self.scoring:
                field = inp.continuation_column or "continuation"
                conts = as_continuation_list(row.get(field))
                ids = [continuation_ids(tokenizer, prompt_text, req.token_ids, c, not req.chat) for c in conts]
                for c, cont_ids in zip(conts, ids, strict=True):
                    if not cont_ids:
                        raise ValueError(f"continuation {c!r:.40} tokenizes to no tokens")
                field = params_field
                req.params = self.cfg.score_params(ids, overrides)
                return req
            field = params_field
            params = self.cfg.params(overrides)
            if isinstance(params, SamplingParams) and (params.seed is None or "seed" not in overrides):
                base = self.cfg.generation.get("seed", self.cfg.engine.get("seed", 0))
                params.seed = stable_seed(int(base), rid)
            if compile_grammar is not None:
                compile_grammar(params)
            req.params = params
        except Exception as e:  # noqa: BLE001 - a row's content never ends the job: it is this row's error
            message = str(e) if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {e}"
            req.error = message if message.startswith(field) else f"{field}: {message}"
            req.token_ids = None
        return req

    def _adapter(self, name: Any) -> LoRARequest | None:
        """A row's adapter by name (null: the base model)."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"must name an adapter (text) or be null, got {type(name).__name__}")
        if name not in self.loras:
            raise ValueError(f"unknown adapter {name!r} (lora.adapters: {', '.join(sorted(self.loras))})")
        return self.loras[name]

    def row(self, req: Request, out: RequestOutput | None, error: str | None) -> dict[str, Any]:
        if self.cfg.output.format == "openai":
            return self.openai_row(req, out, error)
        row = dict(req.row)
        row.pop("__error__", None)
        gen = self.cfg.generation
        if self.scoring:
            return self._score_row(row, out, error, req)
        if out is None:
            row.update(
                completions=None,
                num_prompt_tokens=len(req.token_ids) if req.token_ids else None,
                num_generated_tokens=0,
                **({"prompt_logprobs": None} if gen.get("prompt_logprobs") is not None else {}),
                error=error,
            )
            return row
        comps = []
        for c in out.outputs:
            comp = dict(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                score=c.score,
                finish_reason=c.finish_reason,
            )
            if self.cfg.reasoning_parser:
                comp["reasoning"] = c.reasoning
            if gen.get("logprobs") is not None:
                comp["logprobs"] = logprob_columns(c.logprobs)
            comps.append(comp)
        row.update(
            completions=comps,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generated_tokens=sum(len(c.token_ids) for c in out.outputs),
            error=None,
        )
        if gen.get("prompt_logprobs") is not None:
            row["prompt_logprobs"] = prompt_logprob_columns(out)
        return row

    def _score_row(self, row: dict[str, Any], out: RequestOutput | None, error: str | None, req: Request) -> dict[str, Any]:
        """A scoring job's row: each continuation's total log-probability and token count."""
        if out is None:
            row.update(scores=None, num_prompt_tokens=len(req.token_ids) if req.token_ids else None,
                       num_scored_tokens=0, error=error)
            return row
        with_logprobs = self.cfg.generation.get("logprobs") is not None
        scores = []
        for c in out.outputs:
            entry = dict(index=c.index, text=c.text, token_ids=c.token_ids, logprob=c.cumulative_logprob,
                         num_tokens=len(c.token_ids))
            if with_logprobs:
                entry["logprobs"] = logprob_columns(c.logprobs)
            scores.append(entry)
        row.update(scores=scores, num_prompt_tokens=len(out.prompt_token_ids),
                   num_scored_tokens=sum(len(c.token_ids) for c in out.outputs), error=None)
        return row

    def openai_row(self, req: Request, out: RequestOutput | None, error: str | None) -> dict[str, Any]:
        rid = req.rid
        custom_id = req.row.get("custom_id")
        custom_id = None if custom_id is None else as_text(custom_id)
        position = req.row.get("row_index")
        if out is None:
            return {
                "id": f"batch_req_{rid}",
                "custom_id": custom_id,
                "row_index": position,
                "response": None,
                "error": {"code": "invalid_request", "message": error},
            }
        n_gen = sum(len(c.token_ids) for c in out.outputs)
        reasoning = bool(self.cfg.reasoning_parser)
        choices: list[dict[str, Any]] = []
        for c in out.outputs:
            if req.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if reasoning:  # vLLM's server field
                    message["reasoning_content"] = c.reasoning
                choice: dict[str, Any] = {"index": c.index, "message": message, "finish_reason": c.finish_reason}
            else:
                choice = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                if reasoning:
                    choice["reasoning_content"] = c.reasoning
            if isinstance(c.logprobs, TokenLogprobs):
                choice["logprobs"] = openai_logprobs(c.logprobs, req.chat)
            choices.append(choice)
        obj = "chat.completion" if req.chat else "text_completion"
        body = {
            "id": f"cmpl-{rid}",
            "object": obj,
            "created": int(time.time()),
            "model": self.cfg.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": n_gen,
                "total_tokens": len(out.prompt_token_ids) + n_gen,
            },
        }
        return {
            "id": f"batch_req_{rid}",
            "custom_id": custom_id,
            "row_index": position,
            "response": {"status_code": 200, "request_id": rid, "body": body},
            "error": None,
        }


def logprob_columns(logprobs: Any) -> dict[str, Any] | None:
    """A completion's ``TokenLogprobs`` as the ``logprobs`` struct (``LOGPROBS_TYPE``): its arrays
    as they are, the top k one array row per token."""
    if logprobs is None:
        return None
    return {
        "token_ids": logprobs.token_ids,
        "logprobs": logprobs.logprobs,
        "ranks": logprobs.ranks,
        "top_token_ids": list(logprobs.top_ids),
        "top_logprobs": list(logprobs.top_logprobs),
    }


def prompt_logprob_columns(out: RequestOutput) -> dict[str, Any] | None:
    """The prompt's log-probabilities (tokens 1..P-1; the first has none) as the ``LOGPROBS_TYPE``
    struct."""
    return None if out.prompt_logprobs is None else logprob_columns(out.prompt_logprobs.values)


def openai_logprobs(logprobs: TokenLogprobs, chat: bool) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice: chat's ``content`` list (token, logprob, bytes,
    top_logprobs), or the completions API's parallel lists."""
    text = logprobs.decoded
    rows = zip(logprobs.token_ids.tolist(), logprobs.logprobs.tolist(), logprobs.top_ids.tolist(),
               logprobs.top_logprobs.tolist(), strict=True)
    if chat:
        def item(token: int, lp: float) -> dict[str, Any]:
            piece = text(token)
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

        return {"content": [
            {**item(t, lp), "top_logprobs": [item(a, b) for a, b in zip(ta, tb, strict=True)]} for t, lp, ta, tb in rows
        ]}
    tokens, values, tops = [], [], []
    for t, lp, ta, tb in rows:
        tokens.append(text(t))
        values.append(lp)
        tops.append({text(a): b for a, b in zip(ta, tb, strict=True)})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}


_ARRAY_OVERHEAD = 112  # bytes of a numpy array object besides its data


def row_bytes(row: Any) -> int:
    """About how many bytes an output row's per-token log-probabilities hold (0 without them),
    from their lengths: ``logprob_columns``' arrays, or the OpenAI format's lists and dicts (about
    100 bytes a value)."""
    if not isinstance(row, dict):
        return 0
    total = 0
    items = [c.get("logprobs") for c in row.get("completions") or row.get("scores") or []]
    for lp in [*items, row.get("prompt_logprobs")]:
        if lp:  # n tokens: three arrays of n, and two arrays of k per token
            n = len(lp["token_ids"])
            k = len(lp["top_token_ids"][0]) if n else 0
            total += 12 * n + 2 * n * (4 * k + _ARRAY_OVERHEAD)
    body = ((row.get("response") or {}).get("body") or {}) if "response" in row else {}
    for choice in body.get("choices") or []:
        lp = choice.get("logprobs") or {}
        values = lp.get("content") or lp.get("top_logprobs") or []
        if values:
            first = values[0]
            k = len(first["top_logprobs"]) if "top_logprobs" in first else len(first)
            total += 100 * len(values) * (1 + k)
    return total
