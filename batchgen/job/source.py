"""Input readers. Each yields record batches as lists of row dicts, streaming with bounded memory:
Parquet files / directories / globs (``pyarrow.dataset``), Arrow IPC / Feather, JSONL, datasets
saved with ``save_to_disk``, and OpenAI batch-request JSONL (``custom_id`` + ``body``)."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads

from batchgen import storage
from batchgen.job.config import InputConfig

# how an input's format shows: a marker file of a saved ``datasets`` dataset, or the files' suffixes
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_SUFFIX_FORMATS = ((".parquet",), (".arrow", ".feather", ".ipc"), (".jsonl", ".json", ".ndjson"))
_FORMAT_NAMES = ("parquet", "arrow", "jsonl")


def input_files(path: str) -> list[str]:
    """The input's files: a glob's matches, or the path (a directory is read whole). A URI lists
    its objects: the one it names, every object under a prefix, or a glob's matches."""
    if storage.is_uri(path):
        return storage.expand(path)
    path = storage.local_path(path)
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path, recursive=True))
    p = Path(path)
    if p.is_dir():
        return [str(p)]
    return [str(p)] if p.exists() else []


def detect_format(inp: InputConfig, files: list[str]) -> str:
    """The input's format: ``input.format`` unless ``auto``; else ``hf`` for a saved ``datasets``
    dataset (one of its marker files), else by the files' suffixes (Parquet first), a JSON Lines
    file being ``openai`` when its first line is a batch request. Local files and objects alike."""
    if inp.format != "auto":
        return inp.format
    first = files[0]
    if storage.is_uri(first):  # the objects listed, a dataset's markers among them
        names, requests = [f.rsplit("/", 1)[-1] for f in files], files
        if any(n in _HF_MARKERS for n in names):
            return "hf"
    elif Path(first).is_dir():  # a directory: its markers at the top, its files' suffixes below
        if any((Path(first) / m).exists() for m in _HF_MARKERS):
            return "hf"
        names = [p.name for p in Path(first).rglob("*") if p.is_file()]
        requests = []  # the JSON Lines of a directory are rows, never batch requests
    else:
        names, requests = [Path(first).name], [first]
    suffixes = {os.path.splitext(n)[1].lower() for n in names}
    for fmt, group in zip(_FORMAT_NAMES, _SUFFIX_FORMATS, strict=True):
        if suffixes & set(group):
            jsonl = next((r for r in requests if r.lower().endswith(group)), None)
            return _jsonl_kind(jsonl) if fmt == "jsonl" and jsonl is not None else fmt
    return "parquet"


def _jsonl_kind(path: str) -> str:
    """``openai`` when a JSON Lines file's first line is a batch request (``custom_id`` + ``body``)."""
    fs, inner = storage.filesystem(path)
    with fs.open_input_stream(inner) as f:
        head = f.read(1 << 20)
    first_line = head.split(b"\n", 1)[0].decode("utf-8", errors="replace")
    try:
        obj = json.loads(first_line) if first_line.strip() else {}
    except ValueError:
        obj = {}
    return "openai" if isinstance(obj, dict) and "custom_id" in obj and "body" in obj else "jsonl"


def _open(path: str) -> Any:
    """A binary file of a local path or a URI (object storage: streamed), iterated by lines."""
    if not storage.is_uri(path):
        return open(path, "rb")
    fs, inner = storage.filesystem(path)
    return _Lines(fs.open_input_stream(inner))


class _Lines:
    """The lines of a pyarrow input stream (which has no ``readline``), read 1 MiB at a time."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def __iter__(self) -> Iterator[bytes]:
        rest = b""
        while chunk := self.stream.read(1 << 20):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from (line + b"\n" for line in lines)
        if rest:
            yield rest


def _name(path: str | Path) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _arrow_dataset(files: list[str], fmt: str) -> pads.Dataset:
    if files and storage.is_uri(files[0]):  # object storage: ``files`` lists every file (storage.expand)
        suffixes = (".parquet",) if fmt == "parquet" else (".arrow", ".feather", ".ipc")
        chosen = [f for f in files if f.endswith(suffixes)] or files
        fs, _ = storage.filesystem(chosen[0])
        inner = [storage.filesystem(f)[1] for f in chosen]
        return pads.dataset(inner, format="parquet" if fmt == "parquet" else _ipc_format(chosen[0]), filesystem=fs)
    paths: list[str] = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            suffixes = (".parquet",) if fmt == "parquet" else (".arrow", ".feather", ".ipc")
            paths.extend(str(x) for x in sorted(p.rglob("*")) if x.suffix in suffixes)
        else:
            paths.append(f)
    if not paths:
        raise ValueError(f"no {fmt} files found in {files}")
    if fmt == "arrow":
        return pads.dataset(paths, format=_ipc_format(paths[0]))
    return pads.dataset(paths, format="parquet")


def _ipc_format(path: str) -> str:
    """Arrow IPC file (Feather v2) or stream format, by trying the file reader first."""
    import pyarrow.ipc as ipc

    try:
        if storage.is_uri(path):
            fs, inner = storage.filesystem(path)
            with fs.open_input_file(inner) as src:
                ipc.open_file(src)
        else:
            with pa.memory_map(path) as src:
                ipc.open_file(src)
        return "ipc"
    except pa.ArrowInvalid:
        raise ValueError(
            f"{path!r} is not an Arrow IPC file (Feather v2); write it with pyarrow.feather or "
            "pyarrow.ipc.new_file"
        ) from None


def _hf_dataset(files: list[str]):
    from datasets import load_from_disk

    if storage.is_uri(files[0]):
        raise ValueError(
            f"{storage.redact(files[0])}: a save_to_disk dataset is read from a local directory; in "
            "object storage, use its Parquet or Arrow files (input.format: parquet / arrow)"
        )

    ds = load_from_disk(files[0])
    if hasattr(ds, "keys"):  # a DatasetDict: take its splits in order
        import datasets

        ds = datasets.concatenate_datasets([ds[k] for k in ds.keys()])
    return ds


def _jsonl_files(files: list[str]) -> list[Path] | list[str]:
    if files and storage.is_uri(files[0]):
        return [f for f in files if f.endswith((".jsonl", ".json", ".ndjson"))] or files
    out: list[Path] = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            out.extend(sorted(x for x in p.rglob("*") if x.suffix in (".jsonl", ".json", ".ndjson")))
        else:
            out.append(p)
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(value: Any) -> Any:
    """``value`` with every string in it (keys included) made valid Unicode: a lone surrogate, which
    JSON's ``\\ud800`` escapes can carry but UTF-8 cannot, becomes U+FFFD."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_text(v) for v in value]
    return value


def _iter_jsonl(files: list[str], batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Rows of JSON Lines files. Bytes that are not UTF-8 and lone surrogate escapes become U+FFFD
    (the rest of the row is kept); a line that is not a JSON object becomes an error row."""
    batch: list[dict[str, Any]] = []
    for path in _jsonl_files(files):
        with _open(str(path)) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():  # the test count_rows makes, so that both count the same lines
                    continue
                line = raw.decode("utf-8", errors="replace")
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError("not a JSON object")
                    row = valid_text(row)
                except (ValueError, RecursionError) as e:
                    row = {"__error__": f"{_name(path)} line {lineno}: invalid JSON ({valid_text(str(e))[:200]})"}
                batch.append(row)
                if len(batch) >= batch_rows:
                    yield batch
                    batch = []
    if batch:
        yield batch


def column_names(files: list[str], fmt: str) -> list[str] | None:
    """Columns of the input, or None when the format has no fixed schema (JSONL: first row's keys)."""
    if fmt in ("parquet", "arrow"):
        return list(_arrow_dataset(files, fmt).schema.names)
    if fmt == "hf":
        return list(_hf_dataset(files).column_names)
    if fmt == "jsonl":  # the keys of every line: a column that only some lines have is a column
        keys: dict[str, None] = {}
        lines = 0
        for batch in _iter_jsonl(files, 4096):
            for row in batch:
                lines += 1
                if "__error__" not in row:
                    keys.update(dict.fromkeys(row))
        return list(keys) if keys or not lines else None
    return None


def check_readable(files: list[str], fmt: str) -> None:
    """Raise, naming the file, unless every file of a Parquet or Arrow input opens: a corrupt file
    is found with the config, before any work, not halfway through the job."""
    if fmt not in ("parquet", "arrow"):
        return
    for fragment in _arrow_dataset(files, fmt).get_fragments():
        try:
            fragment.count_rows()
        except Exception as e:  # noqa: BLE001 - re-raised with the file's name
            raise ValueError(f"{fragment.path}: {e}") from None


def count_rows(files: list[str], fmt: str) -> int | None:
    try:
        if fmt in ("parquet", "arrow"):
            return _arrow_dataset(files, fmt).count_rows()
        if fmt == "hf":
            return len(_hf_dataset(files))
        if fmt in ("jsonl", "openai"):
            total = 0
            for p in _jsonl_files(files):
                with _open(str(p)) as f:
                    total += sum(1 for line in f if line.strip())
            return total
    except Exception:  # noqa: BLE001 - only for the progress bar
        return None
    return None


def schema_of(files: list[str], fmt: str, id_column: str | None = None) -> pa.Schema | None:
    """The input's schema, which the output's input columns follow. For JSONL: the union of the
    keys of every line, in order of first appearance, each typed from its values (text where they
    disagree), so that no key is lost and every shard of a job has one schema; ``id_column`` keeps
    a native type only when every line's id has it (else text), so that every id is stored."""
    if fmt in ("parquet", "arrow"):
        return _arrow_dataset(files, fmt).schema
    if fmt == "hf":
        return _hf_dataset(files).data.schema
    if fmt == "jsonl":
        return _jsonl_schema(files, id_column)
    return None


_SCHEMA_SAMPLES = 512  # values per key that decide its type


def _kind(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return "int" if -(2**63) <= value < 2**63 else "bigint"
    return type(value).__name__


def _jsonl_schema(files: list[str], id_column: str | None = None) -> pa.Schema:
    samples: dict[str, list[Any]] = {}
    id_kinds: set[str] = set()
    for batch in _iter_jsonl(files, 4096):
        for row in batch:
            if "__error__" in row:
                continue
            for key, value in row.items():
                values = samples.setdefault(key, [])
                if value is not None and len(values) < _SCHEMA_SAMPLES:
                    values.append(value)
                if key == id_column and value is not None:
                    id_kinds.add(_kind(value))
    fields = []
    for key, values in samples.items():
        if key == id_column and not (len(id_kinds) == 1 and id_kinds <= {"int", "float", "str", "bool"}):
            fields.append(pa.field(key, pa.string()))
            continue
        try:
            typ = pa.array(values).type if values else pa.string()
            _check_storable(pa.table({"x": pa.array(values, typ)}))
        except Exception:  # noqa: BLE001 - values pyarrow cannot type together (mixed, nested, huge) or
            typ = pa.string()  # Parquet cannot store (a struct without fields) are text
        fields.append(pa.field(key, pa.string() if pa.types.is_null(typ) else typ))
    return pa.schema(fields)


def _check_storable(table: pa.Table) -> None:
    """Raise unless Parquet can store ``table``'s types (an empty struct, say, it cannot)."""
    import io

    import pyarrow.parquet as pq

    pq.write_table(table, io.BytesIO())


def _pylist(rb: pa.RecordBatch) -> list[dict[str, Any]]:
    """A record batch's rows as dicts. Text columns holding bytes that are not UTF-8 (a file written
    without validation) are read with U+FFFD for the bad bytes, as JSON Lines are; a cell that still
    cannot be read makes its row an error row naming the column."""
    try:
        return rb.to_pylist()
    except Exception:  # noqa: BLE001 - column by column, then cell by cell
        pass
    columns: dict[str, list[Any]] = {}
    bad: dict[int, str] = {}
    for name, col in zip(rb.schema.names, rb.columns, strict=True):
        try:
            columns[name] = col.to_pylist()
            continue
        except Exception:  # noqa: BLE001
            pass
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            raw = col.view(pa.binary() if pa.types.is_string(col.type) else pa.large_binary()).to_pylist()
            columns[name] = [None if v is None else v.decode("utf-8", errors="replace") for v in raw]
            continue
        values = []
        for i in range(len(col)):
            try:
                values.append(col[i].as_py())
            except Exception as e:  # noqa: BLE001
                values.append(None)
                bad.setdefault(i, f"{name} cannot be read: {valid_text(str(e))[:200]}")
        columns[name] = values
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    for i, error in bad.items():
        rows[i]["__error__"] = error
    return rows


def iter_rows(files: list[str], fmt: str, batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Batches of input rows (dicts), in input order."""
    if fmt in ("parquet", "arrow"):
        for rb in _arrow_dataset(files, fmt).to_batches(batch_size=batch_rows):
            yield _pylist(rb)
    elif fmt == "hf":
        ds = _hf_dataset(files)
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for rb in table.to_batches(max_chunksize=batch_rows):
            yield _pylist(rb)
    elif fmt in ("jsonl", "openai"):
        yield from _iter_jsonl(files, batch_rows)
    else:
        raise ValueError(f"unknown input format {fmt!r}")


def iter_range(files: list[str], fmt: str, start: int, stop: int, batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """The rows at input positions ``[start, stop)``, in batches: what one unit of work of a
    distributed job reads. Parquet reads only the row groups that overlap the range; Arrow files
    and ``save_to_disk`` datasets are sliced without a copy; JSONL is scanned up to ``start``."""
    if fmt in ("parquet", "arrow"):
        offset = 0
        for fragment in _arrow_dataset(files, fmt).get_fragments():
            pieces = fragment.split_by_row_group() if fmt == "parquet" else [fragment]
            for piece in pieces:
                # a row-group fragment's count_rows() counts its whole file; its metadata does not
                n = piece.row_groups[0].num_rows if fmt == "parquet" else piece.count_rows()
                lo, hi = max(start - offset, 0), min(stop - offset, n)
                if lo < hi:
                    for rb in piece.to_table().slice(lo, hi - lo).to_batches(max_chunksize=batch_rows):
                        yield _pylist(rb)
                offset += n
                if offset >= stop:
                    return
    elif fmt == "hf":
        ds = _hf_dataset(files)
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for rb in table.slice(start, max(stop - start, 0)).to_batches(max_chunksize=batch_rows):
            yield _pylist(rb)
    else:
        position = 0
        for batch in iter_rows(files, fmt, batch_rows):
            lo, hi = max(start - position, 0), min(stop - position, len(batch))
            if lo < hi:
                yield batch[lo:hi]
            position += len(batch)
            if position >= stop:
                return


class InputChanged(RuntimeError):
    """An input file changed (or vanished) while the job was reading it."""


def input_state(files: list[str]) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file the input spans (directories walked)."""
    if files and storage.is_uri(files[0]):
        return {f: _remote_state(f) for f in files}
    paths: list[Path] = []
    for f in files:
        p = Path(f)
        paths.extend(sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])
    out = {}
    for p in paths:
        st = p.stat()
        out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def check_unchanged(state: dict[str, tuple[int, int]]) -> None:
    """Raise ``InputChanged`` if any file of ``state`` differs from when it was taken: rows read
    from a file being rewritten or truncated would be wrong or missing in the output."""
    for path, (size, mtime) in state.items():
        try:
            now = _remote_state(path) if storage.is_uri(path) else _local_state(path)
        except FileNotFoundError:
            raise InputChanged(f"input file {storage.redact(path)} disappeared while the job was reading it") from None
        if now != (size, mtime):
            raise InputChanged(
                f"input file {storage.redact(path)} changed while the job was reading it (size {size} -> {now[0]} "
                "bytes); the rows written so far are kept, rerun once the input is stable"
            )


def _local_state(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _remote_state(uri: str) -> tuple[int, int]:
    """An object's size and modification time; ``FileNotFoundError`` when it is gone."""
    import pyarrow.fs as pafs

    fs, inner = storage.filesystem(uri)
    try:
        info = fs.get_file_info(inner)
    except OSError as e:
        raise storage.StorageError(f"reading {storage.describe_error(e, uri)}") from None
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(uri)
    return info.size or 0, info.mtime_ns or 0
