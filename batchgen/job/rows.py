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
from batchgen.outputs import RequestOutput
from batchgen.params import BeamSearchParams, LoRARequest, SamplingParams


@dataclass
class Request:
    row: dict[str, Any]
    rid: str
    token_ids: list[int] | None = None
    params: SamplingParams | BeamSearchParams | None = None
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
                try:
                    text = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=self.cfg.run.add_generation_prompt
                    )
                except Exception as e:  # noqa: BLE001 - any template failure is this row's
                    raise ValueError(f"chat template failed: {e}") from None
                req.chat = True
                req.token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                field = prompt_field
                if prompt is None:
                    raise ValueError(f"{field} is null")
                if not isinstance(prompt, str):
                    raise ValueError(f"{field} must be text, got {type(prompt).__name__}")
                if not prompt.strip():
                    raise ValueError(f"{field} is empty")
                req.token_ids = tokenizer(prompt)["input_ids"]
            if not isinstance(req.token_ids, list) or not all(isinstance(t, int) for t in req.token_ids):
                raise ValueError("did not tokenize to one list of token ids")
            if inp.lora_column and not self.openai_in:
                field = inp.lora_column
                req.lora = self._adapter(row.get(inp.lora_column))
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
        if out is None:
            row.update(
                completions=None,
                num_prompt_tokens=len(req.token_ids) if req.token_ids else None,
                num_generated_tokens=0,
                error=error,
            )
            return row
        comps = [
            dict(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                score=c.score,
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ]
        row.update(
            completions=comps,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generated_tokens=sum(len(c.token_ids) for c in out.outputs),
            error=None,
        )
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
        choices: list[dict[str, Any]]
        if req.chat:
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                }
                for c in out.outputs
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": c.index, "text": c.text, "finish_reason": c.finish_reason} for c in out.outputs
            ]
            obj = "text_completion"
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
