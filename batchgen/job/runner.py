"""Run a job: read rows, build requests, drive the engine, write shards, report.

Three threads, joined by bounded queues so memory stays bounded whatever the dataset's size::

    reader thread:  source batches -> skip rows already in shards -> tokenize / chat template /
                    per-row params -> request queue (or a ready error row)
    main thread:    reads up to ``lookahead_rows`` requests into a window, keeps up to
                    ``max_rows_in_flight`` in the engine (admitted from the window by shared
                    prefix; identical deterministic rows computed once), steps it, turns each
                    finished request into an output row -> writer queue
    writer thread:  buffers rows, writes an atomic shard every ``rows_per_shard`` rows (or
                    ``flush_seconds``), and at the end
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from batchgen import storage
from batchgen.engine.admission import PrefixWindow, PromptBlockCounter, duplicate_key
from batchgen.engine.engine import LLMEngine
from batchgen.job.config import JobConfig, parse_shard
from batchgen.job.lifecycle import (
    JobIncomplete,
    JobRefused,
    StopSignals,
    interrupted,
    progress_bar,
    save_report,
    show_progress,
)
from batchgen.job.report import JobReport
from batchgen.job.rows import Request, RowCodec, RowIdentities, row_bytes
from batchgen.job.sink import ShardSink
from batchgen.job.source import (
    check_unchanged,
    count_rows,
    detect_format,
    input_files,
    input_state,
    iter_rows,
    schema_of,
)
from batchgen.job.store import BOOKKEEPING_DIR, OutputStore, open_store
from batchgen.job.workers import Worker, nothing_to_do, worker_count
from batchgen.outputs import RequestOutput

_END = object()
RATE_WINDOW_S = 30.0  # the progress bar's tokens/s is measured over this many recent seconds
QUEUE_FLOOR = 64  # rows: the least room of the reader's and the writer's queues
class _OutputQueue(queue.Queue):
    """Output rows for the writer, bounded by their count and by the bytes of their per-token
    log-probabilities (``row_bytes``): a put waits while the rows queued hold ``max_bytes``."""

    def __init__(self, maxsize: int, max_bytes: int) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.bytes = 0

    def _put(self, item: Any) -> None:
        self.bytes += row_bytes(item)
        super()._put(item)

    def _get(self) -> Any:
        item = super()._get()
        self.bytes -= row_bytes(item)
        return item

    def _qsize(self) -> int:
        n = len(self.queue)
        return max(n, self.maxsize) if n and self.bytes >= self.max_bytes else n


def _changed(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def check_layout(store: OutputStore, workers: int | None, overwrite: bool) -> None:
    """Refuse an output holding shards of another worker count (None: an unsharded job), or with
    ``overwrite`` remove them: a shard names its worker, so workers of another count would compute
    the same rows again under other names."""
    manifests = [n for n in store.files(BOOKKEEPING_DIR) if n.startswith("manifest") and n.endswith(".json")]
    others = {worker_count(n) for n in manifests} - {workers, False}
    if not others:
        return
    held = ", ".join(sorted("one engine" if n is None else f"{n} workers" for n in others))
    if not overwrite:
        mine = "one engine" if workers is None else f"{workers} workers (run.shard or run.replicas)"
        raise JobRefused(
            f"output directory {store.display!r} holds a run of {held}; a run of {mine} would write its "
            "rows again. Rerun with the same workers, --overwrite to discard it, or another output.path"
        )
    for folder in ("", BOOKKEEPING_DIR):
        for name in store.files(folder):
            if worker_count(name) in others:
                store.delete(f"{folder}/{name}".lstrip("/"))


def job_rows(cfg: JobConfig) -> int | None:
    """Rows the whole job produces: the input's, after ``limit`` (None where it cannot be counted)."""
    files = input_files(cfg.input.path)
    total = count_rows(files, detect_format(cfg.input, files))
    if total is not None and cfg.input.limit is not None:
        total = min(total, cfg.input.limit)
    return total


def output_id_key(cfg: JobConfig) -> str:
    """The column that keys an output row: ``custom_id`` for OpenAI batch input, else the id
    column, else ``row_index``."""
    files = input_files(cfg.input.path)
    return "custom_id" if detect_format(cfg.input, files) == "openai" else (cfg.input.id_column or "row_index")


class JobRunner:
    """One job on this machine. ``engine``: an engine already loaded with the job's model and
    engine settings, to run several jobs in one process (the row-path tests); by default the job
    loads its own."""

    def __init__(self, cfg: JobConfig, overwrite: bool = False, engine: LLMEngine | None = None) -> None:
        self.cfg = cfg
        self.overwrite = overwrite
        self._engine = engine
        storage.use(cfg.storage)  # this process's object-store options: the job's
        self.files = input_files(cfg.input.path)
        self.fmt = detect_format(cfg.input, self.files)
        self.openai_in = self.fmt == "openai"
        self.id_key = "custom_id" if self.openai_in else (cfg.input.id_column or "row_index")
        self.store = open_store(cfg.output.path)
        self.out_dir = self.store.display
        self.shard = parse_shard(cfg.run.shard)
        # a sharded job's workers share the directory: every file of theirs carries the index
        worker = Worker(self.shard)
        self.manifest_name = worker.manifest_name
        self.report_name = worker.report_name
        self.legacy_manifest = worker.legacy_manifest
        self.shard_prefix = worker.shard_prefix
        self.codec = RowCodec(cfg, self.openai_in)

    # -- resume / refuse -----------------------------------------------------------------------
    def _prepare_output(self) -> ShardSink:
        """Refuse a directory holding another config's run (or clear it with ``--overwrite``),
        remove what an earlier crash left half-written, and open the shard sink."""
        check_layout(self.store, None if self.shard is None else self.shard[1], self.overwrite)
        fingerprint = self.cfg.fingerprint()
        previous = next((d for d in map(self.store.read, (self.manifest_name, self.legacy_manifest)) if d is not None), None)
        if previous is not None:
            try:
                old = json.loads(previous).get("fingerprint", {})
            except (ValueError, AttributeError):
                old = {}  # an unreadable manifest: the shards are the record, rewrite it
            if old and old != fingerprint:
                changes = _changed(old, fingerprint)
                if not self.overwrite:
                    raise JobRefused(
                        f"output directory {str(self.out_dir)!r} holds a run with a different config; changed: "
                        + "; ".join(changes)
                        + ". Use --overwrite to discard it, or another output.path."
                    )
                self._discard_output()
        for name in (self.manifest_name, self.report_name):
            self.store.clean_temp(name.split("/")[-1] + ".", BOOKKEEPING_DIR)
        out_fmt = "parquet" if self.cfg.output.format == "parquet" else "openai"
        sink = ShardSink(self.store, out_fmt, self.id_key, prefix=self.shard_prefix,
                         output_fields=self.cfg.output_fields())
        self.manifest = {"fingerprint": fingerprint, "config": self.cfg.source_file, "shards": sink.shard_rows()}
        return sink

    def _discard_output(self) -> None:
        """``--overwrite``: remove this job's (or this worker's) shards and bookkeeping; the lock
        files stay, and so do other workers' files of a sharded job."""
        mine = (self.shard_prefix + "-", *(n.split("/")[-1] for n in (self.manifest_name, self.report_name, self.legacy_manifest)))
        for folder in ("", BOOKKEEPING_DIR):
            for name in self.store.files(folder):
                if name.lstrip(".").startswith(("lock", "lease")):
                    continue
                if self.shard is None or name.lstrip(".").startswith(mine):
                    self.store.delete(f"{folder}/{name}".lstrip("/"))
        if self.shard is None:
            self.store.remove_folders()  # folders a user put there

    def _write_manifest(self, sink: ShardSink | None = None) -> None:
        """Record the config's fingerprint and every shard on disk with its row count. The shards
        themselves stay the source of truth: a crash (or a full disk) between a shard's rename and
        this write loses nothing, the next run lists that shard here too."""
        if sink is not None:
            self.manifest["shards"] = sink.shard_rows()
        self.store.write(self.manifest_name, json.dumps(self.manifest, indent=2, default=str).encode())

    # -- request building (reader thread) ------------------------------------------------------
    def _reader(
        self,
        q: queue.Queue,
        compile_grammar: Callable[[Any], None],
        done: set[str],
        counts: dict[str, int],
        stop: threading.Event,
        state: dict[str, tuple[int, int]],
        tokenizer_dir: str,
    ) -> None:
        """``tokenizer_dir``: the engine's (a hub id resolved); the reader loads its own copy, so
        that it never shares the Rust tokenizer with the main thread."""
        from batchgen.model.loader import load_tokenizer

        sh_i, sh_n = self.shard or (0, 1)
        identities = RowIdentities("custom_id" if self.openai_in else self.cfg.input.id_column)
        position = 0
        limit = self.cfg.input.limit
        try:
            tokenizer = load_tokenizer(tokenizer_dir)
            for batch in iter_rows(self.files, self.fmt, self.cfg.input.batch_rows):
                if stop.is_set():
                    return
                check_unchanged(state)  # rows read from a file being rewritten never reach the output
                for row in batch:
                    pos = position
                    position += 1
                    if limit is not None and pos >= limit:
                        raise StopIteration
                    # a row without an id (a malformed line), or with an earlier row's id: its
                    # position; taken over every row, so that the workers of a sharded job agree
                    rid, duplicate = identities(row, pos)
                    if pos % sh_n != sh_i:
                        continue
                    counts["rows_read"] += 1
                    row["row_index"] = pos  # every output row names its input position
                    if rid in done:
                        counts["skipped_done"] += 1
                        continue
                    counts["duplicate_ids"] += duplicate is not None
                    if duplicate is not None:
                        request = Request(row=row, rid=rid, error=duplicate)
                    else:
                        request = self.codec.build(tokenizer, row, rid, compile_grammar)
                    self._offer(q, request, stop)
                    if stop.is_set():
                        return
            check_unchanged(state)
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - the main thread reports it
            self._offer(q, e, stop)
        self._offer(q, _END, stop)

    @staticmethod
    def _offer(q: queue.Queue, item: Any, stop: threading.Event) -> None:
        """Put ``item`` unless the job stops first: a stopped job no longer reads the queue."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    # -- output rows ---------------------------------------------------------------------------
    def _writer(self, sink: ShardSink, q: queue.Queue, schema, errors: list[BaseException]) -> None:
        buf: list[dict[str, Any]] = []
        held = 0  # bytes of per-token arrays in buf
        last = time.monotonic()
        per_shard, flush_s = self.cfg.output.rows_per_shard, self.cfg.output.flush_seconds
        max_bytes = int(self.cfg.output.max_shard_mb * 2**20)
        try:
            while True:
                try:
                    item = q.get(timeout=1.0)
                except queue.Empty:
                    item = None
                if item is _END:
                    break
                if item is not None:
                    buf.append(item)
                    held += row_bytes(item)
                if buf and (len(buf) >= per_shard or held >= max_bytes or time.monotonic() - last >= flush_s):
                    sink.write(buf, schema)
                    self._write_manifest(sink)
                    buf, held, last = [], 0, time.monotonic()
            if buf:
                sink.write(buf, schema)
                self._write_manifest(sink)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    # -- the job -------------------------------------------------------------------------------
    def run(self) -> JobReport:
        """Run the job to the end. Raises ``OutputLocked`` if another job writes the directory,
        ``JobRefused`` for another config's output, ``JobInterrupted`` on SIGTERM / SIGINT (after
        saving the finished rows), ``OutputWriteError`` when the output cannot be written,
        ``InputChanged`` / ``JobIncomplete`` when the input changed under it."""
        with self.store.hold(self.shard), StopSignals() as signals:
            return self._run(signals)

    def _run(self, signals: StopSignals) -> JobReport:
        sink = self._prepare_output()
        done = sink.done_ids()
        t_start = time.perf_counter()
        state = input_state(self.files)
        total = self._count_input_rows()
        if total is not None and len(done) >= total:
            return self._nothing_to_do(sink, total, len(done))
        engine = self._engine or LLMEngine(self.cfg.engine_config())
        for lora in self.cfg.lora.requests().values():  # every adapter read and checked before any row
            engine.add_lora(lora)
        # From here on a signal only stops the loop, and the reader and writer threads are always
        # stopped and joined before the job returns: a daemon thread still inside pyarrow or the
        # tokenizer when the interpreter exits can abort the process (SIGABRT, not 128 + signal).
        signals.graceful = True
        self._write_manifest()  # only once the model loaded: a failed start leaves no manifest
        cap = self.cfg.run.max_rows_in_flight or 4 * engine.cfg.max_num_seqs
        counts = {"skipped_done": 0, "duplicate_ids": 0, "rows_read": 0}
        # Bounded queues keep memory flat: the reader runs at most two engine-fulls of rows ahead,
        # the writer at most a few shards behind; the floor keeps tiny configs from stalling.
        req_q: queue.Queue = queue.Queue(maxsize=max(2 * cap, QUEUE_FLOOR))
        out_q: queue.Queue = _OutputQueue(4 * self.cfg.output.rows_per_shard + QUEUE_FLOOR,
                                          int(self.cfg.output.max_shard_mb * 2**20))
        stop = threading.Event()
        writer_errors: list[BaseException] = []
        schema = None if self.openai_in else schema_of(self.files, self.fmt, self.cfg.input.id_column)
        reader = threading.Thread(
            target=self._reader,
            args=(req_q, engine.compile_grammar, done, counts, stop, state, engine.cfg.tokenizer or engine.cfg.model),
            name="batchgen-reader",
            daemon=True,
        )
        writer = threading.Thread(
            target=self._writer, args=(sink, out_q, schema, writer_errors), name="batchgen-writer", daemon=True
        )

        report = JobReport(rows_total=total, rows_previously_done=len(done))
        bar = progress_bar(total, len(done), "batchgen", self.cfg.run.progress)
        lookahead = self.cfg.run.lookahead_rows or 4 * cap
        loop = _MainLoop(self, engine, req_q, out_q, writer_errors, report, bar, cap, lookahead)
        try:
            reader.start()
            writer.start()
            loop.run(signals)
        finally:
            stop.set()
            bar.close()
            if writer.is_alive():
                self._put(out_q, _END, writer_errors, force=True)
                writer.join()
            if reader.is_alive():
                reader.join()
        if writer_errors:
            raise writer_errors[0]
        if signals.received is not None:
            rows, _ = sink.totals()
            raise interrupted(signals.received, rows, self.out_dir, dropped=loop.unfinished)
        report.wall_s = time.perf_counter() - t_start
        report.duplicate_ids = counts["duplicate_ids"]
        report.prompt_tokens_perfect_order = loop.perfect.tokens
        report.fill_engine_stats(engine.stats())
        report.rows_in_output, report.failed_in_output = sink.totals()
        save_report(self.store, self.report_name, report)
        if total is not None and counts["rows_read"] != total:
            raise JobIncomplete(
                f"the input had {total} rows when the job started but {counts['rows_read']} were read; "
                f"{report.rows_in_output} rows are in {self.out_dir}. Rerun once the input is stable"
            )
        return report

    def _nothing_to_do(self, sink: ShardSink, total: int, done: int) -> JobReport:
        """Every row is already in the output: no model is loaded, the manifest is made true, and
        the saved report (of the run that finished the rows) is kept and returned."""
        self._write_manifest(sink)
        return nothing_to_do(self.store, self.report_name, total, done, sink.totals())

    def _count_input_rows(self) -> int | None:
        """Rows this job (or worker) should produce: the input's, after ``limit`` and ``shard``."""
        total = job_rows(self.cfg)
        if total is not None and self.shard is not None:
            i, n = self.shard
            total = len(range(i, total, n))
        return total

    @staticmethod
    def _put(q: queue.Queue, item: Any, errors: list[BaseException], force: bool = False) -> None:
        while True:
            if errors and not force:
                raise errors[0]
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue


class _FifoWindow:
    """Admission in input order (``engine.admission_order: input``)."""

    def __init__(self, capacity: int) -> None:
        self.items: deque[Request] = deque()
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.items)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.capacity

    def add(self, item: Request, token_ids: list[int]) -> None:
        self.items.append(item)

    def pop(self) -> Request:
        return self.items.popleft()


class _MainLoop:
    """The main thread's loop: read rows into a lookahead window, keep up to ``cap`` requests in
    the engine (admitted from the window by shared prefix, ``batchgen/engine/admission.py``; a
    row identical to one in flight waits for that one's output instead), step the engine, hand
    finished and failed rows to the writer, until the input is exhausted or a signal arrives."""

    def __init__(
        self,
        job: JobRunner,
        engine: LLMEngine,
        req_q: queue.Queue,
        out_q: queue.Queue,
        writer_errors: list[BaseException],
        report: JobReport,
        bar: tqdm,
        cap: int,
        lookahead: int,
    ) -> None:
        self.job, self.engine, self.req_q, self.out_q = job, engine, req_q, out_q
        self.writer_errors, self.report, self.bar, self.cap = writer_errors, report, bar, cap
        self.in_flight: dict[str, Request] = {}
        self.by_prefix = engine.cfg.admission_order == "prefix"
        self.batch = min(cap, engine.cfg.max_num_seqs)
        self.window: PrefixWindow[Request] | _FifoWindow = (
            PrefixWindow(engine.block_size, lookahead, engine.bm.is_cached)
            if self.by_prefix
            else _FifoWindow(lookahead)
        )
        self.leaders: dict[tuple, str] = {}  # duplicate key -> request id in flight
        self.followers: dict[str, list[Request]] = {}  # request id -> rows waiting for its output
        self.leader_key: dict[str, tuple] = {}
        self.perfect = PromptBlockCounter(engine.block_size)
        self.reading = True
        self.t0 = time.perf_counter()
        self.rate_window: deque[tuple[float, int]] = deque()  # (time, generated tokens) of recent steps
        self.shown = 0.0
        self.tokens_per_row = self._expected_tokens_per_row()

    def run(self, signals: StopSignals) -> None:
        while signals.received is None:
            self._admit()
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self._finish(out)
                self._show_rates()
            elif not self.reading and not self.in_flight and not len(self.window):
                return

    @property
    def unfinished(self) -> int:
        return len(self.in_flight) + sum(len(f) for f in self.followers.values()) + len(self.window)

    def _admit(self) -> None:
        """Fill the lookahead window from the reader, then move rows from it into the engine;
        rows that failed to build (or to validate) go straight to the writer with their error."""
        while self.reading and not self.window.full:
            # With nothing in the engine, wait for the reader (0.5 s at most per row) rather than
            # admit from a window that is still filling: the first batch then sees the lookahead too.
            idle = not self.in_flight and not self.engine.has_unfinished()
            try:
                item = self.req_q.get(block=idle, timeout=0.5)
            except queue.Empty:
                break
            if item is _END:
                self.reading = False
                break
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                self._fail(item, item.error)
            else:
                self.window.add(item, item.token_ids)
        # The engine is topped up to one batch at once; beyond that rows wait for a full window
        # (or the input's end), so that the order sees the whole lookahead.
        while len(self.window) and len(self.in_flight) < self.cap:
            if self.reading and not self.window.full and len(self.in_flight) >= self.batch:
                break
            item = self.window.pop()
            ids, params = item.token_ids, item.params
            assert ids is not None and params is not None  # built without error
            key = duplicate_key(ids, params, item.lora_id) if self.by_prefix else None
            if key is not None and key in self.leaders:  # computed once, copied at the end
                self.followers[self.leaders[key]].append(item)
                continue
            try:
                self.engine.add_request(item.rid, ids, params, item.lora)
            except ValueError as e:
                self._fail(item, str(e))
                continue
            self.in_flight[item.rid] = item
            self.report.prompt_tokens += len(ids)
            self.perfect.add(ids)
            if key is not None:
                self.leaders[key] = item.rid
                self.leader_key[item.rid] = key
                self.followers[item.rid] = []

    def _finish(self, out: RequestOutput) -> None:
        req = self.in_flight.pop(out.request_id)
        rows = [req] + self.followers.pop(out.request_id, [])
        key = self.leader_key.pop(out.request_id, None)
        if key is not None:
            del self.leaders[key]
        for i, row in enumerate(rows):
            if out.error is not None:  # the engine gave up on this request alone
                self._fail(row, out.error)
                continue
            self.report.rows_ok += 1
            self.report.rows_deduplicated += i > 0
            if row.params is not None and row.params.structured_outputs is not None:
                self.report.structured_cut_short += any(c.finish_reason == "length" for c in out.outputs)
            self.report.generated_tokens += sum(len(c.token_ids) for c in out.outputs)
            self.job._put(self.out_q, self.job.codec.row(row, out, None), self.writer_errors)
            self.bar.update(1)

    def _fail(self, req: Request, error: str | None) -> None:
        self.report.rows_failed += 1
        message = str(error)
        self.report.errors[message] = self.report.errors.get(message, 0) + 1
        self.job._put(self.out_q, self.job.codec.row(req, None, error), self.writer_errors)
        self.bar.update(1)

    def _expected_tokens_per_row(self) -> float:
        gen = self.job.cfg.generation
        width = gen.get("beam_width") or gen.get("n") or 1
        return float((gen.get("max_tokens") or 16) * width)

    def _show_rates(self) -> None:
        """At most twice a second: rows in flight, tokens generated (finished rows or not), the
        rate over the last 30 s, and an ETA from the tokens still to generate (rows left times the
        mean tokens of the rows finished so far, or max_tokens x n before any finished)."""
        now = time.perf_counter()
        if now - self.shown < 0.5:
            return
        self.shown = now
        tokens = self.engine.generated_tokens
        window = self.rate_window
        window.append((now, tokens))
        while len(window) > 2 and now - window[0][0] > RATE_WINDOW_S:
            window.popleft()
        rate = (tokens - window[0][1]) / (now - window[0][0]) if now > window[0][0] else 0.0
        finished = self.report.rows_ok
        per_row = self.report.generated_tokens / finished if finished else self.tokens_per_row
        eta = None
        if self.bar.total is not None and rate > 0:
            rows_left = max(self.bar.total - self.bar.n, 0)
            eta = max(rows_left * per_row - (tokens - self.report.generated_tokens), 0.0) / rate
        show_progress(self.bar, tokens, rate, eta, in_flight=len(self.in_flight))

