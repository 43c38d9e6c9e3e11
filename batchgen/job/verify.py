"""``python -m batchgen verify OUT``: do the shards of every worker of a job cover every input row
exactly once? Then write the combined report.

The config is the one the manifests in ``OUT/.batchgen`` name (or ``--config``). The expected ids
are the input's (after ``limit``; a repeated id counts once, as the runner skips the repeat), the
found ids those of every shard in ``OUT`` whatever worker or executor wrote it. Missing and
duplicated ids are named, with the shards that hold each duplicate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.job.config import ConfigError, JobConfig
from batchgen.job.preflight import load_job_config
from batchgen.job.rows import RowIdentities
from batchgen.job.sink import shard_ids
from batchgen.job.source import detect_format, input_files, iter_rows
from batchgen.job.store import BOOKKEEPING_DIR, OutputStore, open_store
from batchgen.job.workers import SHARD_NAME, SUMMED, merge_reports, worker_reports

SHOWN = 20  # ids named per kind of problem


@dataclass
class Verification:
    rows_expected: int = 0
    rows_in_output: int = 0
    missing: list[str] = field(default_factory=list)
    duplicated: dict[str, list[str]] = field(default_factory=dict)  # id -> the shards that hold it
    unexpected: list[str] = field(default_factory=list)  # ids in the output but not in the input
    shards: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)

    def render(self) -> str:
        lines = [
            f"verify: {self.rows_in_output} rows in {self.shards} shards for {self.rows_expected} input rows: "
            + ("every row exactly once" if self.ok else "NOT exactly once")
        ]
        if self.missing:
            lines.append(f"  missing {len(self.missing)} ids: {_some(self.missing)}")
        if self.duplicated:
            shown = list(self.duplicated.items())[:SHOWN]
            where = "; ".join(f"{rid} in {', '.join(names)}" for rid, names in shown)
            more = f"; ... {len(self.duplicated) - SHOWN} more" if len(self.duplicated) > SHOWN else ""
            lines.append(f"  duplicated {len(self.duplicated)} ids: {where}{more}")
        if self.unexpected:
            lines.append(f"  {len(self.unexpected)} ids not in the input: {_some(self.unexpected)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rows_expected": self.rows_expected,
            "rows_in_output": self.rows_in_output,
            "shards": self.shards,
            "missing": self.missing[:1000],
            "duplicated": dict(list(self.duplicated.items())[:1000]),
            "unexpected": self.unexpected[:1000],
        }


def _some(ids: list[str]) -> str:
    return ", ".join(ids[:SHOWN]) + (f", ... {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


def config_of(store: OutputStore) -> str:
    """The config file the manifests of the output name (they must agree)."""
    names = set()
    for name in store.files(BOOKKEEPING_DIR):
        if not (name.startswith("manifest") and name.endswith(".json")):
            continue
        try:
            names.add(json.loads(store.read(f"{BOOKKEEPING_DIR}/{name}") or b"").get("config"))
        except ValueError:
            continue
    names.discard(None)
    if not names:
        raise ConfigError(f"{store.display}: no manifest names the job's config; pass --config")
    if len(names) > 1:
        raise ConfigError(
            f"{store.display}: the manifests name different configs ({', '.join(sorted(names))}); pass --config"
        )
    return names.pop()


def expected_ids(cfg: JobConfig) -> list[str]:
    """The ids of the input rows a job produces, each once, in input order."""
    files = input_files(cfg.input.path)
    fmt = detect_format(cfg.input, files)
    identities = RowIdentities("custom_id" if fmt == "openai" else cfg.input.id_column)
    ids: list[str] = []
    position = 0
    limit = cfg.input.limit
    for batch in iter_rows(files, fmt, cfg.input.batch_rows):
        for row in batch:
            if limit is not None and position >= limit:
                return ids
            ids.append(identities(row, position)[0])
            position += 1
    return ids


def verify(out_dir: str | Path, config: str | None = None) -> Verification:
    """``out_dir``: a local directory or an ``s3://`` prefix (read with ``config``'s storage
    options, else the environment's)."""
    cfg = load_job_config(config) if config else None
    out = open_store(str(out_dir))
    if not out.exists():
        raise ConfigError(f"output directory {out.display!r} does not exist")
    if cfg is None:
        cfg = load_job_config(config_of(out))
    files = input_files(cfg.input.path)
    openai_in = detect_format(cfg.input, files) == "openai"
    id_key = "custom_id" if openai_in else (cfg.input.id_column or "row_index")
    expected = expected_ids(cfg)
    first: dict[str, str] = {}  # id -> the shard it was first found in
    duplicated: dict[str, list[str]] = {}
    result = Verification(rows_expected=len(expected))
    for shard in (n for n in out.files() if SHARD_NAME.match(n)):
        result.shards += 1
        for rid in shard_ids(out, shard, id_key):
            result.rows_in_output += 1
            if rid in first:
                duplicated.setdefault(rid, [first[rid]]).append(shard)
            else:
                first[rid] = shard
    expected_set = set(expected)
    result.missing = [rid for rid in expected if rid not in first]
    result.duplicated = duplicated
    result.unexpected = [rid for rid in first if rid not in expected_set]
    return result


def combined_report(out_dir: str | Path, result: Verification) -> dict[str, Any]:
    """The workers' reports summed (rows, tokens, errors; wall time the longest), with the
    verification, written to ``OUT/.batchgen/report.json``."""
    store = open_store(str(out_dir))
    parts = worker_reports(store)
    merged = merge_reports(parts, result.rows_expected)
    combined: dict[str, Any] = {"workers": len(parts), **{key: getattr(merged, key) for key in SUMMED}}
    combined.update(wall_s=merged.wall_s, errors=merged.errors, generated_tokens_per_s=round(merged.tokens_per_s, 2))
    combined["rows_in_output"] = result.rows_in_output
    combined["verify"] = result.to_dict()
    store.write(f"{BOOKKEEPING_DIR}/report.json", json.dumps(combined, indent=2).encode())
    return combined
