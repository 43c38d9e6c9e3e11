"""batchgen on Ray Data: engines as a pool of Ray actors behind ``Dataset.map_batches``.

For users who compose their own pipelines (read, filter, generate, score, write), in the spirit of
``ray.data.llm.build_processor``::

    import ray
    from batchgen.ray_data import build_processor

    processor = build_processor(
        "path/to/model",
        generation={"n": 2, "temperature": 0.8, "max_tokens": 64, "seed": 0},
        prompt_column="prompt",
        num_replicas=2,
    )
    out = processor(ray.data.read_parquet("prompts.parquet"))  # the input columns + the output columns
    out.write_parquet("generations/")

Each replica is one actor holding one engine. Ray Data hands it batches (several at once, so that
the engine's batch stays full across batch boundaries); the rows of every batch are admitted into
the engine by shared prefix, identical deterministic rows are computed once, and the output columns
(``completions``, ``num_prompt_tokens``, ``num_generated_tokens``, ``error``) are those of a job's
Parquet output. A bad row gets an ``error`` and the batch goes on. Sampling is seeded per row from
its id (``id_column``, else ``row_index``, else the prompt's text), so a row's output does not
depend on which replica ran it or with which other rows.

``python -m batchgen job`` with ``run.executor: ray`` runs a whole job this way
(``batchgen/job/ray_executor.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from batchgen.engine.admission import admission_plan
from batchgen.job.config import InputConfig, JobConfig, OutputConfig, RayConfig, RunConfig
from batchgen.job.rows import Request, RowCodec
from batchgen.job.sink import output_schema, rows_table
from batchgen.outputs import RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

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
        self, requests: Sequence[tuple[str, list[int], SamplingParams | BeamSearchParams]]
    ) -> dict[str, RequestOutput | str]:
        """Outputs by request id; a request the engine refused or gave up on maps to its error text."""
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
                    for rid, ids, params in requests:
                        eid = f"{call}:{rid}"
                        try:
                            engine.add_request(eid, ids, params)
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
        import torch

        from batchgen.config import EngineConfig
        from batchgen.engine.engine import LLMEngine

        torch.set_num_threads(max(1, int(cfg.ray.cpus_per_replica)))
        self.cfg = cfg
        self.id_key = id_key
        self.engine = LLMEngine(EngineConfig.from_kwargs(cfg.model, **cfg.engine))
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
        add, duplicates = admission_plan(prompts, params, self.engine.block_size, by_prefix)
        copies = {valid[i].rid: valid[j].rid for i, j in duplicates.items()}
        results = self.loop.run([(valid[i].rid, prompts[i], params[i]) for i in add])
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
        return rows_table(out_rows, output_schema(batch.schema, out_rows))


class Processor:
    """``processor(dataset) -> dataset``: the input's columns and the output columns, one row per
    input row. Built by ``build_processor``."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg

    def __call__(self, dataset):
        kwargs = {"cfg": self.cfg, "id_key": self.cfg.input.id_column}
        return apply_replicas(dataset, EngineReplica, self.cfg, kwargs)


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


def build_processor(
    model: str,
    *,
    generation: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    prompt_column: str | None = "prompt",
    messages_column: str | None = None,
    id_column: str | None = None,
    params_column: str | None = None,
    add_generation_prompt: bool = True,
    num_replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    batch_rows: int = 256,
) -> Processor:
    """A ``Processor`` for ``model`` (a local Hugging Face directory, readable from every node).

    ``generation``: a job's ``generation`` section (``SamplingParams`` fields, or ``beam_width`` for
    beam search); ``engine``: ``EngineConfig`` fields. Exactly one of ``prompt_column`` (text) and
    ``messages_column`` (chat messages through the model's template). Settings are checked here,
    before any actor starts; a bad one raises ``ValueError`` naming it.
    """
    from pathlib import Path

    from batchgen.config import EngineConfig

    if messages_column is not None and prompt_column == "prompt":
        prompt_column = None
    if not Path(model).is_dir():
        raise ValueError(f"model: directory {model!r} does not exist")
    generation, engine = dict(generation or {}), dict(engine or {})
    (BeamSearchParams if "beam_width" in generation else SamplingParams).from_dict(generation)
    EngineConfig.from_kwargs(model, **engine)
    if num_replicas < 1 or batch_rows < 1 or cpus_per_replica <= 0 or gpus_per_replica < 0:
        raise ValueError(
            "num_replicas and batch_rows must be >= 1, cpus_per_replica > 0 and gpus_per_replica >= 0; got "
            f"{num_replicas}, {batch_rows}, {cpus_per_replica}, {gpus_per_replica}"
        )
    if bool(prompt_column) == bool(messages_column):
        raise ValueError("give exactly one of prompt_column or messages_column")
    cfg = JobConfig(
        model=model,
        input=InputConfig(
            path="<ray.data.Dataset>",
            prompt_column=prompt_column,
            messages_column=messages_column,
            id_column=id_column,
            params_column=params_column,
        ),
        output=OutputConfig(path="<ray.data.Dataset>"),
        generation=generation,
        engine=engine,
        run=RunConfig(add_generation_prompt=add_generation_prompt, executor="ray"),
        ray=RayConfig(
            num_replicas=num_replicas,
            cpus_per_replica=cpus_per_replica,
            gpus_per_replica=gpus_per_replica,
            batch_rows=batch_rows,
        ),
    )
    return Processor(cfg)
