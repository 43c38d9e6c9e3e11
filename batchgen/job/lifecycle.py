"""What every executor of a job shares: how it stops (``StopSignals``, and the exceptions a job
ends with), what it shows while it runs (``progress_bar``, ``show_progress``), and what it leaves
when it ends (``interrupted``'s one line, ``save_report``). The local runner
(``batchgen/job/runner.py``) and the Ray executor (``batchgen/job/ray_executor.py``) both use it,
so a job reads and ends the same whichever runs it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from batchgen.job.report import JobReport
from batchgen.job.store import OutputStore

PROGRESS_ENV = "BATCHGEN_PROGRESS_LINES"  # set for a replica of a local job: progress as lines, no bar
PROGRESS_PREFIX = "batchgen-progress "
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]"


class JobRefused(RuntimeError):
    """The output directory holds a run with a different config; the message says what changed."""


class JobIncomplete(RuntimeError):
    """The job ended without every input row in the output (the input shrank while it ran)."""


class JobInterrupted(Exception):
    """SIGTERM or SIGINT stopped the job; the finished rows were saved."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGTERM (how Kubernetes stops a pod) and SIGINT (Ctrl-C) stop a job cleanly.

    While the model loads, a signal raises ``JobInterrupted`` at once. Once rows flow
    (``graceful = True``) it only sets ``received``: the runner stops admitting rows, writes every
    finished one and the manifest, and raises ``JobInterrupted``. A second signal exits at once.
    Only the main thread can take signals; elsewhere this does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.graceful = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum
        if not self.graceful:
            raise JobInterrupted(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def progress_bar(total: int | None, initial: int, desc: str, enabled: bool) -> Any:
    """The job's bar: rows done of the rows to do, the rows earlier runs finished included. A
    replica of a local job (``run.replicas``) reports to the job that started it instead."""
    if os.environ.get(PROGRESS_ENV):
        return ProgressLines(total, initial)
    return tqdm(
        total=total,
        initial=initial,
        unit="row",
        desc=desc,
        disable=not enabled,
        dynamic_ncols=True,
        bar_format=BAR_FORMAT,
    )


def show_progress(bar: Any, tokens: int, rate: float, eta_s: float | None, in_flight: int | None = None) -> None:
    """The bar's tail: rows in flight (where the executor knows them), tokens generated, the rate, the ETA."""
    bar.tokens = tokens
    parts = [] if in_flight is None else [f"{in_flight} in flight"]
    parts.append(f"{tokens} tokens, {rate:.0f} tok/s" + ("" if eta_s is None else f", ETA {clock(eta_s)}"))
    bar.set_postfix_str(", ".join(parts), refresh=True)


class ProgressLines:
    """A replica's stand-in for the progress bar: ``batchgen-progress ROWS TOKENS`` lines on stdout
    (at most twice a second, and at the end) for the job that started it."""

    def __init__(self, total: int | None, initial: int) -> None:
        self.total, self.n, self.tokens = total, initial, 0
        self._shown = 0.0
        self._emit(force=True)

    def update(self, rows: int = 1) -> None:
        self.n += rows
        self._emit()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self._emit()

    def close(self) -> None:
        self._emit(force=True)

    def _emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._shown >= 0.5:
            self._shown = now
            print(f"{PROGRESS_PREFIX}{self.n} {self.tokens}", flush=True)


def clock(seconds: float) -> str:
    """``MM:SS``, or ``H:MM:SS`` from an hour on."""
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def interrupted(signum: int, rows_saved: int, out_dir: Path | str, dropped: int | None = None) -> JobInterrupted:
    """The exception (and its one line) a job stopped by a signal ends with."""
    detail = "" if dropped is None else f" ({dropped} unfinished dropped)"
    return JobInterrupted(
        signum,
        f"interrupted by {signal.Signals(signum).name}: {rows_saved} rows saved in {out_dir}{detail}; "
        "rerun the same command to resume",
    )


def save_report(store: OutputStore, name: str, report: JobReport) -> None:
    """Write the report as ``name`` in the output store (whole or not at all)."""
    store.write(name, json.dumps(report.to_dict(), indent=2).encode())
