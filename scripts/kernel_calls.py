"""Each compiled CPU kernel against the library path it replaces, call by call, at the shapes of one
decode step of workloads S and B, through the engine's own functions (beam top-k: the kernel, and
the log-softmax and top-k its library branch runs), ``BATCHGEN_LIBRARY_KERNELS`` switching them as
in scripts/kernel_ablation.py:

    python scripts/kernel_calls.py [--model models/bench-56m] [--rows 128] [--beams 64] [--rounds 7]
                                   [--step-ms S_MS B_MS] [--dtype float32|bfloat16]

Whole workloads on a 2-core machine vary by 5-8% between runs, more than most single kernels weigh
in a step; call by call, a path's time varies far less than the two paths differ. Each round times
both paths of every kernel (median of 50 calls each, the paths alternating); the table gives the
medians over the rounds, the calls a decode step makes (this model's layers) and the time the
compiled kernel saves a step. The share of the step divides that by ``--step-ms`` for S and B (the
decode step's time, ``decode_s / steps`` of ``scripts/bench.py``'s stats; 0: not shown).

The calls repeat on warm caches with nothing between them, unlike a step's, and the counts miss in
both directions against whole runs (docs/kernels.md, "What each kernel earns"): the elementwise
kernels together count 1.3% of S's step here and measured 5-8% in whole runs, the sampler 13-20%
here and 6.6% there. Read the table as a ranking of the kernels, not as a workload's gain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batchgen.engine import sampler  # noqa: E402
from batchgen.engine.sampler import SampleRow  # noqa: E402
from batchgen.model import attention, layers  # noqa: E402
from batchgen.model.moe import swiglu  # noqa: E402
from batchgen.model.runner import ModelRunner  # noqa: E402
from batchgen.params import SamplingParams  # noqa: E402
from batchgen_kernels import cpu, cpu_beam  # noqa: E402


def on_library(name: str | None) -> None:
    """Send ``name`` (None: nothing) to its library path for the calls that follow."""
    os.environ["BATCHGEN_LIBRARY_KERNELS"] = name or ""
    cpu.library_kernels.cache_clear()
    sampler.fused_kernels.cache_clear()


def timed(fn, calls: int = 50) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cases(cfg, rows: int, beams: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, str, str, int, object]]:
    """(kernel, workload, shape, calls per decode step, the engine's call); activations and caches
    in ``dtype``, logits in float32 (the LM head widens them)."""
    hidden, layers_n, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or hidden // heads
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    x, res, w = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    q, k = randn(rows, heads, hd), randn(rows, kvh, hd)
    cos, sin = randn(rows, hd), randn(rows, hd)
    blocks, bs = 4096, 16
    k_cache, v_cache = torch.zeros(kvh, blocks, bs, hd, dtype=dtype), torch.zeros(kvh, blocks, bs, hd, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:rows]
    gate_up = randn(rows, 2 * cfg.intermediate_size)
    # the whole pool's copy-on-write: B copies about 17 blocks a step (its stats' cow_copies / steps)
    pool = torch.zeros(layers_n, 2, kvh, 1024, bs, hd, dtype=dtype)
    src, dst = list(range(17)), list(range(512, 529))
    logits = torch.randn(rows, hidden, generator=g) @ (torch.randn(vocab, hidden, generator=g) * 0.02).T
    params = SamplingParams(temperature=0.8, top_p=0.95)
    sample_rows = [SampleRow(params, seed=i, step=5, token_ids=[], num_prompt_tokens=0, blocked_ids=[]) for i in range(rows)]
    # J's masks, half the rows inside a JSON string (a few tokens forbidden), half at its structure
    # (a few allowed): the mask in the sampler's call, or (library) xgrammar's on a copy of the logits
    bits = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32)
    bits[::2, ::50] = 0x7FFFFFFF
    bits[1::2] = 0
    bits[1::2, :8] = 0x0F0F0F0F
    def xgrammar_apply(scores: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        # what StructuredOutputs.apply runs with token_mask on its library path
        xgrammar.apply_token_bitmask_inplace(scores, bitmask, vocab_size=vocab, indices=indices)

    mask = sampler.GrammarMask(bits, list(range(rows)), xgrammar_apply, vocab)
    beam_logits = logits[:beams].contiguous()
    beam_rows, running = torch.arange(beams), torch.randn(beams, generator=g)

    def beam_candidates():
        if "beam_topk" in cpu.library_kernels():  # the library branch of beam search's candidates
            scores = torch.log_softmax(beam_logits, dim=-1) + running[:, None]
            return scores.view(beams // 4, -1).topk(8, dim=-1)
        return cpu_beam.beam_topk(beam_logits, beam_rows, running, 4, 8)

    # the runner's copy_blocks on a pool of this model's shape
    runner = SimpleNamespace(kv_cache=pool, device=torch.device("cpu"), per_token_layout=False)
    copies = [SimpleNamespace(src=s, dst=d) for s, d in zip(src, dst, strict=True)]
    return [
        ("rms_norm", "S", f"add_rms_norm [{rows}, {hidden}]", 2 * layers_n, lambda: layers.add_rms_norm(x, res, w, 1e-6)),
        ("rotary", "S", f"queries [{rows}, {heads}, {hd}]", layers_n, lambda: layers.apply_rotary(q, cos, sin)),
        ("rotary", "S", f"keys [{rows}, {kvh}, {hd}]", layers_n, lambda: layers.apply_rotary(k, cos, sin)),
        ("silu_mul", "S", f"[{rows}, {2 * cfg.intermediate_size}]", 0, lambda: swiglu(gate_up, F.silu)),
        ("kv_write", "S", f"[{rows}, {kvh}, {hd}]", layers_n, lambda: attention.write_kv(k, k, k_cache, v_cache, slots)),
        ("block_ops", "B", f"{len(src)} blocks x {layers_n} layers", 1, lambda: ModelRunner.copy_blocks(runner, copies)),
        ("sampling", "S", f"[{rows}, {vocab}], T 0.8, top-p 0.95", 1, lambda: sampler.sample(logits, sample_rows)),
        ("token_mask", "S", f"[{rows}, {vocab}], sampling as S, J's masks", 1,
         lambda: sampler.sample(logits, sample_rows, grammar=mask)),
        ("beam_topk", "B", f"[{beams}, {vocab}], width 4", 1, beam_candidates),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--rows", type=int, default=128, help="S's decode rows (16 prompts x n=8)")
    ap.add_argument("--beams", type=int, default=64, help="B's beams (16 prompts x width 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--step-ms", type=float, nargs=2, default=[0.0, 0.0], metavar=("S", "B"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.beams % 4 or not 0 < args.beams <= args.rows:
        ap.error(f"--beams {args.beams}: a multiple of the beam width 4, at most --rows ({args.rows})")
    from transformers import AutoConfig  # noqa: PLC0415

    if not Path(args.model).is_dir():
        from batchgen.tiny import make_bench_model  # noqa: PLC0415

        make_bench_model(args.model)
    torch.set_num_threads(args.threads)
    cpu.load()
    todo = cases(AutoConfig.from_pretrained(args.model), args.rows, args.beams, getattr(torch, args.dtype))
    times: dict[int, dict[str, list[float]]] = {i: {"compiled": [], "library": []} for i in range(len(todo))}
    for r in range(args.rounds):
        for i, (name, *_, fn) in enumerate(todo):
            for side in (("compiled", "library") if r % 2 == 0 else ("library", "compiled")):
                on_library(name if side == "library" else None)
                times[i][side].append(timed(fn))
    on_library(None)
    step = dict(zip("SB", args.step_ms, strict=True))
    print(f"\nvariant {cpu.variant}, {args.dtype}, {args.threads} threads, medians of {args.rounds} rounds")
    print("| kernel | call (workload) | calls / step | compiled us | library us | saved ms / step | share of step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, (name, workload, shape, calls, _) in enumerate(todo):
        c, lib = statistics.median(times[i]["compiled"]), statistics.median(times[i]["library"])
        saved = (lib - c) * calls / 1000
        share = f"{saved / step[workload]:+.1%}" if step[workload] else ""
        print(f"| {name} | {shape} ({workload}) | {calls} | {c:.1f} | {lib:.1f} | {saved:+.2f} | {share} |")


if __name__ == "__main__":
    main()
