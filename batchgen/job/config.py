"""Job configuration: YAML or TOML, ``--set key=value`` overrides, validated into frozen dataclasses.
Every problem is collected into one ``ConfigError`` message (the CLI exits with code 2)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from batchgen import storage
from batchgen.config import EngineConfig
from batchgen.job.sink import generation_fields, score_fields
from batchgen.model.hub import local_dir, snapshot_revision
from batchgen.params import BeamSearchParams, LoRARequest, SamplingParams, ScoreParams

INPUT_FORMATS = ("auto", "parquet", "arrow", "jsonl", "hf", "openai")
TASKS = ("generate", "score")
# generation keys that are not sampling parameters: the job's reasoning parser (an engine setting)
# and the chat template's keyword arguments (per job, or per row in the params column)
TEMPLATE_KEYS = ("chat_template_kwargs",)
JOB_ONLY_KEYS = ("reasoning_parser",)
# what a scoring job takes of generation:
SCORE_KEYS = ("logprobs", "chat_template_kwargs")
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
    lora_column: str | None = None  # each row's LoRA adapter: a name of lora.adapters, or null (the base model)
    # task: score: each row's continuation (text) or continuations (a list of texts) to score
    continuation_column: str | None = None
    batch_rows: int = 1024
    limit: int | None = None


@dataclass(frozen=True)
class OutputConfig:
    path: str
    format: str = "parquet"
    rows_per_shard: int = 1000
    flush_seconds: float = 60.0
    # per-token log-probabilities held for the writer: a shard is written once its rows hold this
    # many MiB, and the rows waiting for the writer hold at most as much
    max_shard_mb: float = 64.0


@dataclass(frozen=True)
class RunConfig:
    max_rows_in_flight: int | None = None  # default: 4 x engine max_num_seqs
    # rows looked ahead to order admission by shared prefix (engine.admission_order "prefix");
    # default: 4 x max_rows_in_flight
    lookahead_rows: int | None = None
    progress: bool = True
    shard: str | None = None  # "INDEX/COUNT": take a deterministic slice of the input
    add_generation_prompt: bool = True
    # a job whose output has more failed rows than this share exits 1 (its rows are kept)
    max_failed_fraction: float = 0.5
    executor: str = "local"  # "local": this process; "ray": a pool of engine actors on Ray Data
    # engines of a local job, each a sharded worker on its own CPUs: a number, or "auto" (one per
    # NUMA node the job may use); batchgen/job/local_replicas.py
    replicas: int | str = 1


EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class RayConfig:
    """``executor: ray``: engines as Ray actors fed by Ray Data (``batchgen/job/ray_executor.py``)."""

    address: str | None = None  # null: join RAY_ADDRESS if set, else start a local Ray; "auto": a running one
    num_replicas: int = 1  # engine actors
    cpus_per_replica: float = 1.0  # also the replica's torch threads
    gpus_per_replica: float = 0.0
    batch_rows: int = 256  # rows per unit of work: one read task, one engine call, one shard


@dataclass(frozen=True)
class LoRAConfig:
    """``lora:``: PEFT LoRA adapters by name, for ``input.lora_column``."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> adapter directory or hub id
    max_loras: int | None = None  # resident at once; default: all of them, at most 4
    max_lora_rank: int | None = None  # default: the largest rank among the adapters

    def requests(self) -> dict[str, LoRARequest]:
        """One ``LoRARequest`` per adapter, ids 1, 2, ... in name order."""
        return {
            name: LoRARequest(name, i, str(Path(self.directory(name)).resolve()))
            for i, name in enumerate(sorted(self.adapters), start=1)
        }

    def directory(self, name: str) -> str:
        """Adapter ``name``'s directory (a hub id's cached snapshot)."""
        return local_dir(self.adapters[name], None, f"lora.adapters.{name}")

    def engine_settings(self) -> dict[str, Any]:
        if not self.adapters:
            return {}
        return {
            "enable_lora": True,
            "max_loras": self.max_loras or min(len(self.adapters), 4),
            "max_lora_rank": self.max_lora_rank or max(adapter_rank(self.directory(n)) for n in self.adapters),
        }

    def fingerprint(self) -> dict[str, str]:
        """Each adapter's files, hashed: a changed adapter is a changed config."""
        out = {}
        for name in sorted(self.adapters):
            digest = hashlib.sha256()
            for f in sorted(p for p in Path(self.directory(name)).glob("*") if p.is_file()):
                digest.update(f.name.encode() + b"\0" + f.read_bytes())
            out[name] = digest.hexdigest()[:16]
        return out


def adapter_rank(path: str) -> int:
    """The largest rank an adapter's ``adapter_config.json`` declares (``r`` and ``rank_pattern``)."""
    try:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        ranks = [int(cfg.get("r", 8))] + [int(r) for r in (cfg.get("rank_pattern") or {}).values()]
    except (OSError, ValueError, TypeError):
        return 16
    return max(ranks)


@dataclass(frozen=True)
class JobConfig:
    model: str
    input: InputConfig
    output: OutputConfig
    generation: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    task: str = "generate"
    source_file: str | None = None
    storage: storage.StorageOptions = field(default_factory=storage.StorageOptions)

    def engine_config(self) -> EngineConfig:
        """The engine's settings: ``engine:``, with LoRA switched on when ``lora:`` names adapters
        and the reasoning parser of ``generation.reasoning_parser``."""
        parser = self.reasoning_parser
        extra = {"reasoning_parser": parser} if parser else {}
        return EngineConfig.from_kwargs(self.model, **{**self.engine, **extra, **self.lora.engine_settings()})

    @property
    def reasoning_parser(self) -> str | None:
        """The reasoning parser: ``generation.reasoning_parser``, or the engine setting."""
        return self.generation.get("reasoning_parser") or self.engine.get("reasoning_parser")

    @property
    def sampling(self) -> dict[str, Any]:
        """``generation`` without the keys that are not sampling parameters."""
        return {k: v for k, v in self.generation.items() if k not in TEMPLATE_KEYS + JOB_ONLY_KEYS}

    def output_fields(self) -> list[pa.Field]:
        """The output columns: per-token log-probabilities and reasoning only where asked."""
        gen = self.generation
        if self.task == "score":
            return score_fields(logprobs=gen.get("logprobs") is not None)
        return generation_fields(
            logprobs=gen.get("logprobs") is not None,
            prompt_logprobs=gen.get("prompt_logprobs") is not None,
            reasoning=bool(self.reasoning_parser),
        )

    def template_kwargs(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The chat template's keyword arguments: the job's, then the row's on top."""
        job = self.generation.get("chat_template_kwargs") or {}
        row = (overrides or {}).get("chat_template_kwargs") or {}
        if not isinstance(row, dict):
            raise ValueError(f"chat_template_kwargs must be an object, got {type(row).__name__}")
        return {**job, **row}

    def params(self, overrides: dict[str, Any] | None = None) -> SamplingParams | BeamSearchParams:
        """The generation parameters with a row's overrides. A row that gives ``beam_width`` in a
        sampling job runs beam search, keeping only the settings the two share (``max_tokens``,
        ``min_tokens``, ``stop_token_ids``, ``ignore_eos``). Keys whose results the job's columns
        cannot hold are refused (``unwritten``)."""
        overrides = {k: v for k, v in (overrides or {}).items() if k not in TEMPLATE_KEYS}
        for key in JOB_ONLY_KEYS:
            if key in overrides:
                raise ValueError(f"{key} is set for the whole job (generation.{key}), not per row")
        base = self.sampling
        if "beam_width" in overrides and "beam_width" not in base:
            shared = {f.name for f in fields(BeamSearchParams)}
            base = {k: v for k, v in base.items() if k in shared}
        values = {**base, **overrides}
        problem = unwritten(values, self.generation)
        if problem is not None:
            raise ValueError(problem)
        return (
            BeamSearchParams.from_dict(values) if "beam_width" in values else SamplingParams.from_dict(values)
        )

    def score_params(self, continuations: list[list[int]], overrides: dict[str, Any] | None = None) -> ScoreParams:
        """A scoring row's parameters: its continuations' token ids and the job's ``logprobs``."""
        overrides = {k: v for k, v in (overrides or {}).items() if k not in TEMPLATE_KEYS}
        unknown = sorted(set(overrides) - {"logprobs"})
        if unknown:
            raise ValueError(f"a scoring row takes logprobs and chat_template_kwargs only, got {', '.join(unknown)}")
        problem = unwritten(overrides, self.generation)
        if problem is not None:
            raise ValueError(problem)
        return ScoreParams(continuations=continuations, logprobs=overrides.get("logprobs", self.generation.get("logprobs")))

    def fingerprint(self) -> dict[str, Any]:
        """What decides the results: a changed value here makes a resume refuse. A hub model is
        named by its id and the commit its snapshot holds, so a moved branch refuses too."""
        local = Path(local_dir(self.model, self.engine.get("revision"), "model", self.engine.get("download_dir")))
        hub = not Path(self.model).is_dir()
        model = local
        weights = (
            sorted(
                (p.name, p.stat().st_size)
                for p in model.glob("*")
                if p.suffix in (".safetensors", ".bin", ".json")
            )
            if model.is_dir()
            else []
        )
        result_engine = {k: v for k, v in self.engine.items() if k in ("dtype", "max_model_len", "seed", "reasoning_parser")}
        return {
            **({"task": self.task} if self.task != "generate" else {}),
            "model": self.model if hub else str(model.resolve()),
            **({"model_revision": snapshot_revision(str(local))} if hub else {}),
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
                    "lora_column",
                    "continuation_column",
                    "limit",
                )
            },
            **({"lora": self.lora.fingerprint()} if self.lora.adapters else {}),
            "output_format": self.output.format,
            "shard": self.run.shard,
            "add_generation_prompt": self.run.add_generation_prompt,
            # a Ray run's shards are its units of work: their size is part of what is on disk
            **({"executor": "ray", "ray_batch_rows": self.ray.batch_rows} if self.run.executor == "ray" else {}),
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
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: the value {raw!r} is not valid YAML ({e.__class__.__name__})") from None
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
            hint = difflib.get_close_matches(str(key), list(allowed), n=1)
            problems.append(
                f"{name}.{key}: unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f" (allowed: {', '.join(allowed)})"
            )
    kwargs = {}
    for k, v in raw.items():
        if k not in allowed:
            continue
        typ = str(allowed[k].type)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and (
            ("int" in typ and "str" not in typ and (not isinstance(v, int) or isinstance(v, bool)))
            or (typ in ("str", "str | None") and not isinstance(v, str))
            or (typ == "bool" and not isinstance(v, bool))
            or (typ == "float" and not number)
        ):
            problems.append(f"{name}.{k}: wrong type {type(v).__name__} ({typ} expected)")
            continue  # the default stands in, so that later checks see a value of the right type
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        problems.append(f"{name}: {e}")
        return None


def unwritten(values: dict[str, Any], job: dict[str, Any]) -> str | None:
    """A key a row asks for that the job's output has no column for (the columns follow the job's
    ``generation``), named so that it is refused instead of silently dropped; None when none."""
    for key in ("logprobs", "prompt_logprobs"):
        if values.get(key) is not None and job.get(key) is None:
            return f"{key}: the job writes no {key} column; set generation.{key} in the job config for it"
    if values.get("prompt_logprobs") is not None and "beam_width" in values:
        return "prompt_logprobs: beam search rows have none; drop prompt_logprobs or beam_width"
    return None


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"INDEX/COUNT"`` -> ``(INDEX, COUNT)``; None for an unsharded job."""
    if spec is None:
        return None
    try:
        index, count = (int(x) for x in str(spec).split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise ValueError(f"must be 'INDEX/COUNT' with 0 <= INDEX < COUNT, got {spec!r}")
    return index, count


def parse_config_file(path: str | os.PathLike, sets: list[str] | None = None) -> dict[str, Any]:
    """The config file's mapping, with ``--set`` overrides applied."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = _parse_file(p)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot parse {str(p)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{str(p)!r}: the top level must be a mapping")
    return apply_overrides(data, sets or [])


def validate(data: dict[str, Any], source_file: str | None = None) -> JobConfig:
    """The config's schema and rules, every problem listed in one ``ConfigError``. It reads no file
    and no network and sets nothing: what must touch the world (the model resolves, the input is
    there with its columns, the output can be written) is ``job.preflight.check_world``'s."""
    return draft(data, source_file).config()


@dataclass
class Draft:
    """A config as far as its sections parsed, with every problem ``validate`` found in it."""

    source_file: str | None
    problems: list[str]
    model: str | None
    input: InputConfig | None
    output: OutputConfig | None
    generation: dict[str, Any]
    engine: dict[str, Any]
    run: RunConfig
    ray: RayConfig
    lora: LoRAConfig
    task: str
    storage: storage.StorageOptions

    def error(self, problems: list[str]) -> ConfigError:
        where = f" {self.source_file!r}" if self.source_file else ""
        return ConfigError(f"invalid job config{where}:\n  - " + "\n  - ".join(problems))

    @classmethod
    def of(cls, cfg: JobConfig) -> Draft:
        """A validated config as a draft without problems."""
        return cls(cfg.source_file, [], cfg.model, cfg.input, cfg.output, cfg.generation, cfg.engine, cfg.run,
                   cfg.ray, cfg.lora, cfg.task, cfg.storage)

    def config(self) -> JobConfig:
        """The validated config; ``ConfigError`` listing the problems when there are any."""
        if self.problems:
            raise self.error(self.problems)
        assert self.model is not None and self.input is not None and self.output is not None  # else a problem
        return JobConfig(
            model=self.model,
            input=self.input,
            output=self.output,
            generation=self.generation,
            engine=self.engine,
            run=self.run,
            ray=self.ray,
            lora=self.lora,
            task=self.task,
            source_file=self.source_file,
            storage=self.storage,
        )


def draft(data: dict[str, Any], source_file: str | None = None) -> Draft:
    """Every section of ``data`` parsed as far as it goes, and every problem with them (pure)."""
    problems: list[str] = []
    top = {"model", "engine", "input", "generation", "output", "run", "ray", "lora", "task", "storage"}
    for key in data:
        if key not in top:
            problems.append(f"{key}: unknown top-level key (allowed: {', '.join(sorted(top))})")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        problems.append("model: required, a local Hugging Face model directory or a hub id (org/name)")
    store_opts = _section(storage.StorageOptions, data.get("storage"), "storage", problems) or storage.StorageOptions()
    try:
        store_opts.check()
    except ValueError as e:
        problems.append(str(e))
    inp = _section(InputConfig, data.get("input"), "input", problems) if data.get("input") else None
    if data.get("input") is None:
        problems.append(
            "input: required section (input.path and input.prompt_column or input.messages_column)"
        )
    out = _section(OutputConfig, data.get("output"), "output", problems) if data.get("output") else None
    if data.get("output") is None:
        problems.append("output: required section (output.path)")
    run = _section(RunConfig, data.get("run"), "run", problems) or RunConfig()
    ray = _section(RayConfig, data.get("ray"), "ray", problems) or RayConfig()
    lora = _lora_section(data.get("lora"), problems)
    engine = _mapping(data, "engine", problems, lambda v: EngineConfig.from_kwargs(model or ".", **v))
    task = data.get("task", "generate")
    if task not in TASKS:
        problems.append(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
        task = "generate"
    gen = _mapping(data, "generation", problems, lambda v: _check_generation(v, task))
    if gen.get("thinking_token_budget") is not None and not (gen.get("reasoning_parser") or engine.get("reasoning_parser")):
        problems.append("generation.thinking_token_budget: needs generation.reasoning_parser (the end tag to force)")
    if inp is not None:
        _check_input(inp, task, lora, problems)
    if task == "score" and inp is not None and out is not None and "openai" in (inp.format, out.format):
        problems.append("task: score reads and writes Parquet, Arrow, JSON Lines or datasets; the OpenAI batch format has no scoring")
    if out is not None:
        _check_output(out, problems)
    _check_run(run, ray, problems)
    return Draft(source_file, problems, model if isinstance(model, str) and model else None, inp, out, gen, engine,
                 run, ray, lora, task, store_opts)


def _check_input(inp: InputConfig, task: str, lora: LoRAConfig, problems: list[str]) -> None:
    """``input``'s values and how they fit the task (its data: ``preflight``)."""
    if inp.format not in INPUT_FORMATS:
        problems.append(f"input.format: must be one of {', '.join(INPUT_FORMATS)}, got {inp.format!r}")
    if inp.batch_rows < 1:
        problems.append("input.batch_rows: must be >= 1")
    if task == "score" and not inp.continuation_column:
        problems.append("input.continuation_column: required with task: score (each row's continuation or list of them)")
    if task != "score" and inp.continuation_column:
        problems.append("input.continuation_column: only a scoring job reads it; set task: score")
    if inp.lora_column and not lora.adapters:
        problems.append("input.lora_column: needs adapters to name (lora.adapters: {NAME: PATH})")


def _check_output(out: OutputConfig, problems: list[str]) -> None:
    s = storage.scheme(out.path)
    if s is not None and s not in storage.OUTPUT_SCHEMES:
        problems.append(
            f"output.path: {storage.redact(out.path)!r}: a job writes to a local directory or s3:// (any "
            f"S3-compatible store); {s}:// can be read (input.path) but not written"
        )
    if out.format not in OUTPUT_FORMATS:
        problems.append(f"output.format: must be one of {', '.join(OUTPUT_FORMATS)}, got {out.format!r}")
    if out.rows_per_shard < 1:
        problems.append("output.rows_per_shard: must be >= 1")
    if not out.max_shard_mb > 0:
        problems.append("output.max_shard_mb: must be > 0")


def _check_run(run: RunConfig, ray: RayConfig, problems: list[str]) -> None:
    """``run`` and ``ray``: limits, the worker layout and the executor."""
    for key in ("max_rows_in_flight", "lookahead_rows"):
        value = getattr(run, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"run.{key}: must be an integer >= 1 or null, got {value!r}")
    if not 0 <= run.max_failed_fraction <= 1:
        problems.append(f"run.max_failed_fraction: must be in [0, 1], got {run.max_failed_fraction!r}")
    if run.shard is not None:
        try:
            parse_shard(run.shard)
        except ValueError as e:
            problems.append(f"run.shard: {e}")
    if run.replicas != "auto" and (
        not isinstance(run.replicas, int) or isinstance(run.replicas, bool) or run.replicas < 1
    ):
        problems.append(f"run.replicas: must be an integer >= 1 or auto, got {run.replicas!r}")
    elif run.replicas != 1 and run.shard is not None:
        problems.append("run.replicas: a sharded worker (run.shard) runs one engine; drop one of the two")
    elif run.replicas != 1 and run.executor == "ray":
        problems.append("run.replicas: a Ray job sets its engines with ray.num_replicas; drop run.replicas")
    if run.executor not in EXECUTORS:
        problems.append(f"run.executor: must be one of {', '.join(EXECUTORS)}, got {run.executor!r}")
    elif run.executor == "ray" and run.shard is not None:
        problems.append("run.shard: a Ray job spreads its rows over its replicas itself; drop run.shard")
    if ray.num_replicas < 1 or ray.batch_rows < 1:
        problems.append("ray.num_replicas and ray.batch_rows: must be >= 1")
    if ray.cpus_per_replica <= 0 or ray.gpus_per_replica < 0:
        problems.append("ray.cpus_per_replica: must be > 0; ray.gpus_per_replica: must be >= 0")


def _check_generation(values: dict[str, Any], task: str) -> None:
    """``generation``: sampling or beam-search parameters, plus the reasoning parser and the chat
    template's keyword arguments; a scoring job takes ``logprobs`` and the template's arguments."""
    from batchgen.reasoning import parser_names

    parser = values.get("reasoning_parser")
    if parser is not None and parser not in parser_names():
        raise ValueError(f"reasoning_parser must be one of {', '.join(parser_names())}, got {parser!r}")
    kwargs = values.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a mapping, got {type(kwargs).__name__}")
    if task == "score":
        unknown = sorted(set(values) - set(SCORE_KEYS))
        if unknown:
            raise ValueError(f"a scoring job takes {', '.join(SCORE_KEYS)}; drop {', '.join(unknown)}")
        ScoreParams(continuations=[[0]], logprobs=values.get("logprobs"))
        return
    sampling = {k: v for k, v in values.items() if k not in TEMPLATE_KEYS + JOB_ONLY_KEYS}
    (BeamSearchParams if "beam_width" in sampling else SamplingParams).from_dict(sampling)


def _lora_section(raw: Any, problems: list[str]) -> LoRAConfig:
    """``lora:``: adapters (each a directory with adapter_config.json), max_loras, max_lora_rank."""
    if raw is None:
        return LoRAConfig()
    section = _section(LoRAConfig, raw, "lora", problems)
    if section is None:
        return LoRAConfig()
    adapters = section.adapters
    if not isinstance(adapters, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in adapters.items()):
        problems.append("lora.adapters: must map adapter names to adapter directories ({NAME: PATH})")
        return LoRAConfig()
    for key in ("max_loras", "max_lora_rank"):
        value = getattr(section, key)
        if value is not None and value < 1:
            problems.append(f"lora.{key}: must be an integer >= 1 or null, got {value!r}")
    return section


def _mapping(data: dict[str, Any], name: str, problems: list[str], check: Callable[[dict], object]) -> dict:
    """The section ``name`` as a dict (empty when absent), after ``check`` accepted it."""
    value = data.get(name) or {}
    if not isinstance(value, dict):
        problems.append(f"{name}: must be a mapping")
        return {}
    try:
        check(value)
    except (ValueError, TypeError) as e:
        problems.append(f"{name}: {e}")
    return value
