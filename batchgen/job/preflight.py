"""The job's checks that touch the world, one step after ``config.validate`` (which reads nothing):
this process's storage options set, the model and tokenizer resolve, the adapters are PEFT
directories, the input is there, readable, and has the configured columns, and the output can be
written (a local path is no file; a bucket exists and these credentials may list it). Every problem
is one line of one ``ConfigError``, as validation's (the CLI exits with code 2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen import storage
from batchgen.job.config import Draft, InputConfig, JobConfig, draft, parse_config_file
from batchgen.job.source import check_readable, column_names, detect_format, input_files, schema_of
from batchgen.job.store import open_store
from batchgen.model.hub import is_hub_id, local_dir
from batchgen.model.loader import tokenizer_problem


def load_job_config(path: str | os.PathLike, sets: list[str] | None = None) -> JobConfig:
    """The job config of file ``path`` with ``--set`` overrides, validated (``config.validate``)
    and checked against the world (``check_world``): one ``ConfigError`` lists the problems of both."""
    parsed = draft(parse_config_file(path, sets), source_file=str(Path(path)))
    problems = parsed.problems + world_problems(parsed)
    if problems:
        raise parsed.error(problems)
    return parsed.config()


def check_world(cfg: JobConfig) -> None:
    """``ConfigError`` listing what of a validated config does not hold in the world."""
    parsed = Draft.of(cfg)
    problems = world_problems(parsed)
    if problems:
        raise parsed.error(problems)


def world_problems(cfg: Draft) -> list[str]:
    """Set the job's storage options for this process, then check what the config names (the
    sections that parsed: a draft with problems is checked as far as it goes)."""
    storage.use(cfg.storage)
    problems: list[str] = []
    if cfg.model is not None:
        _check_model(cfg.model, cfg.engine, problems)
    for name, path in cfg.lora.adapters.items():
        try:
            where = local_dir(path, None, f"lora.adapters.{name}")
        except ValueError as e:
            problems.append(f"{e}{relative_note(path)}")
            continue
        if not (Path(where) / "adapter_config.json").is_file():
            problems.append(
                f"lora.adapters.{name}: {path!r} is not a PEFT adapter directory (no adapter_config.json)"
                + relative_note(path)
            )
    if cfg.input is not None:
        _check_input(cfg.input, problems)
    if cfg.output is not None:
        _check_output(cfg.output.path, problems)
    return problems


def _check_model(model: str, engine: dict[str, Any], problems: list[str]) -> None:
    """The model (and the tokenizer, when another) resolves to a directory with a tokenizer."""
    try:
        model_dir = local_dir(model, engine.get("revision"), "model", engine.get("download_dir"))
    except ValueError as e:
        if Path(model).is_dir():
            problems.append(f"model: {e}")
        else:  # a path that is not there, and maybe an id that is not cached: both said
            missing = f"model: directory {model!r} does not exist{relative_note(model)}"
            problems.append(f"{missing}; as a hub id, {e}" if is_hub_id(model) else missing)
        return
    tok_dir = engine.get("tokenizer")
    if tok_dir is not None:
        try:
            tok_dir = local_dir(tok_dir, engine.get("tokenizer_revision"), "tokenizer", engine.get("download_dir"))
        except ValueError as e:
            problems.append(f"engine.tokenizer: {e}")
            tok_dir = None
    problem = tokenizer_problem(tok_dir or model_dir)
    if problem is not None:
        problems.append(f"{'engine.tokenizer' if tok_dir else 'model'}: {problem}")


def _check_input(inp: InputConfig, problems: list[str]) -> None:
    """The input exists, its format is known, and the configured columns are in the data."""
    try:
        files = input_files(inp.path)
    except storage.StorageError as e:
        problems.append(f"input.path: {e}")
        return
    if not files:
        problems.append(f"input.path: nothing found at {storage.redact(inp.path)!r}{relative_note(inp.path)}")
    fmt = detect_format(inp, files) if files else inp.format
    if fmt == "openai":
        return
    if bool(inp.prompt_column) == bool(inp.messages_column):
        problems.append("input: set exactly one of prompt_column or messages_column")
        return
    if not files:
        return
    try:
        names = column_names(files, fmt)
        check_readable(files, fmt)
    except storage.StorageError as e:
        problems.append(f"input.path: {e}")
        return
    except Exception as e:  # noqa: BLE001
        problems.append(f"input.path: cannot read {storage.redact(inp.path)!r} as {fmt}: {storage.redact(str(e))}")
        return
    if names is None:
        return
    if not names:
        problems.append(f"input.path: {inp.path!r} holds no rows (the input is empty)")
        return
    for key in ("prompt_column", "messages_column", "id_column", "params_column", "lora_column", "continuation_column"):
        col = getattr(inp, key)
        if col and col not in names:
            problems.append(f"input.{key}: column {col!r} is not in the data (columns: {', '.join(names)})")
    # a column's type decides for every row of a typed format; JSON Lines type their values per row
    schema = schema_of(files, fmt) if fmt != "jsonl" else None
    if inp.prompt_column and schema is not None and inp.prompt_column in schema.names:
        typ = schema.field(inp.prompt_column).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            problems.append(f"input.prompt_column: column {inp.prompt_column!r} holds {typ}, not text")


def _check_output(path: str, problems: list[str]) -> None:
    """A local output is a directory or can be made one; a bucket exists and may be listed."""
    try:
        open_store(path).check_writable()
    except (storage.StorageError, ValueError) as e:
        problems.append(f"output.path: {e}{relative_note(path)}")


def relative_note(path: str) -> str:
    """Relative paths in a config are read from the working directory, not the config's folder."""
    if storage.is_uri(path) or Path(path).is_absolute():
        return ""
    return f" (relative paths are read from the working directory, {os.getcwd()})"
