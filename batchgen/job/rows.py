"""One input row to a request, one finished request to an output row: what the local runner and the
Ray executor share, so that both write the same rows for the same input."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from batchgen.engine.sampler import splitmix64
from batchgen.job.config import JobConfig
from batchgen.outputs import RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams


@dataclass
class Request:
    row: dict[str, Any]
    rid: str
    token_ids: list[int] | None = None
    params: SamplingParams | BeamSearchParams | None = None
    error: str | None = None
    chat: bool = False


def input_row_id(row: dict[str, Any], key: str | None, position: int) -> str:
    """A job row's id: ``str(row[key])`` (``key``: the id column, or ``custom_id`` for OpenAI batch
    input), its input position when there is no id column, ``#POSITION`` when the row lacks the id."""
    rid = str(position) if key is None else row.get(key)
    return f"#{position}" if rid is None else str(rid)


def stable_seed(seed: int, row_id: str) -> int:
    h = splitmix64(seed & (2**64 - 1))
    for byte in row_id.encode():
        h = splitmix64(h ^ byte)
    return h & (2**63 - 1)


class RowCodec:
    """Builds requests from input rows (prompt or chat messages, per-row parameters, the row's own
    seed) and output rows from finished requests, for one job config."""

    def __init__(self, cfg: JobConfig, openai_in: bool) -> None:
        self.cfg = cfg
        self.openai_in = openai_in

    def build(self, tokenizer, row: dict[str, Any], rid: str) -> Request:
        req = Request(row=row, rid=rid)
        inp = self.cfg.input
        try:
            if "__error__" in row:
                raise ValueError(row["__error__"])
            overrides: dict[str, Any] = {}
            if self.openai_in:
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
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
            else:
                prompt = row.get(inp.prompt_column) if inp.prompt_column else None
                messages = row.get(inp.messages_column) if inp.messages_column else None
                if inp.params_column and row.get(inp.params_column) is not None:
                    raw = row[inp.params_column]
                    overrides = json.loads(raw) if isinstance(raw, str) else dict(raw)
                    if not isinstance(overrides, dict):
                        raise ValueError(f"{inp.params_column} must hold an object of generation parameters")
                    overrides = {k: v for k, v in overrides.items() if v is not None}
            if messages is not None or (inp.messages_column and not self.openai_in):
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list of {role, content} objects")
                try:
                    text = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=self.cfg.run.add_generation_prompt
                    )
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"chat template failed: {e}") from None
                req.chat = True
                req.token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                if prompt is None:
                    raise ValueError("prompt is null")
                if not isinstance(prompt, str):
                    raise ValueError(f"prompt must be text, got {type(prompt).__name__}")
                if not prompt.strip():
                    raise ValueError("prompt is empty")
                req.token_ids = tokenizer(prompt)["input_ids"]
            params = self.cfg.params(overrides)
            if isinstance(params, SamplingParams) and (params.seed is None or "seed" not in overrides):
                base = self.cfg.generation.get("seed", self.cfg.engine.get("seed", 0))
                params.seed = stable_seed(int(base), rid)
            req.params = params
        except (ValueError, TypeError) as e:
            req.error = str(e)
        return req

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
        if out is None:
            return {
                "id": f"batch_req_{rid}",
                "custom_id": rid,
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
            "custom_id": rid,
            "response": {"status_code": 200, "request_id": rid, "body": body},
            "error": None,
        }
