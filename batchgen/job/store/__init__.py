"""Where a job's output goes: a local directory (``local.LocalStore``) or an S3 prefix
(``s3.S3Store``), both an ``OutputStore`` (``base.py``: the interface, the two kinds of holding, the
commit gate and the errors). ``open_store`` picks one by the output's URI."""

from __future__ import annotations

from batchgen import storage
from batchgen.job.store.base import (
    BOOKKEEPING_DIR,
    CommitGate,
    Holding,
    OutputLocked,
    OutputStore,
    OutputUnavailable,
    OutputWriteError,
    ShardDropped,
)
from batchgen.job.store.local import LocalStore
from batchgen.job.store.s3 import LeaseLost, S3Store

__all__ = [
    "BOOKKEEPING_DIR", "CommitGate", "Holding", "LeaseLost", "LocalStore", "OutputLocked", "OutputStore",
    "OutputUnavailable", "OutputWriteError", "S3Store", "ShardDropped", "open_store",
]


def open_store(path: str) -> OutputStore:
    """The output store of ``output.path``: a local directory or ``s3://BUCKET/PREFIX``."""
    s = storage.scheme(path)
    if s is None:
        return LocalStore(path)
    if s == "s3":
        return S3Store(path)
    raise storage.StorageError(
        f"output.path: {storage.redact(path)!r}: a job writes to a local directory or s3:// (any "
        f"S3-compatible store); {s}:// is read-only here"
    )
