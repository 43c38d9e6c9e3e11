"""Job configuration: YAML or TOML, ``--set key=value`` overrides, validated into frozen dataclasses.
Every problem is collected into one ``ConfigError`` message (the CLI exits with code 2)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from batchgen.config import EngineConfig
from batchgen.params import BeamSearchParams, SamplingParams

INPUT_FORMATS = ("auto", "parquet", "arrow", "jsonl", "hf", "openai")
OUTPUT_FORMATS = ("parquet", "openai")


class ConfigError(ValueError):
    """The job config is invalid; the message lists every problem found."""


@dataclass(frozen=True)
class InputConfig:
    path: str
    format: str = "auto"
    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    params_column: str | None = None  # a struct / JSON-object column of per-row generation overrides
    batch_rows: int = 1024
    limit: int | None = None


@dataclass(frozen=True)
class OutputConfig:
    path: str
    format: str = "parquet"
    rows_per_shard: int = 1000
    flush_seconds: float = 60.0


@dataclass(frozen=True)
class RunConfig:
    max_rows_in_flight: int | None = None  # default: 4 x engine max_num_seqs
    progress: bool = True
    shard: str | None = None  # "INDEX/COUNT": take a deterministic slice of the input
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class JobConfig:
    model: str
    input: InputConfig
    output: OutputConfig
    generation: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    run: RunConfig = field(default_factory=RunConfig)
    source_file: str | None = None

    @property
    def is_beam(self) -> bool:
        return "beam_width" in self.generation

    def params(self, overrides: dict[str, Any] | None = None) -> SamplingParams | BeamSearchParams:
        values = {**self.generation, **(overrides or {})}
        return (
            BeamSearchParams.from_dict(values) if "beam_width" in values else SamplingParams.from_dict(values)
        )

    def fingerprint(self) -> dict[str, Any]:
        """What decides the results: a changed value here makes a resume refuse."""
        model = Path(self.model)
        weights = (
            sorted(
                (p.name, p.stat().st_size)
                for p in model.glob("*")
                if p.suffix in (".safetensors", ".bin", ".json")
            )
            if model.is_dir()
            else []
        )
        result_engine = {k: v for k, v in self.engine.items() if k in ("dtype", "max_model_len", "seed")}
        return {
            "model": str(model.resolve()),
            "model_files": hashlib.sha256(json.dumps(weights).encode()).hexdigest()[:16],
            "engine": result_engine,
            "generation": self.generation,
            "input": {
                k: getattr(self.input, k)
                for k in (
                    "path",
                    "format",
                    "prompt_column",
                    "messages_column",
                    "id_column",
                    "params_column",
                    "limit",
                )
            },
            "output_format": self.output.format,
            "shard": self.run.shard,
            "add_generation_prompt": self.run.add_generation_prompt,
        }


def _parse_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    data = yaml.safe_load(text)
    return data or {}


def apply_overrides(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``--set generation.max_tokens=32`` style overrides; values are parsed as YAML scalars."""
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def _section(cls, raw: Any, name: str, problems: list[str]):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{name}: must be a mapping, got {type(raw).__name__}")
        return None
    allowed = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in allowed:
            problems.append(f"{name}.{key}: unknown key (allowed: {', '.join(allowed)})")
    kwargs = {k: v for k, v in raw.items() if k in allowed}
    for k, v in kwargs.items():
        typ = str(allowed[k].type)
        if v is None:
            continue
        if (
            ("int" in typ and "str" not in typ and (not isinstance(v, int) or isinstance(v, bool)))
            or (typ in ("str", "str | None") and not isinstance(v, str))
            or (typ == "bool" and not isinstance(v, bool))
        ):
            problems.append(f"{name}.{k}: wrong type {type(v).__name__} ({typ} expected)")
    try:
        return cls(**kwargs)
    except TypeError as e:
        problems.append(f"{name}: {e}")
        return None


def input_files(path: str) -> list[str]:
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path, recursive=True))
    p = Path(path)
    if p.is_dir():
        return [str(p)]
    return [str(p)] if p.exists() else []


def load_job_config(path: str | os.PathLike, sets: list[str] | None = None) -> JobConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = _parse_file(p)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot parse {str(p)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{str(p)!r}: the top level must be a mapping")
    data = apply_overrides(data, sets or [])
    return validate(data, source_file=str(p))


def validate(data: dict[str, Any], source_file: str | None = None) -> JobConfig:
    problems: list[str] = []
    top = {"model", "engine", "input", "generation", "output", "run"}
    for key in data:
        if key not in top:
            problems.append(f"{key}: unknown top-level key (allowed: {', '.join(sorted(top))})")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        problems.append("model: required, the path of a local Hugging Face model directory")
    elif not Path(model).is_dir():
        problems.append(f"model: directory {model!r} does not exist")
    inp = _section(InputConfig, data.get("input"), "input", problems) if data.get("input") else None
    if data.get("input") is None:
        problems.append(
            "input: required section (input.path and input.prompt_column or input.messages_column)"
        )
    out = _section(OutputConfig, data.get("output"), "output", problems) if data.get("output") else None
    if data.get("output") is None:
        problems.append("output: required section (output.path)")
    run = _section(RunConfig, data.get("run"), "run", problems) or RunConfig()
    engine = data.get("engine") or {}
    if not isinstance(engine, dict):
        problems.append("engine: must be a mapping")
        engine = {}
    else:
        try:
            EngineConfig.from_kwargs(model or ".", **engine)
        except (ValueError, TypeError) as e:
            problems.append(f"engine: {e}")
    gen = data.get("generation") or {}
    if not isinstance(gen, dict):
        problems.append("generation: must be a mapping")
        gen = {}
    else:
        try:
            (BeamSearchParams if "beam_width" in gen else SamplingParams).from_dict(gen)
        except (ValueError, TypeError) as e:
            problems.append(f"generation: {e}")
    if inp is not None:
        if inp.format not in INPUT_FORMATS:
            problems.append(f"input.format: must be one of {', '.join(INPUT_FORMATS)}, got {inp.format!r}")
        files = input_files(inp.path)
        if not files:
            problems.append(f"input.path: nothing found at {inp.path!r}")
        fmt = detect_format(inp, files) if files and inp.format in INPUT_FORMATS else inp.format
        if fmt != "openai":
            if bool(inp.prompt_column) == bool(inp.messages_column):
                problems.append("input: set exactly one of prompt_column or messages_column")
            elif files:
                from batchgen.job.source import column_names

                try:
                    names = column_names(inp, files, fmt)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"input.path: cannot read {inp.path!r} as {fmt}: {e}")
                    names = None
                if names is not None:
                    for key in ("prompt_column", "messages_column", "id_column", "params_column"):
                        col = getattr(inp, key)
                        if col and col not in names:
                            problems.append(
                                f"input.{key}: column {col!r} is not in the data (columns: {', '.join(names)})"
                            )
        if inp.batch_rows < 1:
            problems.append("input.batch_rows: must be >= 1")
    if out is not None:
        if out.format not in OUTPUT_FORMATS:
            problems.append(f"output.format: must be one of {', '.join(OUTPUT_FORMATS)}, got {out.format!r}")
        if out.rows_per_shard < 1:
            problems.append("output.rows_per_shard: must be >= 1")
    if run.shard is not None:
        try:
            i, n = (int(x) for x in run.shard.split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            problems.append(f"run.shard: must be 'INDEX/COUNT' with 0 <= INDEX < COUNT, got {run.shard!r}")
    if problems:
        raise ConfigError(
            "invalid job config"
            + (f" {source_file!r}" if source_file else "")
            + ":\n  - "
            + "\n  - ".join(problems)
        )
    return JobConfig(
        model=model,
        input=inp,
        output=out,
        generation=gen,
        engine=engine,
        run=run,  # type: ignore[arg-type]
        source_file=source_file,
    )


def detect_format(inp: InputConfig, files: list[str]) -> str:
    if inp.format != "auto":
        return inp.format
    first = Path(files[0])
    if first.is_dir():
        if (
            (first / "dataset_info.json").exists()
            or (first / "state.json").exists()
            or (first / "dataset_dict.json").exists()
        ):
            return "hf"
        inner = sorted(first.rglob("*"))
        suffixes = {p.suffix for p in inner if p.is_file()}
        if ".parquet" in suffixes:
            return "parquet"
        if suffixes & {".arrow", ".feather", ".ipc"}:
            return "arrow"
        if suffixes & {".jsonl", ".json"}:
            return "jsonl"
        return "parquet"
    suffix = first.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".arrow", ".feather", ".ipc"):
        return "arrow"
    if suffix in (".jsonl", ".json", ".ndjson"):
        with open(first) as f:
            line = f.readline()
        try:
            obj = json.loads(line) if line.strip() else {}
        except ValueError:
            obj = {}
        return "openai" if isinstance(obj, dict) and "custom_id" in obj and "body" in obj else "jsonl"
    return "parquet"
