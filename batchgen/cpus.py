"""The CPUs this process may use, read as Linux states them: the affinity mask, the cgroup's CPU
quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the tightest along the
cgroup's path) and the machine's NUMA nodes (``/sys/devices/system/node``).

``choose_threads`` turns them into the engine's thread count: the ``num_threads`` setting, else
``OMP_NUM_THREADS``, else the smaller of the affinity mask and the quota rounded up. Its reason says
which, for ``stats()`` and the job report.

``BATCHGEN_SYSTEM_ROOT`` names a directory that stands in for ``/`` when these files are read (its
``proc/self/cgroup``, ``sys/fs/cgroup/...``, ``sys/devices/system/node/...``): tests point it at
fake trees. The affinity mask is always the process's own.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "BATCHGEN_SYSTEM_ROOT"


def system_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or "/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``0-3,8,10-11``) as CPU numbers; empty text is no CPUs."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass(frozen=True)
class CpuQuota:
    """A cgroup's CPU bandwidth limit: ``quota_us`` of CPU time every ``period_us``."""

    quota_us: int
    period_us: int
    where: str  # the file that set it

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


def _v2_quota(directory: Path) -> CpuQuota | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return CpuQuota(int(fields[0]), period, str(directory / "cpu.max"))


def _v1_quota(directory: Path) -> CpuQuota | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None  # -1: no limit
    return CpuQuota(int(quota), int(period), str(directory / "cpu.cfs_quota_us"))


def _along(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory under ``mount`` and each of its ancestors up to the mount itself. In a
    container with its own cgroup namespace the path is ``/`` and the mount is the container's
    cgroup; where the host's path is shown but not mounted, the mount alone is read."""
    own = mount / cgroup_path.strip("/")
    if not own.is_dir():
        return [mount]
    dirs = [own]
    while dirs[-1] != mount:
        dirs.append(dirs[-1].parent)
    return dirs


def cgroup_quota(root: Path | None = None) -> CpuQuota | None:
    """The tightest CPU quota on this process's cgroup path (v2 or v1), or None without one."""
    root = system_root() if root is None else root
    text = _read(root / "proc/self/cgroup") or ""
    fs = root / "sys/fs/cgroup"
    found: list[CpuQuota] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2, the unified hierarchy
            mount = fs if (fs / "cgroup.controllers").exists() else fs / "unified"
            found += [q for d in _along(mount, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            v1 = next(
                (fs / name for name in (controllers, "cpu,cpuacct", "cpuacct,cpu", "cpu") if (fs / name).is_dir()),
                None,
            )
            if v1 is not None:
                found += [q for d in _along(v1, path) if (q := _v1_quota(d)) is not None]
    return min(found, key=lambda q: q.cpus, default=None)


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def numa_nodes(root: Path | None = None) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from ``/sys/devices/system/node/node*/cpulist``; nodes without CPUs
    (memory-only) are left out. Empty where the kernel shows no nodes."""
    root = system_root() if root is None else root
    nodes: dict[int, list[int]] = {}
    base = root / "sys/devices/system/node"
    for d in sorted(base.glob("node[0-9]*")):
        m = re.fullmatch(r"node(\d+)", d.name)
        text = _read(d / "cpulist")
        if m and text is not None and (cpus := parse_cpu_list(text)):
            nodes[int(m.group(1))] = cpus
    return dict(sorted(nodes.items()))


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count the engine runs with and why (``stats()``: ``num_threads``,
    ``num_threads_reason``)."""

    count: int
    reason: str


def choose_threads(setting: int | None = None, root: Path | None = None) -> ThreadChoice:
    """``setting`` (the engine's ``num_threads``), else ``OMP_NUM_THREADS``, else the smaller of
    the affinity mask's CPUs and the cgroup quota rounded up; at least 1."""
    if setting:
        return ThreadChoice(int(setting), f"num_threads={setting} (engine setting)")
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), f"OMP_NUM_THREADS={env}")
    online = os.cpu_count() or 1
    allowed = affinity_cpus()
    quota = cgroup_quota(root)
    if quota is not None and math.ceil(quota.cpus) < len(allowed):
        return ThreadChoice(
            max(1, math.ceil(quota.cpus)), f"cgroup quota {quota.cpus:.1f} CPUs of {online} ({quota.where})"
        )
    if len(allowed) < online:
        return ThreadChoice(max(1, len(allowed)), f"affinity mask {len(allowed)} CPUs of {online}")
    return ThreadChoice(max(1, len(allowed)), f"all {online} CPUs")


# -- how OpenMP threads wait ---------------------------------------------------------------------
# torch and the compiled kernels share torch's libgomp, which reads its wait policy once, when it
# loads: waiting threads spin GOMP_SPINCOUNT times (300,000, about 3 ms, unless OMP_WAIT_POLICY or
# GOMP_SPINCOUNT say otherwise) before they sleep. batchgen leaves it as it is: on a quiet machine
# spinning is what keeps short regions fast, and on shared cores ``SharedCores`` takes threads away
# instead (docs/benchmarks.md, "Shared cores, CPU quotas and replicas", measures the policies).
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def omp_wait_policy() -> str:
    """The wait policy libgomp was given through the environment, for ``stats()``."""
    given = [f"{k}={os.environ[k]}" for k in WAIT_VARS if k in os.environ]
    return ", ".join(given) if given else "libgomp's default (300000 spins)"


# -- other processes on this process's CPUs ------------------------------------------------------
def _cpu_busy_ticks(root: Path, cpus: set[int]) -> int | None:
    """Clock ticks the kernel counts as busy (user, nice, system, irq, softirq and steal) on
    ``cpus``, summed, from ``/proc/stat``."""
    text = _read(root / "proc/stat")
    if text is None:
        return None
    total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in rest.split()]
            total += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return total


def _own_ticks(root: Path) -> int | None:
    """This process's user and system clock ticks, every thread's, from ``/proc/self/stat``."""
    text = _read(root / "proc/self/stat")
    if text is None:
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)


class SharedCores:
    """The threads to run while other processes share this process's CPUs: the engine's count,
    less the CPUs the others used on them over the last ``window_s`` seconds (rounded), at least 1.

    An OpenMP region ends when its slowest thread does, and a thread that shares its core with
    another process's runs a fraction of the time: with one of 2 cores busy, 2 threads ran workload
    D at about 0.4x its quiet rate, 1 thread at about 0.6x (docs/benchmarks.md). The others' use is
    the busy time ``/proc/stat`` counts on these CPUs less this process's own, so the engine's own
    threads and its job's reader and writer never count, and a quiet machine keeps every thread.
    """

    def __init__(
        self,
        cpus: list[int],
        threads: int,
        window_s: float = 1.0,
        root: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.cpus = set(cpus)
        self.max_threads = threads
        self.threads = threads
        self.window_s = window_s
        self.root = system_root() if root is None else root
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.others = 0.0  # CPUs the other processes used in the last window
        self.reduced_s = 0.0  # seconds run with fewer threads than ``max_threads``
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int] | None:
        busy, own = _cpu_busy_ticks(self.root, self.cpus), _own_ticks(self.root)
        return None if busy is None or own is None else (self.clock(), busy, own)

    def update(self) -> int:
        """The thread count for the next step (measured at most once a window)."""
        if self._last is None or self.max_threads <= 1:
            return self.threads
        now = self.clock()
        elapsed = now - self._last[0]
        if elapsed < self.window_s:
            return self.threads
        sample = self._sample()
        if sample is None:
            return self.threads
        self.others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / self.hz / elapsed
        if self.threads < self.max_threads:
            self.reduced_s += elapsed
        self._last = sample
        free = len(self.cpus) - self.others
        self.threads = max(1, min(self.max_threads, math.floor(free + 0.5)))
        return self.threads
