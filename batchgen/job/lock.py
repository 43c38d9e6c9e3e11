"""One writer per output directory (per ``run.shard`` index when the job is sharded).

Advisory ``flock`` locks on files in the output's bookkeeping directory (``OUT/.batchgen``),
released by the kernel when the process ends however it ends (SIGKILL included), so a crashed job
never leaves a stale lock behind:

* ``lock``: an unsharded job holds it exclusively; each worker of a sharded job holds it shared,
  so the workers of one job can share a directory but a plain job cannot join them.
* ``lock-IIIII-of-NNNNN``: a sharded worker holds its own index's lock exclusively, so two workers
  of the same index never write at once.

A local job on several replicas (``run.replicas``) holds ``lock`` shared, as its workers do.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from batchgen.job.sink import OutputWriteError


class OutputLocked(RuntimeError):
    """Another job is writing to the same output directory (or the same shard of it)."""


class OutputLock:
    def __init__(self, out_dir: Path, shard: tuple[int, int] | None, shared: bool = False) -> None:
        self.dir = out_dir
        self.shard = shard
        self.shared = shared  # ``lock`` alone, shared: the parent of a local job's replicas
        self._fds: list[int] = []

    def acquire(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputWriteError(self.dir, e) from e
        try:
            if self.shared:
                self._take("lock", fcntl.LOCK_SH, "an unsharded batchgen job is writing to this output directory")
            elif self.shard is None:
                self._take("lock", fcntl.LOCK_EX, "another batchgen job is writing to this output directory")
            else:
                i, n = self.shard
                self._take("lock", fcntl.LOCK_SH, "an unsharded batchgen job is writing to this output directory")
                self._take(f"lock-{i:05d}-of-{n:05d}", fcntl.LOCK_EX, f"another worker of shard {i}/{n} is running")
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
