"""A worker's tag and file names, and the workers' reports merged, as the sharded worker, the
replicas, Ray and ``verify`` all read them (``batchgen/job/workers.py``)."""

from __future__ import annotations

import json

from batchgen.job.store import LocalStore
from batchgen.job.workers import (
    SHARD_NAME,
    Worker,
    merge_reports,
    nothing_to_do,
    worker_count,
    worker_reports,
)


def test_a_workers_files_carry_its_tag_and_name_its_count():
    w = Worker((3, 16))
    assert (w.tag, w.shard_prefix) == ("-00003-of-00016", "part-00003-of-00016")
    assert (w.manifest_name, w.report_name) == (".batchgen/manifest-00003-of-00016.json", ".batchgen/report-00003-of-00016.json")
    assert Worker().shard_prefix == "part" and Worker().report_name == ".batchgen/report.json"
    assert worker_count("part-00003-of-00016-000002.parquet") == 16
    assert worker_count(".manifest-00001-of-00004.json.123.tmp") == 4
    assert worker_count("manifest.json") is None and worker_count("notes.txt") is False
    assert all(SHARD_NAME.match(n) for n in ("part-000001.parquet", "part-00003-of-00016-000002.jsonl", "part-ray-000007.parquet"))
    assert not SHARD_NAME.match("manifest.json")


def test_reports_merge_counts_errors_and_the_longest_wall_time(tmp_path):
    store = LocalStore(str(tmp_path))
    parts = [
        {"rows_ok": 5, "rows_failed": 1, "generated_tokens": 40, "wall_s": 2.0, "errors": {"prompt is empty": 1}},
        {"rows_ok": 7, "rows_failed": 2, "generated_tokens": 60, "wall_s": 3.5, "errors": {"prompt is empty": 1, "x": 1},
         "rows_in_output": 9},
    ]
    for i, part in enumerate(parts):
        store.write(Worker((i, 2)).report_name, json.dumps(part).encode())
    store.write(".batchgen/report.json", json.dumps({"rows_ok": 1000}).encode())  # the combined one: not a worker's
    read = worker_reports(store)
    assert read == parts
    merged = merge_reports(read, rows_total=15)
    assert (merged.rows_ok, merged.rows_failed, merged.generated_tokens, merged.rows_in_output) == (12, 3, 100, 9)
    assert merged.errors == {"prompt is empty": 2, "x": 1} and merged.wall_s == 3.5 and merged.rows_total == 15
    again = nothing_to_do(store, Worker((1, 2)).report_name, 15, 15, (15, 3))
    assert (again.rows_ok, again.nothing_to_do, again.rows_in_output, again.failed_in_output) == (7, 15, 15, 3)
    fresh = nothing_to_do(store, ".batchgen/report-00009-of-00010.json", 15, 15, (15, 0))
    assert fresh.rows_ok == 0 and fresh.rows_total == 15 and fresh.nothing_to_do == 15
