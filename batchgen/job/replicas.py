"""Engines as replicas of a Ray Data pipeline: the body of one actor (``EngineReplica``, one
engine fed by several batches at once through ``EngineLoop``) and the actor pool that maps a dataset
through them (``apply_replicas``). Used by the Ray executor of a job
(``batchgen/job/ray_executor.py``) and by ``batchgen.ray_data.build_processor``."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from batchgen.engine.admission import admission_plan
from batchgen.job.config import JobConfig
from batchgen.job.rows import Request, RowCodec
from batchgen.job.sink import output_schema, rows_table
from batchgen.outputs import RequestOutput
from batchgen.params import LoRARequest, RequestParams

# Batches an actor works on at once: while one batch's last rows finish, the next one's fill the engine.
CALLS_PER_REPLICA = 2


class EngineLoop:
    """One engine shared by concurrent callers: ``run`` submits a batch of requests and blocks until
    all of them finished, while a background thread steps the engine over every caller's requests."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[dict[str, RequestOutput | str], threading.Event, int]] = {}
        self._next = 0
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="batchgen-engine", daemon=True)
        self._thread.start()

    def run(
        self, requests: Sequence[tuple[str, list[int], RequestParams, LoRARequest | None]]
    ) -> dict[str, RequestOutput | str]:
        """Outputs by request id (requests: id, token ids, parameters, adapter); a request the engine
        refused or gave up on maps to its error text."""
        results: dict[str, RequestOutput | str] = {}
        if not requests:
            return results
        done = threading.Event()
        with self._lock:
            call = self._next
            self._next += 1
        self._inbox.put((call, list(requests), results, done))
        while not done.wait(timeout=1.0):
            if self._failure is not None:
                raise RuntimeError(f"the engine failed: {self._failure}") from self._failure
        if self._failure is not None and len(results) < len(requests):
            raise RuntimeError(f"the engine failed: {self._failure}") from self._failure
        return results

    def _loop(self) -> None:
        engine = self.engine
        owner: dict[
            str, tuple[str, dict, threading.Event, int]
        ] = {}  # engine id -> (row id, results, event, call)
        pending: dict[int, int] = {}  # call -> requests not finished
        events: dict[int, threading.Event] = {}
        try:
            while True:
                block = not engine.has_unfinished()
                try:
                    item = self._inbox.get(block=block, timeout=None if block else 0)
                except queue.Empty:
                    item = None
                if item is not None:
                    call, requests, results, done = item
                    events[call] = done
                    pending[call] = 0
                    for rid, ids, params, lora in requests:
                        eid = f"{call}:{rid}"
                        try:
                            engine.add_request(eid, ids, params, lora)
                        except ValueError as e:
                            results[rid] = str(e)
                            continue
                        owner[eid] = (rid, results, done, call)
                        pending[call] += 1
                    if not pending[call]:
                        done.set()
                    continue  # take every batch waiting before the next step
                for out in engine.step():
                    rid, results, done, call = owner.pop(out.request_id)
                    results[rid] = out if out.error is None else out.error
                    pending[call] -= 1
                    if not pending[call]:
                        del pending[call]
                        events.pop(call).set()
        except BaseException as e:  # noqa: BLE001 - every waiting caller raises it
            self._failure = e
            for event in events.values():
                event.set()


def row_id(row: dict[str, Any], id_key: str | None) -> str:
    """The id a row of a user's dataset is known (and seeded) by: its id column, else its
    ``row_index``, else a hash of its content."""
    if id_key is not None and row.get(id_key) is not None:
        return str(row[id_key])
    if row.get("row_index") is not None:
        return str(row["row_index"])
    content = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return "sha1:" + hashlib.sha1(content.encode()).hexdigest()[:16]


class EngineReplica:
    """The body of one actor: loads the engine once, then turns batches of input rows into batches of
    output rows (``__call__``, Ray Data's callable-class protocol)."""

    def __init__(self, cfg: JobConfig, openai_in: bool = False, id_key: str | None = None) -> None:
        from batchgen.engine.engine import LLMEngine

        self.cfg = cfg
        self.id_key = id_key
        settings = cfg.engine_config()
        if settings.num_threads is None:  # as many threads as the CPUs Ray gave the actor
            settings = replace(settings, num_threads=max(1, int(cfg.ray.cpus_per_replica)))
        self.engine = LLMEngine(settings)
        for lora in cfg.lora.requests().values():  # every adapter read and checked before any row
            self.engine.add_lora(lora)
        self.tokenizer = self.engine.tokenizer
        self.codec = RowCodec(cfg, openai_in)
        self.loop = EngineLoop(self.engine)
        self.name = f"{os.uname().nodename}:{os.getpid()}"
        self.rows_deduplicated = 0

    def generate_rows(
        self, rows: list[dict[str, Any]], rids: list[str]
    ) -> tuple[list[Request], list[dict[str, Any]]]:
        """Build, generate and render ``rows`` (one output row each, in order)."""
        requests = [
            self.codec.build(self.tokenizer, row, rid, self.engine.compile_grammar)
            for row, rid in zip(rows, rids, strict=True)
        ]
        valid = [r for r in requests if r.error is None]
        prompts, params = [], []
        for r in valid:
            assert r.token_ids is not None and r.params is not None  # built without error
            prompts.append(r.token_ids)
            params.append(r.params)
        by_prefix = self.engine.cfg.admission_order == "prefix"
        lora_ids = [r.lora_id for r in valid]
        add, duplicates = admission_plan(prompts, params, self.engine.block_size, by_prefix, lora_ids)
        copies = {valid[i].rid: valid[j].rid for i, j in duplicates.items()}
        results = self.loop.run([(valid[i].rid, prompts[i], params[i], valid[i].lora) for i in add])
        self.rows_deduplicated += len(copies)
        out_rows = []
        for r in requests:
            result = r.error if r.error is not None else results[copies.get(r.rid, r.rid)]
            if isinstance(result, RequestOutput):
                out_rows.append(self.codec.row(r, result, None))
            else:
                out_rows.append(self.codec.row(r, None, result))
        return requests, out_rows

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        rids = [row_id(row, self.id_key) for row in rows]
        _, out_rows = self.generate_rows(rows, rids)
        return rows_table(out_rows, output_schema(batch.schema, out_rows, output_fields=self.cfg.output_fields()))


def apply_replicas(
    dataset, replica_cls: type, cfg: JobConfig, kwargs: dict[str, Any], whole_blocks: bool = False
):
    """``dataset.map_batches`` over a fixed pool of ``cfg.ray.num_replicas`` actors of ``replica_cls``,
    batches of ``ray.batch_rows`` rows (``whole_blocks``: one call per block)."""
    from ray.data import ActorPoolStrategy

    ray_cfg = cfg.ray
    # Ray Data refuses batch_size=None with GPUs in its public map_batches (a guard against
    # oversized batches); a job's blocks are its units of work, of batch_rows rows at most.
    map_batches = (
        dataset.map_batches_internal  # Ray's developer API for exactly this
        if whole_blocks and ray_cfg.gpus_per_replica
        else dataset.map_batches
    )
    return map_batches(
        replica_cls,
        fn_constructor_kwargs=kwargs,
        batch_size=None if whole_blocks else ray_cfg.batch_rows,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ActorPoolStrategy(
            size=ray_cfg.num_replicas,
            max_tasks_in_flight_per_actor=2 * CALLS_PER_REPLICA,
            max_concurrent_calls_per_actor=CALLS_PER_REPLICA,
            enable_true_multi_threading=True,
        ),
        num_cpus=ray_cfg.cpus_per_replica,
        num_gpus=ray_cfg.gpus_per_replica or None,
        # Ray Data restarts a dead actor and retries its tasks by default (max_restarts=-1,
        # max_task_retries=-1 for actor pools); tests/cluster kill one mid-job.
    )
