"""``run.executor: ray``: the same job on Ray Data, every row exactly once.

The input is cut into units of work of ``ray.batch_rows`` consecutive rows (unit ``c`` holds input
positions ``[c * batch_rows, (c + 1) * batch_rows)``)::

    driver:    count the input rows, list the units whose shard is not on disk yet
    Ray Data:  from_items(units, one block each)
               -> map_batches(read)          read tasks: the unit's rows, by batchgen's own readers
                                             (every input spec works as locally), one block per unit
               -> map_batches(JobReplica)    a fixed pool of engine actors; each call is one unit:
                                             generate, write shard ``part-ray-CCCCCC`` atomically,
                                             return a one-row summary
    driver:    streams the summaries: progress, the manifest, the end report

A unit's shard name depends only on the unit, so a retried task (a dead actor is restarted and its
task retried) overwrites the same shard instead of adding a second one, and a rerun after any crash
(the driver SIGKILLed included) skips the units whose shard exists. Sampling is seeded per row from
its id, as locally, so a row's output does not depend on which replica ran it.
"""

from __future__ import annotations

import functools
import json
import math
import pickle
import re
import time
from collections import Counter
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from batchgen import storage
from batchgen.engine.engine import LLMEngine
from batchgen.job.config import JobConfig
from batchgen.job.lifecycle import (
    JobIncomplete,
    StopSignals,
    interrupted,
    progress_bar,
    save_report,
    show_progress,
)
from batchgen.job.replicas import EngineReplica, apply_replicas
from batchgen.job.report import JobReport
from batchgen.job.rows import Request, RowIdentities, input_row_id
from batchgen.job.runner import JobRunner
from batchgen.job.sink import ShardSink
from batchgen.job.source import iter_range, iter_rows, schema_of
from batchgen.job.store import ShardDropped, open_store
from batchgen.job.workers import RAY_SHARD_PREFIX
from batchgen.storage import StorageOptions

READ_TASKS = 2  # read tasks at once: they run ahead of the replicas by Ray Data's backpressure
_UNIT_SCHEMA = pa.schema(
    [("_unit", pa.int64()), ("_unit_rows", pa.int64()), ("_position", pa.int64()), ("_row", pa.binary())]
)


def read_units(
    batch: pa.Table, files: list[str], fmt: str, batch_rows: int, openai_in: bool, options: StorageOptions
) -> pa.Table:
    """A read task: the rows of each unit in ``batch``, pickled (the row dicts exactly as the local
    reader makes them, whatever the input's types), tagged with the unit and its row count.
    ``options``: the job's storage options, for input in object storage."""
    storage.use(options)
    out: dict[str, list[Any]] = {"_unit": [], "_unit_rows": [], "_position": [], "_row": []}
    for unit in batch.to_pylist():
        duplicates = dict(zip(unit["duplicates"] or (), unit["duplicate_errors"] or (), strict=True))
        position = unit["start"]
        kept = []
        for rows in iter_range(files, fmt, unit["start"], unit["stop"], batch_rows):
            for row in rows:
                row["row_index"] = position
                if position in duplicates:  # an earlier row's id: an error row, known by its position
                    row["__error__"] = duplicates[position]
                    row["__identity__"] = f"#{position}"
                kept.append((position, row))
                position += 1
        if position != unit["stop"]:
            raise RuntimeError(
                f"input unit {unit['unit']} should hold rows {unit['start']}..{unit['stop'] - 1} but the input "
                f"has no row {position}; did the input change while the job ran?"
            )
        for pos, row in kept:
            out["_unit"].append(unit["unit"])
            out["_unit_rows"].append(len(kept))
            out["_position"].append(pos)
            out["_row"].append(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL))
    return pa.table(out, schema=_UNIT_SCHEMA)


class JobReplica(EngineReplica):
    """An engine actor of a Ray job: each call takes whole units, writes each one's shard, and
    returns one summary row per unit (never the generated rows: they go to disk, not to the driver)."""

    def __init__(self, cfg: JobConfig, openai_in: bool, id_key: str, input_schema: pa.Schema | None) -> None:
        super().__init__(cfg, openai_in, id_key)
        self.openai_in = openai_in
        self.key = "custom_id" if openai_in else cfg.input.id_column
        self.input_schema = input_schema
        out_fmt = "parquet" if cfg.output.format == "parquet" else "openai"
        storage.use(cfg.storage)
        store = open_store(cfg.output.path)
        self.sink = ShardSink(store, out_fmt, id_key, prefix=RAY_SHARD_PREFIX, clean=False, gate=store.commit_gate(),
                              output_fields=cfg.output_fields())

    def __call__(self, batch: pa.Table) -> pa.Table:
        units: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        expected: dict[int, int] = {}
        for unit, count, position, blob in zip(
            *(batch.column(name).to_pylist() for name in ("_unit", "_unit_rows", "_position", "_row")),
            strict=True,
        ):
            units.setdefault(unit, []).append((position, pickle.loads(blob)))
            expected[unit] = count
        summaries = []
        for unit, items in units.items():
            if len(items) != expected[unit]:  # a unit split over two calls would write two shards of one name
                raise RuntimeError(
                    f"unit {unit} reached a replica in pieces ({len(items)} of {expected[unit]} rows); "
                    "lower ray.batch_rows"
                )
            t0 = time.perf_counter()
            dedup_before = self.rows_deduplicated
            rows = [row for _, row in items]
            requests, out_rows = self.generate_rows(
                rows, [row.pop("__identity__", None) or input_row_id(row, self.key, pos) for pos, row in items]
            )
            try:
                self.sink.write(out_rows, self.input_schema, index=unit)
            except ShardDropped:  # the driver has stopped the job; the rerun does this unit
                continue
            errors = Counter(_error(out) for out in out_rows if out.get("error") is not None)
            failed = sum(errors.values())
            summaries.append(
                {
                    "unit": unit,
                    "shard": f"{RAY_SHARD_PREFIX}-{unit:06d}",
                    "rows": len(out_rows),
                    "rows_failed": failed,
                    "prompt_tokens": sum(len(r.token_ids or []) for r in requests if r.error is None),
                    "generated_tokens": sum(_generated(out) for out in out_rows),
                    "rows_deduplicated": self.rows_deduplicated - dedup_before,
                    "structured_cut_short": sum(_cut_short(r, out) for r, out in zip(requests, out_rows, strict=True)),
                    "errors": json.dumps(dict(errors)),
                    "replica": self.name,
                    "engine": json.dumps(self.engine.stats(), default=str),
                    "seconds": time.perf_counter() - t0,
                }
            )
        return pa.Table.from_pylist(summaries)


def _cut_short(request: Request, row: dict[str, Any]) -> bool:
    """A row with structured outputs whose completion reached max_tokens inside its grammar."""
    if request.params is None or request.params.structured_outputs is None:
        return False
    body = (row.get("response") or {}).get("body") or {}
    completions = row.get("completions") or body.get("choices") or []
    return any(c.get("finish_reason") == "length" for c in completions)


def _error(row: dict[str, Any]) -> str:
    error = row["error"]
    return str(error.get("message")) if isinstance(error, dict) else str(error)  # dict: the OpenAI format


def _task_error(error: BaseException) -> str:
    """The message of the exception a task raised. Ray carries it only as the text of the remote
    traceback inside its wrappers (RayTaskError, Ray Data's UserCodeException): its last
    ``SomeError: message`` line that is not a wrapper's."""
    found = None
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for line in str(current).splitlines():
            line = line.strip()
            if _RAISED.match(line) and not line.startswith(("ray.", "UserCodeException", "RayTaskError")):
                found = line
        inner = getattr(current, "cause", None) or current.__cause__
        current = inner if isinstance(inner, BaseException) else None
    return found or (str(error).strip().splitlines() or [type(error).__name__])[0]


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


def _generated(row: dict[str, Any]) -> int:
    for key in ("num_generated_tokens", "num_scored_tokens"):
        if key in row:
            return int(row[key] or 0)
    body = ((row.get("response") or {}).get("body") or {}).get("usage") or {}
    return int(body.get("completion_tokens") or 0)


def init_ray(address: str | None, replicas_cpus: float) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a local Ray with room for every replica;
    True if this call started it."""
    import os

    import ray

    if ray.is_initialized():
        return False
    local = address is None and not os.environ.get("RAY_ADDRESS")
    ray.init(
        address="local" if local else address,
        num_cpus=max(os.cpu_count() or 1, math.ceil(replicas_cpus)) if local else None,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def quiet_ray_data() -> None:
    """The job's own progress bar and report stand for Ray Data's progress bars and logs."""
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


class RayJobRunner(JobRunner):
    """A job on Ray Data; the output directory holds the same columns, manifest and report as a local
    run's, with shards named by unit of work (``part-ray-CCCCCC``)."""

    def __init__(self, cfg: JobConfig, overwrite: bool = False, engine: LLMEngine | None = None) -> None:
        super().__init__(cfg, overwrite)  # the replicas load their own engines: ``engine`` is unused
        self.shard_prefix = RAY_SHARD_PREFIX

    def run(self) -> JobReport:
        with self.store.hold(None), StopSignals() as signals:
            return self._run_ray(signals)

    def _units(self, total: int, sink: ShardSink) -> list[int]:
        have = re.compile(rf"^{RAY_SHARD_PREFIX}-(\d+)\.")
        done = {int(m.group(1)) for m in map(have.match, sink.shard_rows()) if m}
        return [u for u in range(math.ceil(total / self.cfg.ray.batch_rows)) if u not in done]

    def _duplicate_positions(self, total: int) -> dict[int, dict[int, str]]:
        """With an id column, a row whose id an earlier row has is an error row known by its
        position (as locally); the driver finds them in one pass over the ids. unit -> {position:
        error}."""
        key = "custom_id" if self.openai_in else self.cfg.input.id_column
        if key is None:
            return {}
        identities = RowIdentities(key)
        found: dict[int, dict[int, str]] = {}
        position = 0
        for batch in iter_rows(self.files, self.fmt, self.cfg.input.batch_rows):
            for row in batch:
                if position >= total:
                    break
                _, error = identities(row, position)
                if error is not None:
                    found.setdefault(position // self.cfg.ray.batch_rows, {})[position] = error
                position += 1
        return found

    def _run_ray(self, signals: StopSignals) -> JobReport:
        import ray

        sink = self._prepare_output()
        t_start = time.perf_counter()
        total = self._count_input_rows()
        if total is None:
            raise ValueError(
                f"cannot count the rows of {self.cfg.input.path!r}; the Ray executor needs the count "
                "to cut the input into units (the local executor does not)"
            )
        rows_before, _ = sink.totals()
        units = self._units(total, sink)
        if not units:
            return self._nothing_to_do(sink, total, rows_before)
        duplicates = self._duplicate_positions(total)
        size = self.cfg.ray.batch_rows
        plan = [
            {
                "unit": u,
                "start": u * size,
                "stop": min((u + 1) * size, total),
                "duplicates": list(duplicates.get(u, {})),
                "duplicate_errors": list(duplicates.get(u, {}).values()),
            }
            for u in units
        ]
        report = JobReport(rows_total=total, rows_previously_done=rows_before)
        bar = progress_bar(total, rows_before, "batchgen (ray)", self.cfg.run.progress)
        engines: dict[str, dict] = {}
        gate = self.store.commit_gate()
        gate.open()
        started = False
        failure: Exception | None = None
        try:
            # a signal while Ray starts stops the job at once; from then on it only ends the loop,
            # and Ray is always shut down here
            started = init_ray(self.cfg.ray.address, self.cfg.ray.num_replicas * self.cfg.ray.cpus_per_replica)
            signals.graceful = True
            self._write_manifest(sink)
            import ray.data

            quiet_ray_data()
            read = ray.data.from_items(plan, override_num_blocks=len(plan)).map_batches(
                functools.partial(
                    read_units,
                    files=self.files,
                    fmt=self.fmt,
                    batch_rows=self.cfg.input.batch_rows,
                    openai_in=self.openai_in,
                    options=self.cfg.storage,
                ),
                batch_size=None,
                batch_format="pyarrow",
                num_cpus=0,  # light I/O, never waits for a CPU the replicas hold ...
                concurrency=READ_TASKS,  # ... and few at once: each is a worker process to start
            )
            schema = None if self.openai_in else schema_of(self.files, self.fmt, self.cfg.input.id_column)
            kwargs = {
                "cfg": self.cfg,
                "openai_in": self.openai_in,
                "id_key": self.id_key,
                "input_schema": schema,
            }
            summaries = apply_replicas(read, JobReplica, self.cfg, kwargs, whole_blocks=True)
            t_run = time.perf_counter()
            for batch in summaries.iter_batches(batch_size=None, batch_format="pyarrow"):
                for s in batch.to_pylist():
                    self._account(report, s, sink)
                    engines[s["replica"]] = json.loads(s["engine"])
                    bar.update(s["rows"])
                self._show(bar, report, t_run)
                if signals.received is not None:
                    break
        except ray.exceptions.RayError as e:  # a task that failed for good (not a dead actor: retried)
            failure = e
        finally:
            bar.close()
            # The replicas write their units' shards themselves, and after a signal or a failure
            # some finished units the loop never accounted for. Once the gate is shut no replica
            # adds a shard (one still running drops its own), so the manifest lists what is on disk.
            gate.stop()
            if started:
                ray.shutdown()
            sink.rescan()
            self._write_manifest(sink)
        if failure is not None:
            rows, _ = sink.totals()
            raise JobIncomplete(
                f"the Ray job failed: {_task_error(failure)}; the {rows} rows written to "
                f"{self.out_dir} are kept, rerun the same command to resume"
            ) from failure
        if signals.received is not None:
            rows, _ = sink.totals()
            raise interrupted(signals.received, rows, self.out_dir)
        report.wall_s = time.perf_counter() - t_start
        report.fill_engine_stats(_combine(engines))
        report.rows_in_output, report.failed_in_output = sink.totals()
        report.duplicate_ids = sum(len(duplicates.get(u, {})) for u in units)
        save_report(self.store, self.report_name, report)
        return report

    def _account(self, report: JobReport, s: dict[str, Any], sink: ShardSink) -> None:
        report.rows_failed += s["rows_failed"]
        report.rows_ok += s["rows"] - s["rows_failed"]
        report.prompt_tokens += s["prompt_tokens"]
        report.generated_tokens += s["generated_tokens"]
        report.rows_deduplicated += s["rows_deduplicated"]
        report.structured_cut_short += s["structured_cut_short"]
        for message, count in json.loads(s["errors"]).items():
            report.errors[message] = report.errors.get(message, 0) + count
        suffix = "parquet" if self.cfg.output.format == "parquet" else "jsonl"
        sink.note(f"{s['shard']}.{suffix}", s["rows"], s["rows_failed"])
        self._write_manifest(sink)

    @staticmethod
    def _show(bar: tqdm, report: JobReport, t_run: float) -> None:
        elapsed = time.perf_counter() - t_run
        done = report.rows_ok + report.rows_failed
        rate = report.generated_tokens / elapsed if elapsed > 0 else 0.0
        eta = (bar.total - bar.n) * elapsed / done if bar.total and done else None
        show_progress(bar, report.generated_tokens, rate, eta)


def _combine(engines: dict[str, dict]) -> dict[str, Any]:
    """The replicas' engine figures as one: counts and pool sizes summed, ratios averaged."""
    out: dict[str, Any] = {"replicas": len(engines)}
    for stats in engines.values():
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                out.setdefault(key, value)
            else:
                out[key] = out.get(key, 0) + value
    for key, value in list(out.items()):
        if key != "replicas" and isinstance(value, float) and ("rate" in key or "saved" in key):
            out[key] = value / max(len(engines), 1)
    return out
