"""The output's size per generated token with ``generation.logprobs: k`` in a job.

Runs one real job per k (none, 0, 5, 20) on bench-56m: 64 prompts of 64..256 random tokens, 128
new tokens each (ignore EOS), temperature 1, and reports the Parquet shards' bytes per generated
token, the job's peak RSS (its own ``ru_maxrss``) and its wall time.

    python scripts/logprobs_size.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--ks", default="none,0,5,20")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        from batchgen.tiny import make_bench_model

        make_bench_model(args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rng = np.random.default_rng(5)
    # text of random tokens the tokenizer has (the bench models' tokenizer is smaller than their vocabulary)
    prompts = [tok.decode(rng.integers(3, len(tok), size=int(n)).tolist()) for n in rng.integers(64, 257, size=args.rows)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"id": list(range(args.rows)), "prompt": prompts}), data)
        for k in args.ks.split(","):
            gen = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True, "seed": 0}
            if k != "none":
                gen["logprobs"] = int(k)
            out = Path(tmp) / f"out-{k}"
            config = Path(tmp) / f"job-{k}.yaml"
            config.write_text(yaml.safe_dump({
                "model": str(Path(args.model).resolve()), "engine": {"dtype": "float32"},
                "input": {"path": str(data), "prompt_column": "prompt", "id_column": "id"},
                "generation": gen, "output": {"path": str(out)},
            }))
            proc = subprocess.Popen([sys.executable, "-m", "batchgen", "job", str(config), "--no-progress"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, status, usage = os.wait4(proc.pid, 0)  # this job's own peak RSS
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(proc.stderr.read().decode() if proc.stderr else "the job failed")
            rss = usage.ru_maxrss
            size = sum(p.stat().st_size for p in out.glob("part-*.parquet"))
            report = json.loads((out / ".batchgen" / "report.json").read_text())
            tokens = report["generated_tokens"]
            results[k] = {"bytes": size, "generated_tokens": tokens, "bytes_per_token": size / tokens,
                          "peak_rss_mib": rss / 1024, "wall_s": report["wall_s"]}
            print(f"logprobs {k:>4}: {size / tokens:7.1f} bytes per generated token "
                  f"({size / 2**20:.2f} MiB for {tokens} tokens), job peak RSS {rss / 1024:.0f} MiB, "
                  f"{report['wall_s']:.1f} s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
