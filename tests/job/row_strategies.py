"""Hypothesis strategies for whole job inputs: a dataset in one of the formats a job reads (Parquet,
Arrow, JSONL, a ``datasets`` ``save_to_disk`` directory, OpenAI batch JSONL) whose rows hold random
types in the prompt, messages, id and params columns, with the job config that reads it. Shared by
``tests/job/test_row_path.py`` and ``tests/job/fuzz_jobs.py``.

``Dataset.write(folder)`` writes the files and returns the job config's ``input`` section and the
number of rows the job must produce (one per non-blank line, or per record).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st

FORMATS = ("parquet", "arrow", "jsonl", "hf", "openai")
PARAM_NAMES = ("temperature", "top_p", "top_k", "max_tokens", "n", "seed", "min_tokens", "stop",
               "logprobs", "beam_width", "presence_penalty", "ignore_eos", "tempreture", "")
ODD = [None, 0, 1, 2, -1, 7, 2**40, 2**70, 0.5, -0.5, 1e9, math.inf, math.nan, "", "abc", "1", [], [1, "x"], {},
       {"a": 1}, True, False]

# Text as scraped and synthetic datasets hold it: plain words (most prompts short enough to run),
# arbitrary Unicode (emoji, right-to-left marks, combining and control characters, NUL), long text.
words = st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=24)
unicode_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
special = st.sampled_from(["\x00", "\u200f", "\u202e", "e\u0301", "\U0001f600", "\ufeff", "\r\n", "\t", " ",
                           "\x1b[31m", "\u2028", "\U000e0041"])
mixed_text = st.lists(st.one_of(words, unicode_text, special), min_size=1, max_size=5).map("".join)
long_text = st.integers(200, 3000).map(lambda n: "w " * n)
text = st.one_of(*[words] * 8, mixed_text, mixed_text, long_text, st.just(""), st.just("   "))
# lone surrogates: JSON escapes can carry them (``\ud800``), UTF-8 files cannot
surrogate_text = st.tuples(words, st.sampled_from(["\ud800", "\udfff", "\udc80x"]), words).map("".join)

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=6)

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot", ""]), "content": text}
)
messages_value = st.one_of(*[st.lists(message, min_size=1, max_size=3)] * 4, st.just([]), json_value)
params_value = st.one_of(
    st.none(),
    st.none(),
    st.fixed_dictionaries({}, optional={"temperature": st.sampled_from([0, 0.7, 1.0]),
                                        "max_tokens": st.integers(1, 3), "seed": st.integers(0, 2**32)}),
    st.dictionaries(st.sampled_from(PARAM_NAMES), st.sampled_from(ODD), max_size=3),
    st.dictionaries(st.sampled_from(PARAM_NAMES), st.sampled_from(ODD), max_size=2).map(
        lambda d: json.dumps(d, allow_nan=True)
    ),
    st.sampled_from(["{not json", "[1, 2]", "5", ""]),
)
# mostly distinct ids, some repeated (a repeated id is an error row), some missing
id_pool = st.one_of(st.integers(0, 10**9), st.integers(0, 10**9), st.text(min_size=1, max_size=8),
                    st.integers(0, 3), st.sampled_from(["a", "#3", "#x", "", " ", "\u00e9", "1"]), st.none())


@dataclass
class Dataset:
    fmt: str
    rows: list[dict[str, Any]]
    # columnar formats: one Arrow type per column (None: a column of nulls as text)
    types: dict[str, pa.DataType] = field(default_factory=dict)
    use_messages: bool = False
    id_column: str | None = "id"
    params_column: str | None = "params"
    junk_lines: list[tuple[int, bytes]] = field(default_factory=list)  # JSONL: (row position, raw line)

    def write(self, folder: Path) -> tuple[dict[str, Any], int]:
        folder.mkdir(parents=True, exist_ok=True)
        inp: dict[str, Any] = {"format": self.fmt, "batch_rows": 7}
        if self.fmt != "openai":
            inp["messages_column" if self.use_messages else "prompt_column"] = (
                "messages" if self.use_messages else "prompt"
            )
            if self.id_column:
                inp["id_column"] = self.id_column
            if self.params_column:
                inp["params_column"] = self.params_column
        if self.fmt in ("jsonl", "openai"):
            path = folder / "in.jsonl"
            lines = [json.dumps(r, ensure_ascii=True, allow_nan=True).encode() for r in self.rows]
            for position, raw in sorted(self.junk_lines):
                lines.insert(min(position, len(lines)), raw)
            path.write_bytes(b"".join(line + b"\n" for line in lines))
            inp["path"] = str(path)
            return inp, sum(1 for line in lines if line.strip())
        table = pa.Table.from_pylist(self.rows, schema=pa.schema(list(self.types.items())))
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            path = folder / "in.parquet"
            pq.write_table(table, path)
        elif self.fmt == "arrow":
            import pyarrow.feather as feather

            path = folder / "in.arrow"
            feather.write_feather(table, path)
        else:
            import datasets

            path = folder / "in_hf"
            datasets.Dataset(table).save_to_disk(str(path))
        inp["path"] = str(path)
        return inp, len(self.rows)


COLUMN_TYPES = {
    # a typed prompt column holds text: another type is refused with the config, before any row
    "prompt": [pa.string()],
    "messages": [pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])), pa.string()],
    "id": [pa.string(), pa.int64(), pa.float64()],
    "params": [
        pa.struct([("temperature", pa.float64()), ("max_tokens", pa.int64()), ("n", pa.int64()),
                   ("seed", pa.int64()), ("tempreture", pa.float64())]),
        pa.string(),
    ],
}


def _columnar_value(draw, column: str, typ: pa.DataType) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return None
    if pa.types.is_string(typ):
        if column == "params":
            value = draw(params_value)
            return value if value is None or isinstance(value, str) else json.dumps(value, allow_nan=True)
        if column == "messages":  # chat messages stored as JSON text
            return json.dumps(draw(messages_value), allow_nan=True)
        if column == "id":
            value = draw(id_pool)
            return None if value is None else str(value)
        if column == "id":
            return draw(st.integers(0, 10**9))
        return draw(text)
    if pa.types.is_int64(typ):
        return draw(st.integers(-(2**63), 2**63 - 1)) if column != "id" else draw(st.integers(0, 10**9))
    if pa.types.is_float64(typ):
        return draw(st.one_of(st.floats(0, 1e6), st.sampled_from([0.0, 1.5, math.nan, math.inf, -0.0])))
    if pa.types.is_list(typ):
        if column == "messages":
            return draw(st.one_of(*[st.lists(message, min_size=1, max_size=3)] * 5, st.just([])))
        return draw(st.lists(text, max_size=3))
    if pa.types.is_struct(typ):
        if column == "params":
            return {f.name: draw(st.one_of(st.none(), st.sampled_from(
                [0, 1, 2, -1, 7, 2**40] if pa.types.is_int64(f.type) else [0.0, 0.5, 1.0, -1.0, 1e9, math.nan])))
                for f in typ}
        return {"text": draw(text)}
    raise AssertionError(typ)


@st.composite
def datasets(draw, formats: tuple[str, ...] = FORMATS, max_rows: int = 40) -> Dataset:
    fmt = draw(st.sampled_from(formats))
    n = draw(st.integers(1, max_rows))
    use_messages = draw(st.booleans()) and fmt != "openai"
    id_column = draw(st.sampled_from(["id", "id", None]))
    params_column = draw(st.sampled_from(["params", None]))
    if fmt == "openai":
        rows = []
        for _ in range(n):
            body: dict[str, Any] = {}
            kind = draw(st.integers(0, 9))
            if kind < 5:
                body["prompt"] = draw(text) if kind < 4 else draw(st.one_of(surrogate_text, json_scalar,
                                                                            st.lists(text, max_size=2)))
            else:
                body["messages"] = draw(messages_value)
            if not draw(st.integers(0, 3)):
                body.update(draw(st.dictionaries(st.sampled_from(PARAM_NAMES + ("max_completion_tokens",)),
                                                 st.sampled_from(ODD), max_size=2)))
            row = {"custom_id": draw(id_pool), "method": "POST", "url": "/v1/completions"}
            row["body"] = body if draw(st.integers(0, 9)) else draw(json_scalar)
            if row["custom_id"] is None and draw(st.booleans()):
                del row["custom_id"]
            rows.append(row)
        junk = draw(st.lists(st.tuples(st.integers(0, n), st.sampled_from(
            [b"{not json", b"[1, 2]", b"\xff\xfe bad bytes", b"   ", b'{"custom_id": "z", "body": 5}'])), max_size=2))
        return Dataset(fmt, rows, junk_lines=junk)
    if fmt == "jsonl":
        rows = []
        for _ in range(n):
            row: dict[str, Any] = {}
            key = "messages" if use_messages else "prompt"
            choice = draw(st.integers(0, 9))
            if choice < 6:
                row[key] = draw(messages_value if use_messages else text)
            elif choice < 8:
                row[key] = draw(surrogate_text if not use_messages else st.lists(
                    st.fixed_dictionaries({"role": st.just("user"), "content": surrogate_text}), min_size=1,
                    max_size=1))
            elif choice < 9:
                row[key] = draw(json_value)
            if id_column:
                value = draw(st.one_of(id_pool, id_pool, json_value, surrogate_text))
                if value is not None or draw(st.booleans()):
                    row[id_column] = value
            if params_column:
                row[params_column] = draw(params_value)
            row.update(draw(st.dictionaries(st.sampled_from(["extra", "row_index", "error", "x\ud800"]),
                                            json_value, max_size=2)))
            rows.append(row)
        # the job refuses a column that no line has (a misspelled config): the first line has them all
        for key in ("messages" if use_messages else "prompt", id_column, params_column):
            if key:
                rows[0].setdefault(key, None)
        junk = draw(st.lists(st.tuples(st.integers(0, n), st.sampled_from(
            [b"{not json", b"[1, 2]", b"\xff\xfe bad bytes", b'{"prompt": "ok \xc3\x28"}', b"   ",
             b"\xc2\xa0", b'"just a string"', b"[" * 5000])), max_size=3))
        return Dataset(fmt, rows, use_messages=use_messages, id_column=id_column, params_column=params_column,
                       junk_lines=junk)
    main = "messages" if use_messages else "prompt"
    types = {main: draw(st.sampled_from(COLUMN_TYPES[main]))}
    if id_column:
        types[id_column] = draw(st.sampled_from(COLUMN_TYPES["id"]))
    if params_column:
        types[params_column] = draw(st.sampled_from(COLUMN_TYPES["params"]))
    types["extra"] = pa.int64()
    rows = [{col: _columnar_value(draw, col, typ) for col, typ in types.items()} for _ in range(n)]
    return Dataset(fmt, rows, types=types, use_messages=use_messages, id_column=id_column,
                   params_column=params_column)
