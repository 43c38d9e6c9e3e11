"""Workload C (shared/WORKLOADS.md): scoring given continuations.

64 prompts of 128..512 random tokens, 8 continuations of 16..64 tokens each, on bench-56m in
float32. batchgen: ``LLM.score_continuations`` (the continuations of a prompt fork from it after
its prefill, so the prompt is computed once per row). transformers: one forward pass over prompt
+ continuation per pair, right-padded batches, the continuation's log-softmax summed; the best of
the batch sizes. Each side runs in a fresh process, alternating with ``--repeat``; the report is
scored continuation tokens per second (the tokens whose log-probability is returned) and the ratio.
The two sides' scores are compared (float32: within 1e-3 per continuation).

    python scripts/bench_score.py --repeat 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

VOCAB_LOW = 3


def workload(vocab: int, rows: int = 64, per_row: int = 8) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(VOCAB_LOW, vocab, size=int(n)).tolist() for n in rng.integers(128, 513, size=rows)]
    conts = [
        [rng.integers(VOCAB_LOW, vocab, size=int(n)).tolist() for n in rng.integers(16, 65, size=per_row)]
        for _ in range(rows)
    ]
    return prompts, conts


def run_batchgen(model_dir: str, threads: int) -> dict:
    from batchgen import LLM

    torch.set_num_threads(threads)
    prompts, conts = workload(32000)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_threads=threads, max_num_batched_tokens=2048)
    llm.score_continuations([prompts[0][:32]], [[conts[0][0]]], use_tqdm=False)  # warm-up
    llm.engine.reset_stats()
    t0 = time.perf_counter()
    outs = llm.score_continuations(prompts, conts, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    tokens = sum(c.num_tokens for o in outs for c in o.continuations)
    return {
        "wall_s": wall,
        "scored_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "scores": [[c.logprob for c in o.continuations] for o in outs],
        "prompt_tokens": sum(len(p) for p in prompts),
        "score_prompt_tokens_computed": stats["score_prompt_tokens_computed"],
        "score_continuation_tokens_computed": stats["score_continuation_tokens_computed"],
        "cow_copies": stats["cow_copies"],
    }


def run_hf(model_dir: str, threads: int, batch_sizes: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    prompts, conts = workload(32000)
    pairs = [(p, c) for p, cs in zip(prompts, conts, strict=True) for c in cs]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results, scores = {}, None
    for bs in batch_sizes:
        got = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for start in range(0, len(pairs), bs):
                batch = pairs[start : start + bs]
                width = max(len(p) + len(c) for p, c in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, (p, c) in enumerate(batch):
                    ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                    mask[i, : len(p) + len(c)] = 1
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                for i, (p, c) in enumerate(batch):  # the continuation's positions only through the head
                    rows = hidden[i, len(p) - 1 : len(p) - 1 + len(c)]
                    logp = torch.log_softmax(model.lm_head(rows).float(), dim=-1)
                    got.append(float(logp.gather(1, torch.tensor(c)[:, None]).sum()))
        wall = time.perf_counter() - t0
        tokens = sum(len(c) for _, c in pairs)
        results[bs] = {"wall_s": wall, "tokens_per_s": tokens / wall}
        scores = got
        print(f"    transformers batch {bs:>2}: {tokens / wall:8.1f} scored tok/s ({wall:.1f} s)", flush=True)
    best = max(results, key=lambda b: results[b]["tokens_per_s"])
    per_row = [scores[i : i + len(conts[0])] for i in range(0, len(scores), len(conts[0]))]
    return {"per_batch_size": results, "best_batch_size": best, **results[best], "scores": per_row}


def fresh(fn, *args):
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeat", type=int, default=1, help="alternate the sides this many times; medians reported")
    ap.add_argument("--json", default="bench-score.json")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        from batchgen.tiny import make_bench_model

        make_bench_model(args.model)
    ours, theirs = [], []
    for i in range(args.repeat):
        print(f"run {i + 1}/{args.repeat}", flush=True)
        theirs.append(fresh(run_hf, args.model, args.threads, args.batch_sizes))
        ours.append(fresh(run_batchgen, args.model, args.threads))
        print(f"    batchgen: {ours[-1]['tokens_per_s']:8.1f} scored tok/s ({ours[-1]['wall_s']:.1f} s)", flush=True)
    a = statistics.median(r["tokens_per_s"] for r in ours)
    b = statistics.median(r["tokens_per_s"] for r in theirs)
    worst = max(abs(x - y) for o, t in zip(ours[0]["scores"], theirs[0]["scores"], strict=True)
                for x, y in zip(o, t, strict=True))
    last = ours[-1]
    print(f"C scoring: batchgen {a:.1f} scored tok/s, transformers {b:.1f} (batch {theirs[-1]['best_batch_size']}): "
          f"{a / b:.2f}x; prompt tokens computed {last['score_prompt_tokens_computed']} of "
          f"{last['prompt_tokens']} (x{last['score_prompt_tokens_computed'] / last['prompt_tokens']:.2f}); "
          f"largest score difference {worst:.2e}")
    for r in ours + theirs:
        r.pop("scores")
    Path(args.json).write_text(json.dumps({"batchgen": ours, "transformers": theirs, "ratio": a / b,
                                           "max_abs_diff": worst}, indent=2))


if __name__ == "__main__":
    main()
