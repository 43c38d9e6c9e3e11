"""Where a job's data lives: local paths, or URIs of object stores.

* ``s3://BUCKET/KEY`` goes through pyarrow's native S3 filesystem for reading and boto3 for writing
  (one PUT per object, conditional writes for the output's lease), any S3-compatible endpoint.
* Other schemes (``gs://``, ``az://`` / ``abfs://``, ``hf://datasets/...``, ...) are read through
  fsspec, where the scheme's package (gcsfs, adlfs, huggingface_hub) is installed.

The options come from the job's ``storage:`` section, else from the standard environment and config
files (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``). A process runs one job, so the job config
sets them once for the process (``use``); every reader and writer of the job then sees the same.
Secrets never leave this module: a URI is printed through ``redact``.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from dataclasses import dataclass
from typing import Any

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:secret|key|token|password|signature|credential|sig)[^=&#]*=)[^&#]*", re.IGNORECASE)
OUTPUT_SCHEMES = ("s3",)


class StorageError(RuntimeError):
    """Object storage refused or could not be reached; the message names the bucket or key."""


@dataclass(frozen=True)
class StorageOptions:
    """The ``storage:`` section of a job config. Every key is optional; credentials stay in the
    environment, a profile or the instance's role, never in the config."""

    endpoint_url: str | None = None  # an S3-compatible server (MinIO, SeaweedFS, R2, ...)
    region: str | None = None
    profile: str | None = None  # a profile of ~/.aws/config
    anonymous: bool = False  # public buckets: unsigned requests
    max_attempts: int = 10  # per request, with exponential backoff (connection errors, 5xx, throttling)
    lease_seconds: float = 60.0  # an object output's lease lives this long without a renewal
    fsspec: dict[str, Any] | None = None  # options passed to fsspec for the other schemes

    def check(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("storage.max_attempts: must be >= 1")
        if not self.lease_seconds >= 3:
            raise ValueError("storage.lease_seconds: must be >= 3")
        if self.endpoint_url is not None and not _SCHEME.match(self.endpoint_url):
            raise ValueError(f"storage.endpoint_url: must be a URL (http://HOST:PORT), got {redact(self.endpoint_url)!r}")


_options = StorageOptions()


def use(options: StorageOptions) -> None:
    """Set the storage options of this process's job."""
    global _options
    _options = options
    _s3_filesystem.cache_clear()
    s3_client.cache_clear()


def options() -> StorageOptions:
    return _options


def scheme(path: str) -> str | None:
    """``s3`` for ``s3://b/k``; None for a local path (``file://`` counts as local)."""
    m = _SCHEME.match(path)
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_uri(path: str) -> bool:
    return scheme(path) is not None


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def redact(text: str) -> str:
    """``text`` with the credentials a URI may carry (``s3://KEY:SECRET@bucket``, ``?sig=...``) masked."""
    text = _USERINFO.sub(r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``. Credentials in the URI are refused (printed
    redacted): they would end up in logs, manifests and shell histories."""
    if _USERINFO.match(uri):
        raise StorageError(
            f"{redact(uri)!r}: credentials in a URI are not read; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or a profile (storage.profile)"
        )
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{redact(uri)!r}: no bucket in the URI (s3://BUCKET/PREFIX)")
    return bucket, key


def endpoint_url() -> str | None:
    return _options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _region() -> str:
    if _options.region:
        return _options.region
    env = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if env:
        return env
    try:
        import boto3

        return boto3.session.Session(profile_name=_options.profile).region_name or "us-east-1"
    except Exception:  # noqa: BLE001 - no boto3, or a profile without a region
        return "us-east-1"


def _need_boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise StorageError("s3:// paths need boto3: pip install 'batchgen[s3]'") from None
    return boto3


@functools.cache
def s3_client() -> Any:
    """The boto3 client every object-store request of the job goes through (thread-safe)."""
    boto3 = _need_boto3()
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": _options.max_attempts, "mode": "standard"},
        signature_version=UNSIGNED if _options.anonymous else None,
        connect_timeout=10,
        read_timeout=60,
    )
    session = boto3.session.Session(profile_name=_options.profile)
    return session.client("s3", endpoint_url=endpoint_url(), region_name=_region(), config=config)


@functools.cache
def _s3_filesystem() -> Any:
    """pyarrow's S3 filesystem with the job's options: the reader of Parquet, Arrow and JSONL input."""
    import pyarrow.fs as pafs

    kwargs: dict[str, Any] = {"region": _region(), "anonymous": _options.anonymous}
    endpoint = endpoint_url()
    if endpoint:
        kwargs["endpoint_override"] = endpoint
        kwargs["scheme"] = endpoint.split("://", 1)[0]
    if not _options.anonymous:
        # found by boto3's chain (environment, profile, SSO, web identity, instance role) or one
        # line saying there are none; the reader then resolves them itself through the same chain,
        # so that temporary credentials are refreshed in a long job (a named profile is passed on)
        creds = _credentials()
        if _options.profile:
            kwargs.update(access_key=creds.access_key, secret_key=creds.secret_key, session_token=creds.token)
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=_options.max_attempts)
    return pafs.S3FileSystem(**kwargs)


def _credentials() -> Any:
    boto3 = _need_boto3()
    creds = boto3.session.Session(profile_name=_options.profile).get_credentials()
    if creds is None:
        raise StorageError(
            "no credentials for s3://: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile "
            "(storage.profile or AWS_PROFILE), or storage.anonymous: true for a public bucket"
        )
    return creds.get_frozen_credentials()


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, the path inside it) for a URI: S3 natively, other schemes through fsspec."""
    s = scheme(uri)
    if s == "s3":
        bucket, key = split_s3(uri)
        return _s3_filesystem(), f"{bucket}/{key}".rstrip("/")
    if s is None:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem(), local_path(uri)
    import fsspec
    import pyarrow.fs as pafs

    try:
        fs, path = fsspec.core.url_to_fs(uri, **(_options.fsspec or {}))
    except ImportError as e:
        raise StorageError(f"{s}:// paths need fsspec's {s} package: {e}") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def expand(uri: str) -> list[str]:
    """The files a URI names: itself, every file under it (a prefix), or a glob's matches, sorted."""
    import pyarrow.fs as pafs

    s = scheme(uri)
    fs, path = filesystem(uri)
    root = f"{s}://"  # + an object's path inside its filesystem ("bucket/key"): its URI
    glob_at = next((i for i, c in enumerate(path) if c in "*?["), None)
    try:
        if glob_at is not None:
            base = path[: path.rfind("/", 0, glob_at) + 1].rstrip("/")
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            pattern = path.replace("**/", "*").replace("/**", "*")
            return sorted(root + i.path.lstrip("/") for i in infos
                          if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, pattern))
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return [root + path.lstrip("/")]
        if info.type == pafs.FileType.Directory or s == "s3":
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
            return sorted(root + i.path.lstrip("/") for i in infos
                          if i.type == pafs.FileType.File and not _hidden(i.path, path))
    except OSError as e:
        raise StorageError(describe_error(e, uri)) from None
    return []


def _hidden(path: str, base: str) -> bool:
    rel = path[len(base) :].lstrip("/")
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def describe_error(error: BaseException, uri: str) -> str:
    """One line naming what went wrong with ``uri`` (redacted): credentials, the bucket, access."""
    text = str(error)
    where = redact(uri)
    code = ""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
    low = (code + " " + text).lower()
    if "nosuchbucket" in low or "bucket does not exist" in low or "bucket not found" in low:
        bucket = split_s3(uri)[0] if scheme(uri) == "s3" else where
        return f"{where}: bucket {bucket!r} does not exist"
    if "nocredentials" in low or "unable to locate credentials" in low or "no credentials" in low:
        return f"{where}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
    if any(k in low for k in ("signaturedoesnotmatch", "invalidaccesskeyid", "invalidaccesskey", "invalid access key")):
        return f"{where}: the credentials were refused (wrong access key or secret)"
    if "accessdenied" in low or "access denied" in low or "forbidden" in low or " 403" in low:
        return f"{where}: access denied"
    if "could not connect" in low or "connection refused" in low or "connect timeout" in low or "curl" in low:
        return f"{where}: cannot reach the object store ({redact(endpoint_url() or 'the default endpoint')}): {redact(text)[:200]}"
    return f"{where}: {redact(text)[:300]}"
