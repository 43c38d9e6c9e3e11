"""Helpers for job tests: write a config, run ``python -m batchgen job`` in a process of its own,
read shards."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]


# Modules read at import time from these variables: a process forked from the server runs with the
# values the server started with, so a different value there needs an interpreter of its own.
_READ_AT_IMPORT = ("BATCHGEN_", "OMP_", "MKL_", "KMP_", "ATEN_", "ONEDNN_", "DNNL_", "TORCH_", "PYTHONHASHSEED",
                   "HF_")  # huggingface_hub's constants (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE)
# What a job imports, loaded once by the server its processes fork from.
_PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "pandas",
    "pyarrow.dataset",
    "batchgen.cli",
    "batchgen.job.runner",
    "tests.job.helpers",
]
_server_env: dict[str, str] | None = None


# ... except these, read when a job runs
_READ_AT_RUN = ("BATCHGEN_PROGRESS_LINES",)


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT) and k not in _READ_AT_RUN}


def _fork(target, args: tuple, env: dict[str, str]) -> multiprocessing.process.BaseProcess | None:
    """``target(*args)`` in a process forked from the server (started with this process's
    environment at the first call), or None where ``env`` differs from the server's in a variable
    read at import time."""
    global _server_env
    server_env = os.environ if _server_env is None else _server_env
    if _import_time_env(env) != _import_time_env(dict(server_env)):
        return None
    context = multiprocessing.get_context("forkserver")
    if _server_env is None:
        context.set_forkserver_preload(_PRELOAD)
        _server_env = dict(os.environ)
    # daemon: one a failed test left running is stopped (SIGTERM) when the tests end, not waited for
    process = context.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _run_cli(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The child's side of :class:`CliProcess`: what the interpreter does for ``python -m batchgen
    ARGS`` once it has started, from the module's ``__main__`` to the exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["-m", *args]
    try:
        runpy.run_module("batchgen", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # join the threads, as at interpreter exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CliProcess:
    """``python -m batchgen ARGS`` in a process of its own, with ``subprocess.Popen``'s interface as
    the tests use it (``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate``, ``pid``,
    ``returncode``; the output is text). The process is forked from a server that has already
    imported torch, transformers and batchgen, the seconds a fresh interpreter spends before the
    job starts; from ``batchgen/__main__.py`` on it is the CLI's own run, with its own working
    directory, environment, signals, exit status and output. Where this process's environment has
    changed since the server started in a variable read at import time, a fresh interpreter runs it."""

    def __init__(self, args: list[str], cwd: Path | str, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.args = [sys.executable, "-m", "batchgen", *args]
        self.returncode: int | None = None
        self._files = tempfile.TemporaryDirectory()
        self._out, self._err = (os.path.join(self._files.name, name) for name in ("out", "err"))
        forked = _fork(_run_cli, (list(args), str(cwd), env, self._out, self._err), env)
        self._popen: subprocess.Popen | None = None
        if forked is None:
            with open(self._out, "w") as out, open(self._err, "w") as err:
                self._popen = subprocess.Popen(self.args, stdout=out, stderr=err, env=env, cwd=cwd)
            self.pid = self._popen.pid
        else:
            self._forked = forked
            self.pid = forked.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            elif not self._forked.is_alive():
                self.returncode = self._forked.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._popen is not None:
            self.returncode = self._popen.wait(timeout)
        else:
            self._forked.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended since
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stdout_so_far(self) -> str:
        try:
            with open(self._out) as out:
                return out.read()
        except FileNotFoundError:  # the forked child has not opened it yet
            return ""

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        with open(self._out) as out, open(self._err) as err:
            return out.read(), err.read()


def start_job(config: Path, *extra: str, progress_lines: bool = False, env: dict[str, str] | None = None) -> CliProcess:
    """Start ``python -m batchgen job CONFIG --no-progress EXTRA`` from the config's directory.
    ``progress_lines``: the job prints its progress as lines on stdout (``rows_done`` reads them),
    as a replica of a local job does. ``env``: variables added to this process's (credentials)."""
    env = {**(env or {}), **({"BATCHGEN_PROGRESS_LINES": "1"} if progress_lines else {})}
    return CliProcess(["job", str(config), "--no-progress", *extra], config.parent, env)


def rows_done(proc: CliProcess) -> int:
    """Rows a job started with ``progress_lines`` has finished (written or not), by its last line."""
    lines = [x for x in proc.stdout_so_far().splitlines() if x.startswith("batchgen-progress ")]
    return int(lines[-1].split()[1]) if lines else 0


def run_job(config: Path, *extra: str, idle_timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m batchgen job CONFIG --no-progress EXTRA`` to the end. It is stopped (and the
    test fails) only after ``idle_timeout`` seconds without progress, i.e. with no change in the
    output directory: a slow or loaded machine makes a job slow, not a failure."""
    proc = start_job(config, *extra, env=env)
    _wait_while_progressing(proc, _output_dir(config), idle_timeout, env)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def finish_job(
    proc: CliProcess, out_dir: Path | str, idle_timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """Wait for a job started with pipes to end, for as long as it makes progress in ``out_dir`` (an
    s3:// prefix read with ``env``'s credentials); returns its (stdout, stderr)."""
    _wait_while_progressing(proc, out_dir, idle_timeout, env)
    return proc.communicate()


def _wait_while_progressing(
    proc: CliProcess, out_dir: Path | str | None, idle_timeout: float, env: dict[str, str] | None = None
) -> None:
    """Wait for ``proc`` to end; kill it (and raise TimeoutExpired) after ``idle_timeout`` seconds
    in which ``out_dir`` did not change."""
    last, seen = time.monotonic(), _progress(out_dir, env)
    while proc.poll() is None:
        time.sleep(0.1)
        now = _progress(out_dir, env)
        if now != seen:
            last, seen = time.monotonic(), now
        elif time.monotonic() - last > idle_timeout:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, idle_timeout)


def _output_dir(config: Path) -> Path | str | None:
    try:
        path = yaml.safe_load(config.read_text())["output"]["path"]
    except Exception:  # noqa: BLE001 - a test of a broken config
        return None
    if path.startswith("s3://"):
        return path
    return (config.parent / path) if not Path(path).is_absolute() else Path(path)


def _progress(out_dir: Path | str | None, env: dict[str, str] | None = None) -> tuple:
    """What changes while a job works: its output files (or objects) and their sizes."""
    if isinstance(out_dir, str):
        return _objects(out_dir, env or {})
    if out_dir is None or not out_dir.is_dir():
        return ()
    try:
        return tuple(sorted((p.name, p.stat().st_size) for p in out_dir.iterdir()))
    except OSError:
        return ()


def _objects(uri: str, env: dict[str, str]) -> tuple:
    """The objects under an s3:// prefix and their sizes, read with the job's credentials (``env``)."""
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    try:
        client = boto3.client(
            "s3", endpoint_url=env.get("AWS_ENDPOINT_URL"), region_name=env.get("AWS_REGION", "us-east-1"),
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"), aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        )
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    except Exception:  # noqa: BLE001 - the server down (a fault test), or no credentials
        return ()
    return tuple(sorted((o["Key"], o["Size"]) for o in page.get("Contents", [])))


def write_config(tmp: Path, model: str, input_spec: dict, generation: dict, name="job.yaml", **more) -> Path:
    cfg = {
        "model": model,
        "engine": {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 256},
        "input": input_spec,
        "generation": generation,
        "output": {"path": str(tmp / "out"), **more.pop("output", {})},
        **more,
    }
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_output(out: Path) -> list[dict]:
    rows = []
    for shard in sorted(out.glob("part-*.parquet")):
        rows.extend(pq.read_table(shard).to_pylist())
    return rows


def killed_after_first_shard_then_rerun(config: Path, out: Path) -> tuple[int, subprocess.CompletedProcess, int | None]:
    """Start the job, SIGKILL it once a shard is on disk (or let it end first), rerun it to the end:
    (rows on disk after the kill, the rerun's result, the killed run's exit status)."""
    proc = start_job(config)
    while proc.poll() is None and not list(out.glob("part-*")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(read_output(out))
    return partial, run_job(config), proc.returncode
