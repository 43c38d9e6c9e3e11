"""Workload J against J-FREE in one process: the same engine runs S's requests constrained to J's
JSON schema and unconstrained, alternating, ``--rounds`` times, and prints each side's median
tokens/s and their ratio (the goal: constrained at least 0.9x unconstrained).

    python scripts/bench_structured.py [--model models/bench-56m] [--rounds 6] [--dtype float32]

``scripts/bench.py J J-FREE --repeat N`` runs each side in a fresh process; on machines whose speed
drifts by tens of percent within minutes, sides a few seconds apart in one process compare more
steadily. Prefix caching is off, so no round reuses an earlier round's prompts. Both sides end at
the grammar's end or EOS, as in ``bench.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from bench import J_SCHEMA, make_workloads

from batchgen import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False, seed=0, num_threads=args.threads)
    (w,) = make_workloads(llm.engine.vocab_size, ["J"])

    def params(schema: dict | None) -> list[SamplingParams]:
        return [
            SamplingParams(n=w.n, temperature=w.temperature, top_p=w.top_p, max_tokens=m, ignore_eos=False, seed=i,
                           structured_outputs={"json": schema} if schema else None)
            for i, m in enumerate(w.max_tokens)
        ]

    sides = {"J": params(J_SCHEMA), "J-FREE": params(None)}
    llm.generate(w.prompts[:2], sides["J"][:2], use_tqdm=False)  # xgrammar, the schema's compile, the kernels
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, ps in sides.items():
            t0 = time.perf_counter()
            outs = llm.generate(w.prompts, ps, use_tqdm=False)
            rates[name].append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(f"{name:7s} {med[name]:8.1f} tok/s (median of {len(r)}: {', '.join(f'{x:.0f}' for x in r)})")
    pairs = np.array(rates["J"]) / np.array(rates["J-FREE"])
    print(f"J over J-FREE: {med['J'] / med['J-FREE']:.3f}x (medians); round by round "
          f"{', '.join(f'{p:.2f}' for p in pairs)}")
    print(f"grammar stats: {({k: v for k, v in llm.stats().items() if k.startswith('grammar_')})}")


if __name__ == "__main__":
    main()
