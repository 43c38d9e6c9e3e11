"""The CPUs a process may use (``batchgen/cpus.py``): cgroup quotas (v1, v2, "max", nested), NUMA
nodes and the thread count chosen from them, read from fake trees under ``BATCHGEN_SYSTEM_ROOT``;
then end to end, an engine in a fresh process whose fake cgroup allows one CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from batchgen.cpus import CpuQuota, SharedCores, cgroup_quota, choose_threads, numa_nodes, parse_cpu_list

ROOT = Path(__file__).resolve().parents[1]


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2(root: Path, cgroup: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree: the process in ``cgroup``, ``cpu.max`` of each directory in ``limits``."""
    files = {"proc/self/cgroup": f"0::{cgroup}\n", "sys/fs/cgroup/cgroup.controllers": "cpu memory\n"}
    for d, text in limits.items():
        files[f"sys/fs/cgroup/{d}/cpu.max".replace("//", "/")] = text
    return tree(root, files)


@pytest.fixture
def no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("\n") == []


def test_v2_quota_of_the_process_cgroup(tmp_path):
    root = v2(tmp_path, "/kubepods/pod1/c1", {"kubepods/pod1/c1": "200000 100000\n"})
    assert cgroup_quota(root) == CpuQuota(200000, 100000, str(root / "sys/fs/cgroup/kubepods/pod1/c1/cpu.max"))
    assert cgroup_quota(root).cpus == 2.0


def test_v2_max_is_no_quota(tmp_path):
    assert cgroup_quota(v2(tmp_path, "/c", {"c": "max 100000\n", "": "max 100000\n"})) is None


def test_v2_nested_quota_is_the_tightest_ancestor(tmp_path):
    root = v2(tmp_path, "/a/b/c", {"a/b/c": "max 100000\n", "a/b": "150000 100000\n", "a": "800000 100000\n"})
    assert cgroup_quota(root).cpus == 1.5
    root = v2(tmp_path / "two", "/a/b", {"a/b": "50000 100000\n", "a": "150000 100000\n"})
    assert cgroup_quota(root).cpus == 0.5


def test_v2_in_a_cgroup_namespace_reads_the_mount_itself(tmp_path):
    """A container with its own cgroup namespace sees its cgroup as ``/``, mounted at the root."""
    assert cgroup_quota(v2(tmp_path, "/", {"": "300000 100000\n"})).cpus == 3.0
    # the host's path shown but not mounted: the mount's own limit
    assert cgroup_quota(v2(tmp_path / "h", "/host/path", {"": "100000 100000\n"})).cpus == 1.0


def test_v1_cfs_quota_and_the_unlimited_minus_one(tmp_path):
    root = tree(tmp_path, {
        "proc/self/cgroup": "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n0::/\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(root).cpus == 0.5
    unlimited = tree(tmp_path / "u", {
        "proc/self/cgroup": "1:cpu:/\n",
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(unlimited) is None


def test_no_cgroup_files_is_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None


def test_threads_follow_the_setting_then_omp_num_threads_then_the_quota(tmp_path, monkeypatch, no_omp_env):
    cpus = len(os.sched_getaffinity(0))
    online = os.cpu_count()
    one = v2(tmp_path, "/", {"": "50000 100000\n"})  # half a CPU: rounded up to 1
    monkeypatch.setenv("BATCHGEN_SYSTEM_ROOT", str(one))
    if cpus > 1:
        assert choose_threads(None) == choose_threads(None, one)
        got = choose_threads(None)
        assert got.count == 1 and got.reason.startswith(f"cgroup quota 0.5 CPUs of {online} (")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(None).count == 3 and choose_threads(None).reason == "OMP_NUM_THREADS=3"
    assert choose_threads(5).count == 5 and "engine setting" in choose_threads(5).reason
    monkeypatch.delenv("OMP_NUM_THREADS")
    wide = v2(tmp_path / "w", "/", {"": f"{100000 * (cpus + 8)} 100000\n"})  # a quota above the mask: the mask
    got = choose_threads(None, wide)
    assert got.count == cpus and ("affinity mask" in got.reason or got.reason == f"all {online} CPUs")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to cut the mask to one")
def test_an_affinity_mask_of_one_cpu_gives_one_thread(tmp_path, no_omp_env):
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from batchgen.cpus import choose_threads; c = choose_threads(None); print(c.count, c.reason)"
    )
    env = {**os.environ, "BATCHGEN_SYSTEM_ROOT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"1 affinity mask 1 CPUs of {os.cpu_count()}"


def test_numa_nodes_from_sysfs_leave_out_memory_only_nodes(tmp_path):
    root = tree(tmp_path, {
        "sys/devices/system/node/node0/cpulist": "0-3,8-11\n",
        "sys/devices/system/node/node1/cpulist": "4-7,12-15\n",
        "sys/devices/system/node/node2/cpulist": "\n",  # CXL memory, no CPUs
        "sys/devices/system/node/possible": "0-2\n",
    })
    assert numa_nodes(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert numa_nodes(tmp_path / "none") == {}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for a quota below them")
def test_an_engine_under_a_one_cpu_quota_runs_one_thread(tmp_path, llama_dir, no_omp_env):
    """A fresh interpreter whose cgroup is a fake v2 tree allowing one CPU: torch and the engine run
    one thread, and ``stats()`` says why."""
    root = v2(tmp_path, "/job", {"job": "100000 100000\n"})
    code = (
        "import json, sys; from batchgen import LLM; import torch\n"
        "llm = LLM(sys.argv[1], dtype='float32', num_kv_blocks=64, max_model_len=128)\n"
        "llm.generate(['a b c'], use_tqdm=False)\n"
        "s = llm.stats(); print(json.dumps({'torch': torch.get_num_threads(), 'threads': s['num_threads'],"
        " 'reason': s['num_threads_reason'], 'wait': s['omp_wait_policy']}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(BATCHGEN_SYSTEM_ROOT=str(root), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, llama_dir], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == 1 and got["threads"] == 1, got
    assert got["reason"] == f"cgroup quota 1.0 CPUs of {os.cpu_count()} ({root}/sys/fs/cgroup/job/cpu.max)"
    assert got["wait"] == "libgomp's default (300000 spins)", got


def _proc(root: Path, busy: tuple[int, int], own: int) -> None:
    """A fake ``/proc/stat`` whose cpu0 / cpu1 have ``busy`` ticks (user) and a ``/proc/self/stat``
    with ``own`` ticks (utime)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"] + [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(busy)]
    tree(root, {"proc/stat": "\n".join(lines) + "\n",
                "proc/self/stat": f"42 (python -m x) R 1 1 1 0 -1 0 0 0 0 0 {own} 0 0 0 20 0 3 0\n"})


def test_threads_drop_by_the_cpus_other_processes_take_and_come_back(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    now = [0.0]
    _proc(tmp_path, (0, 0), 0)
    shared = SharedCores([0, 1], 2, window_s=1.0, root=tmp_path, clock=lambda: now[0])
    # a second with both CPUs busy, all of it this process's: nothing to give up
    now[0] = 1.0
    _proc(tmp_path, (hz, hz), 2 * hz)
    assert shared.update() == 2 and shared.others == 0.0
    # within the window: no new reading
    now[0] = 1.5
    _proc(tmp_path, (2 * hz, 2 * hz), 2 * hz)
    assert shared.update() == 2
    # the next second: another process used 0.7 of a CPU (1.4 CPUs busy, 0.7 ours): one thread
    now[0] = 2.0
    _proc(tmp_path, (hz + hz, hz + int(0.4 * hz)), 2 * hz + int(0.7 * hz))
    assert shared.update() == 1 and shared.others == pytest.approx(0.7, abs=0.02)
    # it ended: both threads again, and the second at one thread is counted
    now[0] = 3.0
    _proc(tmp_path, (3 * hz, 2 * hz), 4 * hz)
    assert shared.update() == 2 and shared.reduced_s == pytest.approx(1.0)


def test_no_proc_files_keep_the_thread_count(tmp_path):
    shared = SharedCores([0, 1], 2, window_s=0.0, root=tmp_path)
    assert shared.update() == 2 and shared.update() == 2


class FakeLoad:
    """Another process's load as the engine reads it: a fake ``/proc/stat`` (under
    ``BATCHGEN_SYSTEM_ROOT``) in which, while ``busy``, one of ``cpus`` is counted busy for all of
    the time that passes, and a ``/proc/self/stat`` whose own ticks never move. Written whole
    (rename) by a thread, so the engine never reads a half-written file; the machine's real load
    plays no part."""

    def __init__(self, root: Path, cpus: list[int]) -> None:
        self.root, self.cpus = root, cpus
        self.hz = os.sysconf("SC_CLK_TCK")
        self.ticks = 0.0  # the busy CPU's ticks so far
        self.busy = threading.Event()
        self.stop = threading.Event()
        self._write()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{c} {int(self.ticks) if i == 0 else 0} 0 0 1000 0 0 0 0 0 0" for i, c in enumerate(self.cpus)]
        files = {"proc/stat": "\n".join(lines) + "\n",
                 "proc/self/stat": "42 (python -m x) R 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 3 0\n"}
        for name, text in files.items():
            path = self.root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.02):
            now = time.monotonic()
            if self.busy.is_set():
                self.ticks += (now - last) * self.hz
            last = now
            self._write()

    def __enter__(self) -> FakeLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engine threads need 2 CPUs")
def test_an_engine_beside_a_busy_loop_runs_fewer_threads_and_the_same_tokens(llama_dir, tmp_path, monkeypatch):
    """Another process busy on one of the engine's two CPUs (a fake ``/proc/stat`` the test drives):
    once a window has seen it, steps run one thread (greedy tokens unchanged); once it ends, two
    again. Waits for the engine's own figures, for as many calls as it takes."""
    import torch

    from batchgen import LLM, SamplingParams
    from batchgen.cpus import ROOT_ENV, affinity_cpus

    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    with FakeLoad(tmp_path, affinity_cpus()) as load:
        llm = LLM(llama_dir, dtype="float32", num_kv_blocks=256, max_model_len=256, num_threads=2)
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        prompts = ["the cat sat on the mat", "a dog", "fox fox fox"] * 4
        quiet = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["threads_now"] == 2, llm.stats()
        load.busy.set()
        for _ in range(2000):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if llm.stats()["threads_now"] == 1:
                break
        assert llm.stats()["threads_now"] == 1, llm.stats()
        assert llm.stats()["others_cpus"] > 0.5
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert torch.get_num_threads() == 1 and got == quiet
        load.busy.clear()
        for _ in range(2000):
            llm.generate(prompts, params, use_tqdm=False)
            if llm.stats()["threads_now"] == 2:
                break
        assert llm.stats()["threads_now"] == 2 and llm.stats()["reduced_threads_s"] > 0, llm.stats()
