"""Input readers. Each yields record batches as lists of row dicts, streaming with bounded memory:
Parquet files / directories / globs (``pyarrow.dataset``), Arrow IPC / Feather, JSONL, datasets
saved with ``save_to_disk``, and OpenAI batch-request JSONL (``custom_id`` + ``body``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads


def _arrow_dataset(files: list[str], fmt: str) -> pads.Dataset:
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

    ds = load_from_disk(files[0])
    if hasattr(ds, "keys"):  # a DatasetDict: take its splits in order
        import datasets

        ds = datasets.concatenate_datasets([ds[k] for k in ds.keys()])
    return ds


def _jsonl_files(files: list[str]) -> list[Path]:
    out: list[Path] = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            out.extend(sorted(x for x in p.rglob("*") if x.suffix in (".jsonl", ".json", ".ndjson")))
        else:
            out.append(p)
    return out


def _iter_jsonl(files: list[str], batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for path in _jsonl_files(files):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError("not a JSON object")
                except ValueError as e:
                    row = {"__error__": f"{path.name} line {lineno}: invalid JSON ({e})"}
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
    if fmt == "jsonl":
        for batch in _iter_jsonl(files, 1):
            return list(batch[0].keys()) if "__error__" not in batch[0] else None
        return []
    return None


def count_rows(files: list[str], fmt: str) -> int | None:
    try:
        if fmt in ("parquet", "arrow"):
            return _arrow_dataset(files, fmt).count_rows()
        if fmt == "hf":
            return len(_hf_dataset(files))
        if fmt in ("jsonl", "openai"):
            total = 0
            for p in _jsonl_files(files):
                with open(p, "rb") as f:
                    total += sum(1 for line in f if line.strip())
            return total
    except Exception:  # noqa: BLE001 - only for the progress bar
        return None
    return None


def schema_of(files: list[str], fmt: str) -> pa.Schema | None:
    """The input's schema, which the output's input columns follow. For JSONL: the union of the
    keys of every line, in order of first appearance, each typed from its values (text where they
    disagree), so that no key is lost and every shard of a job has one schema."""
    if fmt in ("parquet", "arrow"):
        return _arrow_dataset(files, fmt).schema
    if fmt == "hf":
        return _hf_dataset(files).data.schema
    if fmt == "jsonl":
        return _jsonl_schema(files)
    return None


_SCHEMA_SAMPLES = 512  # values per key that decide its type


def _jsonl_schema(files: list[str]) -> pa.Schema:
    samples: dict[str, list[Any]] = {}
    for batch in _iter_jsonl(files, 4096):
        for row in batch:
            if "__error__" in row:
                continue
            for key, value in row.items():
                values = samples.setdefault(key, [])
                if value is not None and len(values) < _SCHEMA_SAMPLES:
                    values.append(value)
    fields = []
    for key, values in samples.items():
        try:
            typ = pa.array(values).type if values else pa.string()
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            typ = pa.string()
        fields.append(pa.field(key, pa.string() if pa.types.is_null(typ) else typ))
    return pa.schema(fields)


def iter_rows(files: list[str], fmt: str, batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Batches of input rows (dicts), in input order."""
    if fmt in ("parquet", "arrow"):
        for rb in _arrow_dataset(files, fmt).to_batches(batch_size=batch_rows):
            yield rb.to_pylist()
    elif fmt == "hf":
        ds = _hf_dataset(files)
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for rb in table.to_batches(max_chunksize=batch_rows):
            yield rb.to_pylist()
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
                        yield rb.to_pylist()
                offset += n
                if offset >= stop:
                    return
    elif fmt == "hf":
        ds = _hf_dataset(files)
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        for rb in table.slice(start, max(stop - start, 0)).to_batches(max_chunksize=batch_rows):
            yield rb.to_pylist()
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
            st = os.stat(path)
        except FileNotFoundError:
            raise InputChanged(f"input file {path} disappeared while the job was reading it") from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise InputChanged(
                f"input file {path} changed while the job was reading it (size {size} -> {st.st_size} "
                "bytes); the rows written so far are kept, rerun once the input is stable"
            )
