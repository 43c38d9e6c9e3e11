"""What a worker of a job is, in one place: its tag, the names of its files, and how the workers'
reports add up.

A job runs as one worker (no tag) or as ``N`` workers (``run.shard`` ``i/N``, ``run.replicas``),
each of whose files carries the tag ``-IIIII-of-NNNNN``: its shards ``part-IIIII-of-NNNNN-SSSSSS``,
manifest, report, and its lock or lease. A Ray job's units write ``part-ray-UUUUUU``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from batchgen.job.report import JobReport
from batchgen.job.store.base import BOOKKEEPING_DIR, OutputStore

RAY_SHARD_PREFIX = "part-ray"  # a Ray job's shards: one per unit of work, part-ray-UUUUUU
# a shard of any worker: part-SSSSSS, part-IIIII-of-NNNNN-SSSSSS, part-ray-UUUUUU
SHARD_NAME = re.compile(r"^part(-.+)?-\d+\.(parquet|jsonl)$")
# a worker's own file (``.`` first for a temp file): the group holds the worker count, when tagged
_TAGGED = re.compile(r"^\.?(?:part|manifest|report)(-\d{5}-of-(\d{5}))?[-.]")
_WORKER_REPORT = re.compile(r"^report-\d{5}-of-\d{5}\.json$")

# the report's counts that add up over workers
SUMMED = (
    "rows_previously_done", "rows_ok", "rows_failed", "duplicate_ids", "structured_cut_short", "rows_in_output",
    "failed_in_output", "prompt_tokens", "generated_tokens", "rows_deduplicated",
)


def shard_tag(shard: tuple[int, int] | None) -> str:
    """``-IIIII-of-NNNNN`` for worker ``i`` of ``n``; empty for a job that runs as one worker."""
    return "" if shard is None else f"-{shard[0]:05d}-of-{shard[1]:05d}"


def worker_count(name: str) -> int | None | bool:
    """The worker count that a shard, manifest or report file belongs to (None: a job of one worker);
    False for other files."""
    m = _TAGGED.match(name)
    if m is None:
        return False
    return int(m.group(2)) if m.group(1) else None


@dataclass(frozen=True)
class Worker:
    """The names of one worker's files in the output."""

    shard: tuple[int, int] | None = None

    @property
    def tag(self) -> str:
        return shard_tag(self.shard)

    @property
    def shard_prefix(self) -> str:
        return f"part{self.tag}"

    @property
    def manifest_name(self) -> str:
        # bookkeeping lives in a hidden directory, which dataset readers (pyarrow, pandas,
        # datasets.load_dataset with data_dir) skip: the output directory reads as one dataset
        return f"{BOOKKEEPING_DIR}/manifest{self.tag}.json"

    @property
    def report_name(self) -> str:
        return f"{BOOKKEEPING_DIR}/report{self.tag}.json"

    @property
    def legacy_manifest(self) -> str:
        return f"_manifest{self.tag}.json"  # where versions before 0.2 kept it


def read_report(store: OutputStore, name: str) -> dict[str, Any] | None:
    """A saved report, or None where there is none or it cannot be read."""
    try:
        value = json.loads(store.read(name) or b"")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def worker_reports(store: OutputStore) -> list[dict[str, Any]]:
    """The saved reports of a job's workers; an unsharded job's one report where there are none."""
    names = store.files(BOOKKEEPING_DIR)
    tagged = sorted(n for n in names if _WORKER_REPORT.match(n)) or [n for n in names if n == "report.json"]
    return [r for r in (read_report(store, f"{BOOKKEEPING_DIR}/{n}") for n in tagged) if r is not None]


def merge_reports(parts: Iterable[dict[str, Any]], rows_total: int | None) -> JobReport:
    """The workers' reports as one: counts and errors summed, the wall time the longest."""
    report = JobReport(rows_total=rows_total)
    for part in parts:
        r = JobReport.from_dict(part)
        for key in SUMMED:
            setattr(report, key, getattr(report, key) + (getattr(r, key) or 0))
        for message, n in r.errors.items():
            report.errors[message] = report.errors.get(message, 0) + n
        report.wall_s = max(report.wall_s, r.wall_s or 0.0)
    return report


def nothing_to_do(store: OutputStore, report_name: str, total: int, done: int, totals: tuple[int, int]) -> JobReport:
    """The report of a rerun that found every row done: the saved report of the run that finished
    them (``report_name``), with the output's counts (``totals``: rows, failed rows) and the rows
    found done."""
    saved = read_report(store, report_name)
    try:
        report = JobReport.from_dict(saved) if saved is not None else JobReport(rows_total=total)
    except TypeError:
        report = JobReport(rows_total=total)
    report.rows_in_output, report.failed_in_output = totals
    report.nothing_to_do = done
    return report
