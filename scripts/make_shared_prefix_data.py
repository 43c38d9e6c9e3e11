"""Write a chat dataset whose rows share one few-shot system prompt (for jobs/shared_prefix.yaml).

python scripts/make_shared_prefix_data.py data/few_shot.parquet [--rows 256]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYSTEM = (
    "You answer arithmetic questions with one number.\n"
    "Q: what is 2 + 3? A: 5\nQ: what is 7 - 4? A: 3\nQ: what is 6 x 7? A: 42\n"
    "Q: what is 9 + 10? A: 19\nQ: what is 12 / 4? A: 3\nQ: what is 8 x 8? A: 64\n"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for i in range(args.rows):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice(["+", "-", "x"])
        rows.append(
            {
                "id": i,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Q: what is {a} {op} {b}?"},
                ],
            }
        )
    Path(args.path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.path)
    print(f"wrote {len(rows)} rows to {args.path}")


if __name__ == "__main__":
    main()
