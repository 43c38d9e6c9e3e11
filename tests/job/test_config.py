"""The job config in two steps: ``validate`` (the schema and its rules: it reads no file and no
network and sets nothing) and ``preflight.check_world`` (the model, the input's data and the output,
with the storage options set), each problem named on one line."""

from __future__ import annotations

import socket

import pytest

from batchgen import storage
from batchgen.job.config import ConfigError, validate
from batchgen.job.preflight import check_world


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validation_reads_no_store_and_sets_no_global(tmp_path):
    """Everything a validation could reach is out of reach: a model that is neither a directory
    nor a cached hub id, an input and an output in a bucket whose endpoint refuses connections.
    Validation accepts the config as written and leaves the process's storage options alone."""
    before = storage.options()
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    data = {
        "model": "nobody/no-such-model",
        "input": {"path": "s3://bucket/in/*.parquet", "prompt_column": "text"},
        "output": {"path": "s3://bucket/out"},
        "storage": {"endpoint_url": endpoint, "max_attempts": 1},
        "lora": {"adapters": {"sql": str(tmp_path / "no-adapter")}},
    }
    cfg = validate(data)
    assert storage.options() is before
    assert cfg.model == "nobody/no-such-model" and cfg.output.path == "s3://bucket/out"
    assert cfg.storage.endpoint_url == endpoint and cfg.lora.adapters == {"sql": str(tmp_path / "no-adapter")}
    with pytest.raises(ConfigError, match="output.format: must be one of"):
        validate({**data, "output": {"path": "s3://bucket/out", "format": "csv"}})
    assert storage.options() is before


def test_the_world_checks_name_every_problem_in_one_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = validate({
        "model": str(tmp_path / "no-model"),
        "input": {"path": str(tmp_path / "nothing.parquet"), "prompt_column": "text"},
        "output": {"path": str(blocker / "out")},
        "lora": {"adapters": {"sql": str(tmp_path)}},
    })
    with pytest.raises(ConfigError) as e:
        check_world(cfg)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("invalid job config")
    for needle in (f"model: directory {str(tmp_path / 'no-model')!r} does not exist",
                   "lora.adapters.sql: ", "is not a PEFT adapter directory",
                   f"input.path: nothing found at {str(tmp_path / 'nothing.parquet')!r}",
                   f"output.path: {str(blocker)!r} is not a directory"):
        assert sum(needle in line for line in lines[1:]) == 1, (needle, lines)
