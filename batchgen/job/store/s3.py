"""An output prefix in an S3 bucket (``S3Store``).

A shard, manifest or report is there whole or not at all, and the shards are the record of what
is done, as in a local directory (``local.py``: temp file, fsync, rename, ``flock``). On object
storage there is no rename and no lock, so:

* every object is one PUT of its whole bytes (S3 stores an object whole or not at all);
* names are deterministic (``part-NNNNNN``, per worker ``part-IIIII-of-NNNNN-NNNNNN``, per Ray unit
  of work), so a retried write overwrites its own object and never adds a second one;
* one writer per output (per worker of a sharded job) holds a lease object
  (``.batchgen/lease[-IIIII-of-NNNNN]``), created with ``If-None-Match: *``, renewed with
  ``If-Match`` on its own ETag, taken over with ``If-Match`` on the expired one's ETag;
* a writer that cannot renew its lease in time stops writing before another may take over.

The protocol and the reason for each step: ``docs/reliability.md``, "Object storage".
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchgen import storage
from batchgen.job.store.base import BOOKKEEPING_DIR, CommitGate, OutputLocked, OutputUnavailable, ShardDropped
from batchgen.job.workers import shard_tag


class S3Store:
    """An output prefix in an S3 bucket (any S3-compatible endpoint), through boto3."""

    def __init__(self, uri: str) -> None:
        self.bucket, key = storage.split_s3(uri)
        self.prefix = key.strip("/")
        self.display = storage.redact(f"s3://{self.bucket}/{self.prefix}")
        self.lease: Lease | None = None  # set while this process holds the output's lease

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(name)}" if name else self.display

    def call(self, what: str, name: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(Bucket=..., **kwargs)`` on object ``name``: a missing object raises
        ``FileNotFoundError``, any other error of botocore one ``S3RequestError`` line naming the
        object (``what``: "reading", "writing the lease", ...) and carrying the error's code."""
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as e:  # noqa: BLE001 - botocore's errors, named with the object
            code = _code(e)
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(self.uri(name)) from None
            raise S3RequestError(f"{what} {storage.describe_error(e, self.uri(name))}", code) from None

    def files(self, folder: str = "") -> list[str]:
        base = self.key(folder).rstrip("/") + "/" if (self.prefix or folder) else ""
        out: list[str] = []
        client = storage.s3_client()
        token: dict[str, str] = {}
        while True:
            page = self.call("listing", folder, client.list_objects_v2, Prefix=base, Delimiter="/", **token)
            out.extend(o["Key"][len(base) :] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return sorted(out)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def read(self, name: str) -> bytes | None:
        try:
            body = self.call("reading", name, storage.s3_client().get_object, Key=self.key(name))
        except FileNotFoundError:
            return None
        return body["Body"].read()

    def write(self, name: str, data: bytes, gate: CommitGate | None = None) -> None:
        """One PUT of the whole object: S3 stores it whole or not at all."""
        with gate.commit(name) if gate is not None else contextlib.nullcontext():
            if self.lease is not None:
                self.lease.check()
            self.call("writing", name, storage.s3_client().put_object, Key=self.key(name), Body=data)

    def delete(self, name: str) -> None:
        self.call("deleting", name, storage.s3_client().delete_object, Key=self.key(name))

    def exists(self) -> bool:
        return bool(self.files()) or bool(self.files(BOOKKEEPING_DIR))

    def remove_folders(self) -> None:
        """Nothing to remove: the listing of an output has no folders but the bookkeeping's."""

    def check_writable(self) -> None:
        """Raise a ``StorageError`` naming the bucket unless it exists and these credentials may list it."""
        self.call("checking", "", storage.s3_client().list_objects_v2, Prefix=self.key(""), MaxKeys=1)

    def hold(self, shard: tuple[int, int] | None) -> Lease:
        return Lease(self, shard)

    def hold_for_workers(self) -> Lease:
        return Lease(self, None, check_only=True)

    def commit_gate(self) -> StopMarker:
        return StopMarker(self)

    def open_input(self, name: str) -> Any:
        """A random-access file (pyarrow's S3 reader): Parquet reads only the columns it needs."""
        fs, path = storage.filesystem(self.uri(name))
        try:
            return fs.open_input_file(path)
        except OSError as e:
            raise storage.StorageError(f"reading {storage.describe_error(e, self.uri(name))}") from None

    def clean_temp(self, prefix: str, folder: str = "") -> None:
        """Nothing to clean: an object store has no half-written objects (an unfinished multipart
        upload is not an object)."""


class S3RequestError(storage.StorageError):
    """A request to the object store failed; ``code`` is S3's error code (empty when none came)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


class LeaseLost(storage.StorageError):
    """This job's lease on its output expired or was taken over: it stops writing."""


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks after boot), which tells a reused pid from the original."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Lease:
    """The lease of one writer on an object-store output.

    ``acquire`` creates ``.batchgen/lease`` (``lease-IIIII-of-NNNNN`` for a worker of a sharded job)
    with ``If-None-Match: *``: of two jobs starting together exactly one succeeds. A lease already
    there is refused (``OutputLocked``, exit 2) while it lives, and taken over once it expired, or
    at once when its holder ran on this machine and is gone (a SIGKILLed run, rerun here): the
    takeover is a PUT with ``If-Match`` on the ETag read, so of two takers one wins. A thread renews
    the lease every third of ``storage.lease_seconds`` with ``If-Match`` on its own last ETag: a
    renewal that finds another ETag means the lease was taken over, and a writer whose last renewal
    is older than the lease's life (the store unreachable) stops before its next write
    (``LeaseLost``): by then another job may hold it.
    """

    def __init__(self, store: S3Store, shard: tuple[int, int] | None, check_only: bool = False) -> None:
        self.store = store
        self.shard = shard
        # the parent of a local job's replicas: it checks that no unsharded job holds the output and
        # holds nothing itself (its replicas hold the leases)
        self.check_only = check_only
        self.name = f"{BOOKKEEPING_DIR}/lease{shard_tag(shard)}"
        self.ttl = storage.options().lease_seconds
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self.renewed = 0.0  # monotonic time of the last successful write of the lease
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- the lease object ------------------------------------------------------------------------
    def _body(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "boot_id": _boot_id(),
                "pid": os.getpid(),
                "pid_start": _start_time(os.getpid()),
                "expires": time.time() + self.ttl,
                "lease_seconds": self.ttl,
            }
        ).encode()

    def _put(self, **condition: str) -> str | None:
        """PUT the lease under ``condition``; its new ETag, or None when the condition failed."""
        put = storage.s3_client().put_object
        try:
            r = self.store.call("writing the lease", self.name, put, Key=self.store.key(self.name), Body=self._body(), **condition)
        except S3RequestError as e:
            if e.code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return None
            if e.code in ("NotImplemented", "501"):
                raise storage.StorageError(
                    f"{self.store.display}: the object store does not support conditional writes "
                    f"({', '.join(condition)}), which keep two jobs off one output; batchgen needs them "
                    "(AWS S3, MinIO, SeaweedFS, Cloudflare R2 have them)"
                ) from None
            raise
        return str(r["ETag"])

    def _read(self, name: str | None = None) -> tuple[dict[str, Any], str] | None:
        name = name or self.name
        try:
            r = self.store.call("reading the lease", name, storage.s3_client().get_object, Key=self.store.key(name))
        except FileNotFoundError:
            return None
        try:
            held = json.loads(r["Body"].read())
        except ValueError:
            held = {}
        return held, str(r["ETag"])

    @staticmethod
    def _alive(held: dict[str, Any]) -> bool:
        """Whether the holder may still be writing: its lease unexpired, unless it ran on this
        machine (same boot) and its process is gone."""
        if held.get("host") == socket.gethostname() and held.get("boot_id") == _boot_id() and held.get("pid"):
            if _start_time(int(held["pid"])) != held.get("pid_start"):
                return False
        return float(held.get("expires", 0)) > time.time()

    @staticmethod
    def _holder(held: dict[str, Any]) -> str:
        left = max(0.0, float(held.get("expires", 0)) - time.time())
        return f"pid {held.get('pid')} on {held.get('host')}, lease expires in {left:.0f} s"

    # -- acquire / renew / release ---------------------------------------------------------------
    def acquire(self) -> None:
        try:
            self._acquire()
        except OutputLocked:
            raise
        except storage.StorageError as e:
            raise OutputUnavailable(str(e)) from None

    def _acquire(self) -> None:
        self._check_others()
        if self.check_only:
            return
        etag = self._put(IfNoneMatch="*")
        if etag is None:
            found = self._read()
            if found is not None:
                held, old = found
                if self._alive(held):
                    raise OutputLocked(
                        f"another batchgen job is writing to {self.store.display} ({self._holder(held)}; "
                        f"{self.store.uri(self.name)}); wait for it to finish, stop it, or choose another output.path"
                    )
                etag = self._put(IfMatch=old)
            else:  # released between the two requests
                etag = self._put(IfNoneMatch="*")
            if etag is None:
                raise OutputLocked(f"another batchgen job took the lease of {self.store.display} at the same moment")
        self.etag = etag
        self.renewed = time.monotonic()
        self.store.lease = self
        self._thread = threading.Thread(target=self._renew_loop, name="batchgen-lease", daemon=True)
        self._thread.start()

    def _check_others(self) -> None:
        """A job and the workers of a sharded job exclude each other: each looks for a live lease
        of the other kind first (the shard leases exclude workers of one index among themselves)."""
        for name in self.store.files(BOOKKEEPING_DIR):
            if not self._conflicts(name):
                continue
            found = self._read(f"{BOOKKEEPING_DIR}/{name}")
            if found is not None and self._alive(found[0]):
                what = "an unsharded batchgen job" if name == "lease" else f"a worker ({name[len('lease-'):]})"
                raise OutputLocked(
                    f"{what} is writing to {self.store.display} ({self._holder(found[0])}); wait for it "
                    "to finish, stop it, or choose another output.path"
                )

    def _conflicts(self, name: str) -> bool:
        if self.check_only or self.shard is not None:
            return name == "lease"
        return name.startswith("lease-")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except storage.StorageError:
                pass  # the store unreachable: retried next time; check() stops writes once too late
            if self.lost:
                return

    def renew(self) -> None:
        with self._lock:
            if self.lost or self.etag is None:
                return
            etag = self._put(IfMatch=self.etag)
            if etag is None:
                self.lost = f"the lease of {self.store.display} was taken over by another job"
                return
            self.etag = etag
            self.renewed = time.monotonic()

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this writer still holds the lease with time to spare."""
        if self.lost:
            raise LeaseLost(f"{self.lost}; this job stopped writing")
        age = time.monotonic() - self.renewed
        if age > self.ttl * 0.8:
            self.renew()
            if self.lost or time.monotonic() - self.renewed > self.ttl * 0.8:
                raise LeaseLost(
                    f"the lease of {self.store.display} could not be renewed for {age:.0f} s (the object "
                    "store unreachable?); this job stopped writing so that no other may write beside it"
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.store.lease = None
        if self.etag is None or self.lost:
            return
        with contextlib.suppress(storage.StorageError):
            found = self._read()
            if found is not None and found[0].get("owner") == self.owner:
                storage.s3_client().delete_object(Bucket=self.store.bucket, Key=self.store.key(self.name))
        self.etag = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StopMarker:
    """The commit gate of an object store (``CommitGate``): a Ray job's driver writes ``.batchgen/commits.stopped``
    when it stops, and a replica checks for it before each shard's PUT. The check and the PUT are
    two requests, so a shard may still land just after the driver's manifest: it is whole, named
    by its unit of work, and the next run lists it (the shards are the record, not the manifest)."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.name = f"{BOOKKEEPING_DIR}/commits.stopped"

    def open(self) -> None:
        self.store.delete(self.name)

    def stop(self) -> None:
        self.store.write(self.name, b"")

    @contextlib.contextmanager
    def commit(self, name: str | Path) -> Iterator[None]:
        if self.store.read(self.name) is not None:
            raise ShardDropped(f"{Path(name).name} finished after the job stopped; the rerun writes it again")
        yield
