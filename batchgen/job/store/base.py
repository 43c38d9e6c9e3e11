"""What every output store provides (``OutputStore``), the ways of holding an output and the commit
gate, and the errors the stores raise.

Two kinds of holding, named apart:

* ``hold(shard)``: the writer's hold. Exclusive: one unsharded job per output, or one worker per
  index of a sharded job (which still keeps unsharded jobs away).
* ``hold_for_workers()``: the parent of a local job's replicas, whose workers each take their own
  ``hold(shard)``; it keeps an unsharded job off the output while they run. Each store says how
  strongly (a shared lock on disk; a check on a bucket, which holds nothing).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from batchgen import storage

BOOKKEEPING_DIR = ".batchgen"  # manifest, report, locks and leases, inside the output


class OutputLocked(RuntimeError):
    """Another job is writing to the same output (or the same shard of it)."""


class OutputWriteError(RuntimeError):
    """Writing the job's output failed (disk full, read-only, permissions); names the path."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot write {path}: {error.strerror or error}")
        self.path = path
        self.errno = error.errno


class ShardDropped(RuntimeError):
    """A shard finished after its job was stopped (a Ray replica outliving the driver's loop): it is
    not kept, and the rerun does its rows again."""


class OutputUnavailable(storage.StorageError):
    """The output could not be taken before any work (access denied, the store unreachable)."""


class Holding(Protocol):
    """A hold on an output (a lock or a lease), taken by ``acquire`` or ``with``."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...

    def __enter__(self) -> Holding: ...

    def __exit__(self, *exc: object) -> None: ...


class CommitGate(Protocol):
    """Lets a Ray job's driver stop its replicas' shard commits at a known moment: ``open`` before
    the work, ``stop`` at its end, and each write of a shard inside ``commit(name)``, which raises
    ``ShardDropped`` once the gate is stopped."""

    def open(self) -> None: ...

    def stop(self) -> None: ...

    def commit(self, name: str | Path) -> AbstractContextManager[None]: ...


class OutputStore(Protocol):
    """Where a job's output goes. Each object (a shard, a manifest, a report) is written whole or not
    at all; names are relative to the output's root (``folder/name``)."""

    display: str  # the output as shown to the user (credentials redacted)

    def files(self, folder: str = "") -> list[str]:
        """The names of the objects directly in ``folder``, sorted."""

    def read(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is none."""

    def write(self, name: str, data: bytes, gate: CommitGate | None = None) -> None:
        """Write the object whole (inside ``gate``'s commit when given)."""

    def delete(self, name: str) -> None:
        """Remove the object (nothing when there is none)."""

    def exists(self) -> bool:
        """Whether the output holds anything yet."""

    def remove_folders(self) -> None:
        """Remove the folders a user put in the output (``--overwrite``); the bookkeeping stays."""

    def clean_temp(self, prefix: str, folder: str = "") -> None:
        """Remove what a crashed write of objects named ``prefix*`` left behind."""

    def open_input(self, name: str) -> Any:
        """The object as a file to read from (a path, or a random-access file)."""

    def hold(self, shard: tuple[int, int] | None) -> Holding:
        """The writer's hold on the output (``shard``: this worker's index and count)."""

    def hold_for_workers(self) -> Holding:
        """The hold of the parent of a local job's workers."""

    def commit_gate(self) -> CommitGate:
        """The output's commit gate (``CommitGate``)."""

    def check_writable(self) -> None:
        """Raise ``StorageError`` naming the problem unless the output can be written."""
