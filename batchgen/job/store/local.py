"""An output directory on a POSIX filesystem (``LocalStore``).

Every object is written whole: a temp file, fsync, rename (``atomic_write_bytes``). One writer per
output directory (per ``run.shard`` index when the job is sharded) is kept by advisory ``flock``
locks on files in the output's bookkeeping directory (``OUT/.batchgen``), released by the kernel
when the process ends however it ends (SIGKILL included), so a crashed job never leaves a stale
lock behind (``OutputLock``):

* ``lock``: an unsharded job holds it exclusively; each worker of a sharded job holds it shared,
  so the workers of one job can share a directory but a plain job cannot join them.
* ``lock-IIIII-of-NNNNN``: a sharded worker holds its own index's lock exclusively, so two workers
  of the same index never write at once.

The parent of a local job's replicas (``hold_for_workers``) holds ``lock`` shared, as its workers do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from batchgen import storage
from batchgen.job.store.base import BOOKKEEPING_DIR, CommitGate, OutputLocked, OutputWriteError, ShardDropped
from batchgen.job.workers import shard_tag


class LocalStore:
    """An output directory on a POSIX filesystem."""

    def __init__(self, path: str) -> None:
        self.root = Path(storage.local_path(path))
        self.display = str(self.root)

    def files(self, folder: str = "") -> list[str]:
        base = self.root / folder
        try:
            return sorted(e.name for e in os.scandir(base) if e.is_file())
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes, gate: CommitGate | None = None) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data, gate)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def exists(self) -> bool:
        return self.root.exists()

    def remove_folders(self) -> None:
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.is_dir() and path.name != BOOKKEEPING_DIR:
                    shutil.rmtree(path)

    def clean_temp(self, prefix: str, folder: str = "") -> None:
        """Temp files (``.PREFIX*tmp``) a crash or a full disk left behind in ``folder``."""
        base = self.root / folder
        if base.is_dir():
            for stale in base.glob(f".{prefix}*tmp"):
                stale.unlink(missing_ok=True)

    def open_input(self, name: str) -> str:
        return str(self.root / name)

    def hold(self, shard: tuple[int, int] | None) -> OutputLock:
        return OutputLock(self.root / BOOKKEEPING_DIR, shard)

    def hold_for_workers(self) -> OutputLock:
        return OutputLock(self.root / BOOKKEEPING_DIR, None, workers_side=True)

    def commit_gate(self) -> DirectoryGate:
        return DirectoryGate(self.root / BOOKKEEPING_DIR)

    def check_writable(self) -> None:
        """``StorageError`` when the directory, or the nearest existing folder above it, is a file
        (the rest is checked when the job takes its lock: ``OutputWriteError`` naming it)."""
        for candidate in (self.root, *self.root.parents):
            if candidate.exists():
                if not candidate.is_dir():
                    raise storage.StorageError(f"{str(candidate)!r} is not a directory")
                return


class OutputLock:
    """The flocks of one writer (``shard``: a worker of a sharded job), or with ``workers_side`` the
    shared ``lock`` alone: the parent of a local job's replicas."""

    def __init__(self, out_dir: Path, shard: tuple[int, int] | None, workers_side: bool = False) -> None:
        self.dir = out_dir
        self.shard = shard
        self.workers_side = workers_side
        self._fds: list[int] = []

    def acquire(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputWriteError(self.dir, e) from e
        try:
            if self.workers_side:
                self._take("lock", fcntl.LOCK_SH, "an unsharded batchgen job is writing to this output directory")
            elif self.shard is None:
                self._take("lock", fcntl.LOCK_EX, "another batchgen job is writing to this output directory")
            else:
                i, n = self.shard
                self._take("lock", fcntl.LOCK_SH, "an unsharded batchgen job is writing to this output directory")
                self._take(f"lock{shard_tag(self.shard)}", fcntl.LOCK_EX, f"another worker of shard {i}/{n} is running")
        except OutputLocked:
            self.release()
            raise

    def _take(self, name: str, mode: int, why: str) -> None:
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only directory, say
            raise OutputWriteError(path, e) from e
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise OutputLocked(
                f"{why} ({path} is locked{f' by pid {holder}' if holder else ''}); "
                "wait for it to finish, stop it, or choose another output.path"
            ) from None
        if mode == fcntl.LOCK_EX:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fds.append(fd)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops its flock
        self._fds.clear()

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class DirectoryGate:
    """The commit gate of a directory (``CommitGate``).

    A replica renames each shard into place under a shared ``flock`` on ``commits.lock``, and only
    while ``commits.stopped`` is absent. The driver's ``stop`` takes the lock exclusively and creates
    that file: once it returns, no shard appears on disk any more, so the manifest written next lists
    every shard there is."""

    def __init__(self, meta_dir: Path) -> None:
        self.lock = meta_dir / "commits.lock"
        self.stopped = meta_dir / "commits.stopped"

    def open(self) -> None:
        self.stopped.unlink(missing_ok=True)

    def stop(self) -> None:
        with self._locked(fcntl.LOCK_EX):
            self.stopped.touch()

    @contextlib.contextmanager
    def commit(self, name: str | Path) -> Iterator[None]:
        with self._locked(fcntl.LOCK_SH):
            if self.stopped.exists():
                raise ShardDropped(f"{Path(name).name} finished after the job stopped; the rerun writes it again")
            yield

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops its flock


def _tmp_path(path: Path) -> Path:
    # the writer's pid keeps two processes writing the same name (a retried task) apart
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_bytes(path: Path, data: bytes, gate: CommitGate | None = None) -> None:
    """Write ``path`` whole or not at all: a temp file, fsync, rename (while ``gate`` is open). A
    failure (a full disk) removes the temp file and raises ``OutputWriteError``; ``path`` keeps its
    old content."""
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, path, gate)
    except OSError as e:
        _discard(tmp)
        raise OutputWriteError(path, e) from e
    _fsync_dir(path.parent)


def _commit(tmp: Path, path: Path, gate: CommitGate | None) -> None:
    if gate is None:
        os.replace(tmp, path)
        return
    try:
        with gate.commit(path):
            os.replace(tmp, path)
    except ShardDropped:
        _discard(tmp)
        raise


def _discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
