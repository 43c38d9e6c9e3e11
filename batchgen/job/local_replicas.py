"""``run.replicas``: several engines in one local job, each a worker of a sharded job on its own CPUs.

Replica ``i`` of ``N`` is ``python -m batchgen job CONFIG --set run.shard=i/N``, the very worker a
Kubernetes Indexed Job runs, started by this process with its affinity mask cut to its share of the
CPUs (one NUMA node each with ``replicas: auto``) and as many threads. Its weights and KV cache are
first touched by threads on its own CPUs, so Linux's default (local) memory policy places them on
its node. Each worker keeps its own shards, manifest and locks, resumes them on a rerun and dies
with this process (``PR_SET_PDEATHSIG``); this process shows one progress bar from the workers'
progress lines, forwards SIGTERM / SIGINT to them and prints one report, their reports summed.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.cpus import affinity_cpus, cgroup_quota, numa_nodes
from batchgen.job.config import ConfigError, JobConfig
from batchgen.job.lifecycle import (
    PROGRESS_ENV,
    PROGRESS_PREFIX,
    JobIncomplete,
    JobInterrupted,
    JobRefused,
    StopSignals,
    interrupted,
    progress_bar,
    save_report,
)
from batchgen.job.report import JobReport
from batchgen.job.runner import check_layout, job_rows, output_id_key
from batchgen.job.sink import ShardSink
from batchgen.job.store import BOOKKEEPING_DIR, open_store
from batchgen.job.workers import Worker, merge_reports, nothing_to_do, read_report

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Replica:
    """One engine's share of the machine: the CPUs it is pinned to and the NUMA node holding them
    (None where they span several or the machine shows no nodes)."""

    cpus: tuple[int, ...]
    node: int | None


def plan_replicas(
    spec: int | str, allowed: list[int], quota_cpus: float | None, nodes: dict[int, list[int]]
) -> list[Replica]:
    """Split the CPUs the job may use (the affinity mask, no more than the quota rounded up) into
    ``spec`` shares: ``auto`` is one per NUMA node with CPUs in the mask, a number that many
    shares of consecutive CPUs, taken node by node."""
    budget = len(allowed) if quota_cpus is None else max(1, min(len(allowed), math.ceil(quota_cpus)))
    node_of = {cpu: n for n, cpus in nodes.items() for cpu in cpus}
    mask = set(allowed)
    if spec == "auto":
        local = [(n, [c for c in cpus if c in mask]) for n, cpus in nodes.items()]
        local = [(n, cpus) for n, cpus in local if cpus]
        if len(local) <= 1:
            return [Replica(tuple(sorted(allowed)[:budget]), local[0][0] if local else None)]
        each = max(1, budget // len(local))
        return [Replica(tuple(cpus[:each]), n) for n, cpus in local]
    count = int(spec)
    if count > budget:
        raise ConfigError(
            f"run.replicas: {count} replicas need a CPU each, but this job may use {budget} "
            f"(affinity mask {len(allowed)} CPUs" + ("" if quota_cpus is None else f", cgroup quota {quota_cpus:.1f}") + ")"
        )
    ordered = sorted(allowed, key=lambda c: (node_of.get(c, -1), c))[:budget]
    plans, start = [], 0
    for i in range(count):
        size = budget // count + (1 if i < budget % count else 0)
        cpus = tuple(ordered[start : start + size])
        start += size
        on = {node_of.get(c) for c in cpus}
        plans.append(Replica(cpus, on.pop() if len(on) == 1 else None))
    return plans


def machine_plan(spec: int | str) -> list[Replica]:
    """``plan_replicas`` on this process's affinity mask, cgroup quota and NUMA nodes."""
    quota = cgroup_quota()
    return plan_replicas(spec, affinity_cpus(), None if quota is None else quota.cpus, numa_nodes())


def _pin_and_tie(cpus: tuple[int, ...]):
    """Run in the replica between fork and exec: its CPUs, and SIGKILL when this process dies."""

    def preexec() -> None:
        os.sched_setaffinity(0, cpus)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return preexec


class ReplicaJobRunner:
    """A local job on ``len(plan)`` engines (``run.replicas``). ``config`` and ``sets`` are what
    the command was given: each replica is that command with its shard."""

    def __init__(self, cfg: JobConfig, config: str, sets: list[str], plan: list[Replica], overwrite: bool = False):
        self.cfg, self.config, self.sets, self.plan, self.overwrite = cfg, config, sets, plan, overwrite
        self.count = len(plan)
        self.store = open_store(cfg.output.path)
        self.out_dir = self.store.display
        self.workers = [Worker((i, self.count)) for i in range(self.count)]
        self.sinks: list[ShardSink] = []  # each replica's shards, read (never written) by this process

    def _command(self, index: int) -> list[str]:
        sets = [arg for s in self.sets for arg in ("--set", s)]
        cmd = [sys.executable, "-m", "batchgen", "job", self.config, *sets,
               "--set", f"run.shard={index}/{self.count}", "--set", "run.replicas=1"]
        return cmd + (["--overwrite"] if self.overwrite else [])

    def run(self) -> JobReport:
        with self.store.hold_for_workers(), StopSignals() as signals:
            check_layout(self.store, self.count, self.overwrite)
            fmt = "parquet" if self.cfg.output.format == "parquet" else "openai"
            key = output_id_key(self.cfg)
            self.sinks = [ShardSink(self.store, fmt, key, prefix=w.shard_prefix, clean=False,
                                   output_fields=self.cfg.output_fields()) for w in self.workers]
            done = self._done_report()
            return done if done is not None else self._run(signals)

    def _run(self, signals: StopSignals) -> JobReport:
        t0 = time.perf_counter()
        total = job_rows(self.cfg)
        package_root = str(Path(__file__).resolve().parents[2])
        rows = [0] * self.count
        tokens = [0] * self.count
        errors: list[list[str]] = [[] for _ in range(self.count)]
        procs: list[subprocess.Popen] = []
        signals.graceful = True
        bar = progress_bar(total, 0, f"batchgen x{self.count}", self.cfg.run.progress)

        def follow(i: int, proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    rows[i], tokens[i] = (int(x) for x in line[len(PROGRESS_PREFIX):].split())

        def collect(i: int, proc: subprocess.Popen) -> None:
            assert proc.stderr is not None
            errors[i] = [line.rstrip("\n") for line in proc.stderr if line.strip()]

        threads = []
        for i, replica in enumerate(self.plan):
            env = {**os.environ, PROGRESS_ENV: "1", "OMP_NUM_THREADS": str(len(replica.cpus))}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
            proc = subprocess.Popen(
                self._command(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=_pin_and_tie(replica.cpus),
            )
            procs.append(proc)
            threads += [threading.Thread(target=f, args=(i, proc), daemon=True) for f in (follow, collect)]
        for t in threads:
            t.start()
        forwarded: int | None = None
        try:
            while any(p.poll() is None for p in procs):
                if signals.received is not None and forwarded != signals.received:
                    forwarded = signals.received
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(forwarded)
                bar.n = sum(rows)
                bar.set_postfix_str(f"{sum(tokens)} tokens", refresh=True)
                time.sleep(0.2)
        finally:
            for p in procs:  # this process ending by an exception: its replicas end with it
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for t in threads:
                t.join()
            bar.n = sum(rows)
            bar.close()
        return self._finish([p.returncode for p in procs], errors, signals, time.perf_counter() - t0)

    def _finish(self, codes: list[int], errors: list[list[str]], signals: StopSignals, wall: float) -> JobReport:
        saved = sum(sink.totals()[0] for sink in self.sinks)
        if signals.received is not None:
            raise interrupted(signals.received, saved, self.out_dir)
        failed = [(i, c) for i, c in enumerate(codes) if c != 0]
        if failed:
            i, code = failed[0]
            line = next((x for x in reversed(errors[i]) if x.startswith("error:")), errors[i][-1] if errors[i] else "")
            line = line.removeprefix("error: ").removeprefix("batchgen: ")
            if code < 0:
                line = f"killed by {signal.Signals(-code).name}"
            message = f"replica {i} of {self.count} exited {code}: {line}"
            if code == 2:
                raise JobRefused(message)
            if code > 128:
                raise JobInterrupted(code - 128, f"{message}; {saved} rows saved in {self.out_dir}; "
                                                 "rerun the same command to resume")
            raise JobIncomplete(f"{message}; {saved} rows saved in {self.out_dir}; rerun the same command to resume")
        return self._report(wall)

    def _done_report(self) -> JobReport | None:
        """With every row already in the replicas' shards, the saved report of the run that wrote
        them, marked as nothing to do (no replica starts, no model loads); else None."""
        total = job_rows(self.cfg)
        if total is None:
            return None
        done = sum(len(sink.done_ids()) for sink in self.sinks)
        if done < total:
            return None
        totals = [sink.totals() for sink in self.sinks]
        rows_and_failed = (sum(t[0] for t in totals), sum(t[1] for t in totals))
        return nothing_to_do(self.store, f"{BOOKKEEPING_DIR}/report.json", total, done, rows_and_failed)

    def _report(self, wall: float) -> JobReport:
        """The replicas' reports as one: counts summed, engine figures summed (text joined), this
        process's wall time; saved as ``.batchgen/report.json``."""
        parts = [read_report(self.store, w.report_name) or {} for w in self.workers]
        report = merge_reports(parts, job_rows(self.cfg))
        if all(p.get("nothing_to_do") for p in parts):
            report.nothing_to_do = sum(p["nothing_to_do"] for p in parts)
        report.prompt_tokens_perfect_order = None
        report.wall_s = wall
        report.engine = _merge_stats([p.get("engine", {}) for p in parts])
        report.engine["replicas"] = [
            {"cpus": list(r.cpus), "node": r.node, "generated_tokens": p.get("generated_tokens", 0)}
            for r, p in zip(self.plan, parts, strict=True)
        ]
        save_report(self.store, f"{BOOKKEEPING_DIR}/report.json", report)
        return report


def _merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for s in stats:
        for key, value in s.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                seen = merged.setdefault(key, value)
                if seen != value and str(value) not in str(seen).split(" | "):
                    merged[key] = f"{seen} | {value}"
            else:
                merged[key] = merged.get(key, 0) + value
    return merged
