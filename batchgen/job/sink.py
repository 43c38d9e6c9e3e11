"""Output shards, each written whole (on disk: temp file, fsync, rename; on object storage: one PUT),
so that a shard in the output is always complete. The shards are the record of what is done: a restarted job reads their row ids and skips
those rows, so nothing is lost or written twice whatever the moment the previous run died."""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.job.store import CommitGate, OutputStore

# Per-token log-probabilities of a completion, a scored continuation or a prompt, position by
# position: the token, its log-probability and rank (1 = the most likely), and its top k
# alternatives best first. int32 and float32 lists, not text: 12 + 8k bytes per token before compression.
LOGPROBS_TYPE = pa.struct(
    [
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("ranks", pa.list_(pa.int32())),
        ("top_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("top_logprobs", pa.list_(pa.list_(pa.float32()))),
    ]
)


def completion_type(logprobs: bool = False, reasoning: bool = False) -> pa.DataType:
    """One completion: with ``reasoning`` (a reasoning parser) and ``logprobs`` when the job asks."""
    fields = [
        ("index", pa.int64()),
        ("text", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("cumulative_logprob", pa.float64()),
        ("score", pa.float64()),
        ("finish_reason", pa.string()),
    ]
    if reasoning:
        fields.insert(1, ("reasoning", pa.string()))
    if logprobs:
        fields.append(("logprobs", LOGPROBS_TYPE))
    return pa.struct(fields)


def score_type(logprobs: bool = False) -> pa.DataType:
    """One scored continuation (``task: score``): its total log-probability and token count."""
    fields = [
        ("index", pa.int64()),
        ("text", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("logprob", pa.float64()),
        ("num_tokens", pa.int64()),
    ]
    if logprobs:
        fields.append(("logprobs", LOGPROBS_TYPE))
    return pa.struct(fields)


def generation_fields(logprobs: bool = False, prompt_logprobs: bool = False, reasoning: bool = False) -> list[pa.Field]:
    """The output columns of a generation job."""
    return [
        pa.field("completions", pa.list_(completion_type(logprobs, reasoning))),
        pa.field("num_prompt_tokens", pa.int64()),
        pa.field("num_generated_tokens", pa.int64()),
        *([pa.field("prompt_logprobs", LOGPROBS_TYPE)] if prompt_logprobs else []),
        pa.field("error", pa.string()),
    ]


def score_fields(logprobs: bool = False) -> list[pa.Field]:
    """The output columns of a scoring job (``task: score``)."""
    return [
        pa.field("scores", pa.list_(score_type(logprobs))),
        pa.field("num_prompt_tokens", pa.int64()),
        pa.field("num_scored_tokens", pa.int64()),
        pa.field("error", pa.string()),
    ]


OUTPUT_FIELDS = generation_fields()


# Characters that JSON leaves unescaped but some line readers (Python's str.splitlines, JavaScript)
# take for line ends: escaped, so that every reader sees one record per line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _json_line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, default=str).translate(_LINE_BREAKS) + "\n"


class ShardSink:
    """Writes ``PREFIX-NNNNNN.parquet`` (or ``.jsonl`` for the OpenAI response format) shards into an
    output store (``batchgen/job/store/``: a local directory or an S3 prefix).

    ``prefix`` is ``part`` for a whole job and ``part-IIIII-of-NNNNN`` for a worker of a sharded
    one, so that the workers of one job never pick the same name. Each sink reads and writes only
    its own shards. Temp files a crash or a full disk left behind are removed at start.
    """

    def __init__(
        self,
        store: OutputStore,
        fmt: str,
        id_key: str,
        prefix: str = "part",
        clean: bool = True,
        gate: CommitGate | None = None,
        output_fields: list[pa.Field] | None = None,
    ) -> None:
        self.store = store
        self.output_fields = output_fields
        self.gate = gate
        self.fmt = fmt
        self.id_key = id_key
        self.prefix = prefix
        self._name = re.compile(rf"^{re.escape(prefix)}-(\d+)\.(parquet|jsonl)$")
        if clean:  # not by a Ray replica: another one may be writing
            self.store.clean_temp(f"{prefix}-")
        self.next_index = max((int(m.group(1)) for m in map(self._name.match, self.store.files()) if m), default=-1) + 1
        self.schema: pa.Schema | None = None
        self._counts: dict[str, tuple[int, int]] | None = None  # shard -> (rows, failed rows)

    def shards(self) -> list[str]:
        return [n for n in self.store.files() if self._name.match(n)]

    def shard_rows(self) -> dict[str, int]:
        """Every shard in the output and its row count (read once, then kept up to date by ``write``)."""
        return {name: rows for name, (rows, _) in self._shard_counts().items()}

    def _shard_counts(self) -> dict[str, tuple[int, int]]:
        if self._counts is None:
            self._counts = {name: shard_counts(self.store, name) for name in self.shards()}
        return self._counts

    def done_ids(self) -> set[str]:
        """Ids of the rows in the shards: ``str(id)``, or ``#POSITION`` for a row without an id."""
        done: set[str] = set()
        for shard in self.shards():
            done.update(shard_ids(self.store, shard, self.id_key))
        return done

    def totals(self) -> tuple[int, int]:
        """(rows, failed rows) over every shard in the output."""
        counts = self._shard_counts().values()
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def write(self, rows: list[dict[str, Any]], input_schema: pa.Schema | None, index: int | None = None) -> str:
        """Write one shard whole; on failure nothing of it stays (``OutputWriteError`` or the
        store's error). ``index`` names it (a Ray unit of work, so that a retry overwrites); by
        default the next. Returns the shard's name."""
        number = self.next_index if index is None else index
        name = f"{self.prefix}-{number:06d}.{'parquet' if self.fmt == 'parquet' else 'jsonl'}"
        if self.fmt == "parquet":
            buf = pa.BufferOutputStream()
            pq.write_table(self._table(rows, input_schema), buf)
            data = buf.getvalue().to_pybytes()
        else:
            data = "".join(_json_line(r) for r in rows).encode("utf-8", "replace")
        self.store.write(name, data, self.gate)
        self.next_index = max(self.next_index, number + 1)
        if self._counts is not None:
            self._counts[name] = (len(rows), sum(r.get("error") is not None for r in rows))
        return name

    def _table(self, rows: list[dict[str, Any]], input_schema: pa.Schema | None) -> pa.Table:
        if self.schema is None:
            self.schema = output_schema(input_schema, rows, (self.id_key, "row_index"), self.output_fields)
        return rows_table(rows, self.schema)

    def rescan(self) -> None:
        """Read the shards again: other processes (Ray replicas) may have written some."""
        known = self._counts or {}
        self._counts = {name: known.get(name) or shard_counts(self.store, name) for name in self.shards()}

    def note(self, name: str, rows: int, failed: int | None = None) -> None:
        """Record a shard that another process wrote into this output (a Ray replica)."""
        counts = self._shard_counts()
        counts[name] = (rows, failed) if failed is not None else shard_counts(self.store, name)


def shard_counts(store: OutputStore, name: str) -> tuple[int, int]:
    """(rows, failed rows) of one shard: its row count and non-null ``error`` values."""
    if name.endswith(".parquet"):
        err = pq.read_table(store.open_input(name), columns=["error"]).column(0)
        return len(err), len(err) - err.null_count
    rows = failed = 0
    for line in (store.read(name) or b"").splitlines():
        if line.strip():
            rows += 1
            failed += json.loads(line).get("error") is not None
    return rows, failed


_OUTPUT_NAMES = {o.name for o in generation_fields(True, True, True) + score_fields(True)}

# The error of a row whose id an earlier row of the input has: such a row is known by its position.
DUPLICATE_ID = "duplicate id"


def duplicate_id_error(key: str, rid: str, first_position: int) -> str:
    return f"{key}: {DUPLICATE_ID} {rid!r}: row {first_position} has it too; ids must be unique, they key resume"


def as_text(value: Any) -> str:
    """A value as a text column stores it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def row_identity(value: Any, position: int, error: str | None = None) -> str:
    """How a job knows a row, in the input and in its shards: its id as text (``as_text``, with one
    more leading ``#`` when it starts with ``#``), or ``#POSITION`` for a row without an id or with
    an id an earlier row has (``error`` then says so). The two forms never collide, and an id reads
    back from a shard as the same text, whether its column kept the id's type or holds text."""
    if value is None or (error is not None and f": {DUPLICATE_ID} " in error):
        return f"#{position}"
    text = as_text(value)
    return "#" + text if text.startswith("#") else text


def shard_ids(store: OutputStore, name: str, id_key: str) -> list[str]:
    """The identities (``row_identity``) of the rows in one shard, in order."""
    if name.endswith(".parquet"):
        pf = pq.ParquetFile(store.open_input(name))
        names = pf.schema_arrow.names
        cols = [id_key] + (["row_index"] if "row_index" in names and id_key != "row_index" else [])
        table = pf.read(columns=[*cols, "error"])
        ids = table.column(0).to_pylist()
        positions = table.column(1).to_pylist() if len(cols) > 1 else ids
        errors = table.column("error").to_pylist()
        return [row_identity(v, pos, err) for v, pos, err in zip(ids, positions, errors, strict=True)]
    out = []
    for line in (store.read(name) or b"").splitlines():
        if line.strip():
            row = json.loads(line)
            error = (row.get("error") or {}).get("message")
            out.append(row_identity(row["custom_id"], row.get("row_index", -1), error))
    return out


def output_schema(
    input_schema: pa.Schema | None,
    rows: list[dict[str, Any]],
    id_columns: tuple[str, ...] = (),
    output_fields: list[pa.Field] | None = None,
) -> pa.Schema:
    """The input's columns (or, without an input schema, those of ``rows``), the id columns as
    int64 where the input lacks them, then the output columns (``output_fields``; a plain
    generation job's by default)."""
    if input_schema is not None:
        fields = [f for f in input_schema if f.name not in _OUTPUT_NAMES]
    else:
        inputs = [{k: v for k, v in r.items() if k not in _OUTPUT_NAMES} for r in rows]
        try:
            fields = list(pa.Table.from_pylist(inputs).schema)
        except Exception:  # noqa: BLE001 - values pyarrow cannot type together: text
            fields = [pa.field(k, pa.string()) for k in dict.fromkeys(k for r in inputs for k in r)]
        fields = [pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in fields]
    # every row names its input position, as int64 whatever an input column of that name held
    fields = [f for f in fields if f.name != "row_index"]
    for key in dict.fromkeys(id_columns):
        if key not in [f.name for f in fields]:
            fields.append(pa.field(key, pa.int64()))
    return pa.schema(fields + (OUTPUT_FIELDS if output_fields is None else output_fields))


def rows_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """``rows`` as a table of ``schema``. A row whose input values do not fit keeps what fits; a
    column whose values disagree in type holds them as JSON text; the rest becomes null. Whatever
    the input values, this returns a table: a row's content never fails its shard."""
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except Exception:  # noqa: BLE001 - any value pyarrow refuses (types, overflow, nesting): row by row
        fixed = []
        for r in rows:
            try:
                pa.Table.from_pylist([r], schema=schema)
                fixed.append(r)
            except Exception:  # noqa: BLE001
                fixed.append(_fitted(r, schema))
        return pa.Table.from_pylist(fixed, schema=schema)


def _fitted(row: dict[str, Any], schema: pa.Schema) -> dict[str, Any]:
    clean = dict(row)
    for f in schema:
        value = clean.get(f.name)
        if pa.types.is_string(f.type) and value is not None and not isinstance(value, str):
            clean[f.name] = value = as_text(value)
        try:
            pa.array([value], type=f.type)
        except Exception:  # noqa: BLE001
            clean[f.name] = None
    return clean
