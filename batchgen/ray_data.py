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

from typing import Any

from batchgen.job.config import InputConfig, JobConfig, OutputConfig, RayConfig, RunConfig
from batchgen.job.replicas import EngineReplica, apply_replicas
from batchgen.params import BeamSearchParams, SamplingParams


class Processor:
    """``processor(dataset) -> dataset``: the input's columns and the output columns, one row per
    input row. Built by ``build_processor``."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg

    def __call__(self, dataset):
        kwargs = {"cfg": self.cfg, "id_key": self.cfg.input.id_column}
        return apply_replicas(dataset, EngineReplica, self.cfg, kwargs)


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
