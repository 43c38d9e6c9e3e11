"""Benchmarks of docs/benchmarks.md (CPU): batchgen against transformers ``generate`` on the same model
files, dtype and threads, in one run. Prints a table and writes JSON.

    python scripts/bench.py [S B P D M R J J-FREE A Q QX] [--model models/bench-56m] [--moe-model models/bench-moe]
                            [--deep-model models/bench-deep] [--dtype float32|bfloat16]
                            [--baseline-batch-sizes 4 8 16] [--skip-baseline] [--json bench-cpu.json]
                            [--engine-setting K=V] [--repeat N]

Workload R runs 32 prompts of 32-256 tokens, n=4 sampling, 64 new tokens on a deep narrow model
(``fixtures.models.make_bench_deep_model``: 30 layers, hidden 576, vocab 49152, tied embeddings).
``--dtype bfloat16`` runs both sides (and the GEMM floor) in bfloat16.

Workload M runs S's requests on a mixture-of-experts model (Qwen3-MoE layout, 16 experts, top-4,
``batchgen.tiny.make_bench_moe_model``) and reports the share of batchgen's time in expert GEMMs.

Workload J runs S's requests with every completion constrained to a 5-field JSON schema (structured
outputs, ending at the grammar's end); J-FREE the same requests unconstrained, also ending at EOS;
transformers runs J with the same xgrammar grammar as a logits processor. Both sides build xgrammar's
view of the tokenizer before the timing (batchgen on another grammar, so J's compile is timed).

Workload A runs S's requests with the rows spread round-robin over four rank-16 LoRA adapters on all
seven projections (``fixtures.models.make_adapter``, built beside the model), in one call: against
batchgen on the base model (the same rows, no adapters), against the four adapters one after
another (one call each, generation time only), and against transformers + peft with the rows of
one adapter batched together (needs ``peft``).

Workload Q runs R's requests on bench-deep quantized into each format (``fixtures.quant``:
GPTQ and AWQ int4, compressed-tensors int4, int8, W8A8 and FP8, groups of 64) against batchgen in
bfloat16 on the same model, in one run: tokens/s, peak RSS and the path each projection took
(``--quant-formats``: only some). Workload QX runs M's requests on a gpt-oss model of bench-moe's
size (16 experts of 384, top-4), its experts in bf16 and in MXFP4 (the hub's layout, kept quantized).

Useful generated tokens only: never padding, never tokens past a row's own limit. The ratio is
batchgen's generated tokens/s over the best baseline batch size's. ``--repeat N`` runs each side N
times, alternating, and takes each side's median run (the JSON keeps every run's tokens/s): the
machine's speed drifts by 10-20% within minutes, which one run of each side cannot tell apart from
a difference of the engines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

VOCAB_LOW = 3  # random prompts avoid the special ids 0..2
# Workload J's schema: a string, an integer, an enum, a boolean and an array of up to 3 strings
J_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "count": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "done": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "count", "color", "done", "tags"],
}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    kind: str  # "sample" | "beam" | "greedy"
    max_tokens: list[int]
    n: int = 1
    beam_width: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    notes: str = ""
    extra: dict = field(default_factory=dict)
    moe: bool = False  # runs on the mixture-of-experts bench model
    deep: bool = False  # runs on the deep narrow bench model (workload R)
    long: bool = False  # runs on bench-56m with a 32k context (workload L)
    z: bool = False  # runs on bench-z, Qwen2.5-0.5B's shape (workload Z)
    engine: dict = field(default_factory=dict)  # engine settings of this workload
    baseline_batch_sizes: list[int] | None = None  # instead of --baseline-batch-sizes
    schema: dict | None = None  # structured outputs: every completion follows this JSON schema (J)
    ignore_eos: bool = True  # False: a completion may end early, and only its own tokens count


def make_workloads(vocab: int, names: list[str], vocab_deep: int = 49152, vocab_z: int = 151936) -> list[Workload]:
    out = []
    rng = np.random.default_rng(0)

    def rand_prompt(n: int) -> list[int]:
        return rng.integers(VOCAB_LOW, vocab, size=n).tolist()

    def n_best(name: str, generator: np.random.Generator, notes: str, moe: bool = False) -> Workload:
        lens = generator.integers(64, 257, size=16)
        prompts = [generator.integers(VOCAB_LOW, vocab, size=n).tolist() for n in lens]
        return Workload(
            name, prompts, "sample", [64] * 16, n=8, temperature=0.8, top_p=0.95, notes=notes, moe=moe
        )

    def n4(name: str, seed: int, shortest: int, model_vocab: int, notes: str, **model: bool) -> Workload:
        """32 prompts of ``shortest``..256 tokens, n=4 sampling of exactly 64 new tokens."""
        generator = np.random.default_rng(seed)
        lens = generator.integers(shortest, 257, size=32)
        prompts = [generator.integers(VOCAB_LOW, model_vocab, size=int(n)).tolist() for n in lens]
        return Workload(name, prompts, "sample", [64] * 32, n=4, temperature=0.8, top_p=0.95, notes=notes, **model)

    if "S" in names:
        out.append(n_best("S", rng, "n-best sampling n=8"))
    if "A" in names:  # S's very prompts, round-robin over four LoRA adapters
        out.append(n_best("A", np.random.default_rng(0), "S's requests over 4 rank-16 LoRA adapters"))
    if "Z" in names:  # on bench-z (Qwen2.5-0.5B's shape)
        out.append(n4("Z", 6, 64, vocab_z, "Qwen2.5-0.5B's shape (bench-z), n=4 sampling", z=True))
    for name in [x for x in ("R", "Q") if x in names]:  # deep narrow model
        out.append(n4(name, 3, 32, vocab_deep, "deep narrow model (30 layers, hidden 576), n=4 sampling", deep=True))
    if "J" in names or "J-FREE" in names:  # S's very prompts, each completion a JSON object of 5 fields
        for name in ("J", "J-FREE"):
            if name in names:
                w = n_best(name, np.random.default_rng(0), "S's requests under a 5-field JSON schema")
                w.schema, w.ignore_eos = (J_SCHEMA if name == "J" else None), False
                w.notes = w.notes if name == "J" else "S's requests, unconstrained, ending at EOS as J's may"
                out.append(w)
    if "M" in names:  # S's very prompts (S draws first from a generator seeded 0)
        out.append(n_best("M", np.random.default_rng(0), "n-best sampling n=8 on the MoE model", moe=True))
    if "QX" in names:  # M's requests on a gpt-oss model, bf16 and MXFP4 experts
        out.append(n_best("QX", np.random.default_rng(0), "n-best sampling n=8, gpt-oss bf16 / MXFP4 experts", moe=True))
    if "L" in names:  # one 16,384-token prompt and three of 4,096, n=4 sampling, on a 32k context
        generator = np.random.default_rng(4)
        lens = [16384, 4096, 4096, 4096]
        out.append(
            Workload(
                "L",
                [generator.integers(VOCAB_LOW, vocab, size=n).tolist() for n in lens],
                "sample",
                [64] * 4,
                n=4,
                temperature=0.8,
                top_p=0.95,
                notes="long context: prompts of 16,384 and 3 x 4,096 tokens, n=4",
                long=True,
                baseline_batch_sizes=[1],
            )
        )
    if "B" in names:
        lens = rng.integers(64, 257, size=16)
        out.append(
            Workload(
                "B",
                [rand_prompt(n) for n in lens],
                "beam",
                [64] * 16,
                beam_width=4,
                notes="beam width 4, 4 returned",
            )
        )
    if "P" in names:
        prefix = rand_prompt(512)
        out.append(
            Workload(
                "P",
                [prefix + rand_prompt(32) for _ in range(64)],
                "greedy",
                [32] * 64,
                notes="shared 512-token prefix",
                extra={"shared_prefix": len(prefix)},
            )
        )
    if "P2" in names or "P2-INPUT" in names:
        # docs/benchmarks.md P2: 8 few-shot prefixes of 768 tokens, 512 rows (a prefix and 32 own
        # tokens), shuffled; a pool of two prefixes' blocks (2 x 48) plus a working set of 128
        prefixes = [rand_prompt(768) for _ in range(8)]
        prompts = [prefixes[i % 8] + rand_prompt(32) for i in range(512)]
        np.random.default_rng(2).shuffle(prompts)
        for name, order in (("P2-INPUT", "input"), ("P2", "prefix")):
            if name in names:
                out.append(
                    Workload(
                        name,
                        prompts,
                        "greedy",
                        [32] * 512,
                        notes=f"8 shuffled 768-token prefixes, {order} order, pool of 224 blocks",
                        extra={"shared_prefix": 768, "distinct_prefix_tokens": 8 * 768},
                        engine={"admission_order": order, "num_kv_blocks": 224, "block_size": 16},
                        baseline_batch_sizes=[16],
                    )
                )
    if "D" in names:
        lens = np.clip(np.round(rng.lognormal(np.log(128), 0.75, size=256)), 8, 1024).astype(int)
        maxt = np.clip(np.round(rng.lognormal(np.log(64), 0.75, size=256)), 8, 512).astype(int)
        out.append(
            Workload(
                "D",
                [rand_prompt(int(n)) for n in lens],
                "sample",
                maxt.tolist(),
                temperature=1.0,
                notes="dataset mix",
            )
        )
    return out


LORA_ADAPTERS = 4
LORA_RANK = 16


def lora_adapters(model_dir: str) -> list[str]:
    """Workload A's adapters beside the model (built once): rank 16 on all seven projections."""
    from fixtures.models import make_adapter

    paths = []
    for i in range(LORA_ADAPTERS):
        path = Path(f"{model_dir}-lora") / f"a{i}"
        if not (path / "adapter_config.json").exists():
            make_adapter(path, model_dir, rank=LORA_RANK, alpha=32, seed=100 + i, scale=0.02)
        paths.append(str(path))
    return paths


def _sampling(w: Workload, i: int, m: int):
    from batchgen import SamplingParams

    return SamplingParams(n=w.n, temperature=w.temperature, top_p=w.top_p, max_tokens=m, ignore_eos=True, seed=i)


def run_batchgen_lora(model_dir: str, w: Workload, threads: int, mode: str, dtype: str = "float32") -> dict:
    """Workload A on batchgen: ``mixed`` (every row on its adapter, one call), ``base`` (the same
    rows, no adapters, LoRA off), ``sequential`` (one call per adapter, generation time summed)."""
    from batchgen import LLM, LoRARequest, SamplingParams

    torch.set_num_threads(threads)
    paths = lora_adapters(model_dir)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    lora = {} if mode == "base" else {"enable_lora": True, "max_loras": len(reqs), "max_lora_rank": LORA_RANK}
    llm = LLM(model_dir, dtype=dtype, device="cpu", max_num_seqs=256, max_num_batched_tokens=2048,
              seed=0, num_threads=threads, **lora)
    params = [_sampling(w, i, m) for i, m in enumerate(w.max_tokens)]
    row_lora = [reqs[i % len(reqs)] for i in range(len(w.prompts))]
    warm = [None] if mode == "base" else reqs  # every adapter read before the timing
    llm.generate([w.prompts[0][:16]] * len(warm), SamplingParams(max_tokens=2), use_tqdm=False,
                 lora_request=None if mode == "base" else warm)
    llm.engine.reset_stats()
    if mode == "sequential":
        wall, gen = 0.0, 0
        for k, req in enumerate(reqs):
            rows = [i for i in range(len(w.prompts)) if i % len(reqs) == k]
            t0 = time.perf_counter()
            outs = llm.generate([w.prompts[i] for i in rows], [params[i] for i in rows], use_tqdm=False,
                                lora_request=req)
            wall += time.perf_counter() - t0
            gen += sum(len(c.token_ids) for o in outs for c in o.outputs)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False, lora_request=None if mode == "base" else row_lora)
        wall = time.perf_counter() - t0
        gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert gen == useful_tokens(w), (gen, useful_tokens(w))
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall, "stats": llm.stats()}


def run_hf_lora(model_dir: str, w: Workload, threads: int, dtype: str = "float32") -> dict:
    """Workload A on transformers + peft: each adapter's rows in one ``generate`` batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    paths = lora_adapters(model_dir)
    wall, gen = 0.0, 0
    for k, path in enumerate(paths):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        model = PeftModel.from_pretrained(base, path).eval()
        rows = [i for i in range(len(w.prompts)) if i % len(paths) == k]
        ids, mask = left_padded([w.prompts[i] for i in rows])
        top = max(w.max_tokens[i] for i in rows)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=top, min_new_tokens=top,
                           pad_token_id=0, do_sample=True, temperature=w.temperature, top_p=w.top_p, top_k=0,
                           num_return_sequences=w.n)
        wall += time.perf_counter() - t0
        gen += sum(w.max_tokens[i] * w.n for i in rows)
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall}


def bench_lora(model_dir: str, w: Workload, threads: int, repeat: int, skip_baseline: bool, dtype: str) -> dict:
    """Workload A: every side ``repeat`` times, alternating, each in a fresh process; medians."""
    lora_adapters(model_dir)
    sides = ["mixed", "base", "sequential"] + ([] if skip_baseline else ["transformers+peft"])
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(repeat):
        for side in sides:
            if side == "transformers+peft":
                r = in_fresh_process(run_hf_lora, model_dir, w, threads, dtype)
            else:
                r = in_fresh_process(run_batchgen_lora, model_dir, w, threads, side, dtype)
            runs[side].append(r)
            print(f"    {side:<18} {r['tokens_per_s']:8.1f} tok/s ({r['wall_s']:.1f} s)", flush=True)
    med = {side: median_run(rs) for side, rs in runs.items()}
    mixed = med["mixed"]["tokens_per_s"]
    print(f"\n| workload A ({LORA_ADAPTERS} adapters, rank {LORA_RANK}, all 7 projections) | tok/s | mixed over it |")
    print("| --- | --- | --- |")
    for side in sides:
        t = med[side]["tokens_per_s"]
        print(f"| batchgen {side} | {t:.1f} | {mixed / t:.2f}x |" if side != "transformers+peft"
              else f"| {side} (one batch per adapter) | {t:.1f} | {mixed / t:.2f}x |")
    st = med["mixed"]["stats"]
    print(f"    mixed: adapters read {st['lora_disk_loads']}, made resident {st['lora_activations']}, "
          f"evicted {st['lora_evictions']}")
    return {
        "workload": "A",
        "medians_tokens_per_s": {side: med[side]["tokens_per_s"] for side in sides},
        "runs_tokens_per_s": {side: [r["tokens_per_s"] for r in rs] for side, rs in runs.items()},
        "mixed_over_base": mixed / med["base"]["tokens_per_s"],
        "mixed_over_sequential": mixed / med["sequential"]["tokens_per_s"],
        "stats": st,
    }


QUANT_FORMATS = {
    "gptq-int4": ("gptq", {"bits": 4, "group": 64}),
    "awq-int4": ("awq", {"group": 64, "sym": False}),
    "ct-int4": ("ct-int4", {"group": 64}),
    "ct-int8": ("ct-int8", {"group": -1}),
    "ct-w8a8": ("ct-w8a8", {}),
    "ct-fp8": ("ct-fp8", {"per_channel": True}),
    "fp8-block": ("fp8", {"block": (128, 128)}),  # transformers' fine-grained FP8, the hub's DeepSeek / Qwen layout
}


def weight_bytes(llm) -> int:
    """Bytes of every CPU tensor alive but the KV pools: the model's weights (and packed copies)."""
    import gc
    import warnings

    runner = llm.engine.runner
    pools = {t.untyped_storage().data_ptr() for t in (runner.kv_cache, runner.host_cache) if t is not None}
    storages = {}
    with warnings.catch_warnings():  # isinstance on a deprecated alias among the objects warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                if st.data_ptr() not in pools:
                    storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def run_batchgen_plain(model_dir: str, w: Workload, threads: int, dtype: str) -> dict:
    """Workload Q's runs: ``run_batchgen`` plus the weights' bytes and the projections' paths."""
    r = run_batchgen(model_dir, w, threads, None, dtype, extra=lambda llm: {"weight_mib": weight_bytes(llm) / 2**20})
    return {**r, "paths": r["stats"]["quantized_paths"] or "dense"}


def bench_quant(model_dir: str, w: Workload, threads: int, dtype: str, formats: list[str] | None = None,
                repeat: int = 1) -> dict:
    """Workload Q: bf16 and each format, one run each per round (fresh processes, in the same
    order), ``repeat`` rounds; each side's median run."""
    from fixtures.quant import quantize_model

    sides = {"bf16": model_dir}
    for name, (fmt, opts) in QUANT_FORMATS.items():
        if formats and name not in formats:
            continue
        path = f"{model_dir}-{name}"
        if not (Path(path) / "config.json").exists():
            print(f"    quantizing into {path} ...", flush=True)
            quantize_model(model_dir, path, fmt, **opts)
        sides[name] = path
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, path in sides.items():
            r = in_fresh_process(run_batchgen_plain, path, w, threads, dtype)
            runs[name].append(r)
            print(f"    {name:<18} {r['tokens_per_s']:8.1f} tok/s, weights {r['weight_mib']:.0f} MiB, "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB ({r['paths']})", flush=True)
    rows = {name: sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2] for name, rs in runs.items()}
    base = rows["bf16"]
    print(f"\n| workload Q ({dtype} activations) | tok/s | over bf16 | weights MiB | over bf16 | peak RSS MiB | paths |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{r['weight_mib']:.0f} | {r['weight_mib'] / base['weight_mib']:.2f}x | {r['peak_rss_mib']:.0f} | {r['paths']} |")
    return {"workload": "Q", "repeat": repeat, "tokens_per_s": {k: [r["tokens_per_s"] for r in rs] for k, rs in runs.items()},
            "results": {k: {kk: v for kk, v in r.items() if kk != "stats"} for k, r in rows.items()}}


def bench_mxfp4(model_dir: str, w: Workload, threads: int, repeat: int) -> dict:
    """Workload QX: M's requests on a gpt-oss model of bench-moe's size, its experts in bf16 (packed
    for the compiled GEMM kernel) and kept MXFP4 (the kernel's MXFP4 path), alternating runs."""
    from batchgen.tiny import BENCH_SHAPE, make_model
    from fixtures.quant import quantize_gpt_oss_mxfp4

    quantized = f"{model_dir}-mxfp4"
    if not (Path(model_dir) / "config.json").exists():
        print(f"building the bench model in {model_dir} ...", flush=True)
        make_model(model_dir, "gpt_oss", seed=0, **{**BENCH_SHAPE, "intermediate_size": 384}, num_local_experts=16,
                   num_experts_per_tok=4, sliding_window=128)
    if not (Path(quantized) / "config.json").exists():
        quantize_gpt_oss_mxfp4(model_dir, quantized)
    runs: dict[str, list[dict]] = {"bf16": [], "mxfp4": []}
    for _ in range(repeat):
        for side, path in (("bf16", model_dir), ("mxfp4", quantized)):
            runs[side].append(in_fresh_process(run_batchgen_plain, path, w, threads, "bfloat16"))
            r = runs[side][-1]
            print(f"    {side:<6} {r['tokens_per_s']:8.1f} tok/s, weights {r['weight_mib']:.0f} MiB, "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB ({r['paths']})", flush=True)
    med = {side: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for side, rs in runs.items()}
    speed = med["mxfp4"]["tokens_per_s"] / med["bf16"]["tokens_per_s"]
    memory = med["mxfp4"]["weight_mib"] / med["bf16"]["weight_mib"]
    print(f"    MXFP4 over bf16: {speed:.2f}x tokens/s, {memory:.2f}x weight memory", flush=True)
    return {"workload": "QX", "mxfp4_over_bf16": speed, "weights_mxfp4_over_bf16": memory,
            "results": {side: {k: v for k, v in r.items() if k != "stats"} for side, r in med.items()}}


def useful_tokens(w: Workload) -> int:
    per = w.n if w.kind == "sample" else (w.beam_width if w.kind == "beam" else 1)
    return sum(m * per for m in w.max_tokens)


def in_fresh_process(fn, *args):
    """Run ``fn(*args)`` in a new interpreter: neither side inherits the other's allocator state,
    threads or caches (the engine tunes glibc's allocator for its own process)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def engine_settings(w: Workload, threads: int, settings: dict | None = None) -> dict:
    """``LLM(...)`` settings of batchgen's side (besides the model and dtype)."""
    return {
        "device": "cpu",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": True,
        "seed": 0,
        "num_threads": threads,
        **w.engine,
        **(settings or {}),
    }


def request_params(w: Workload) -> list:
    """Each prompt's ``SamplingParams`` / ``BeamSearchParams``, as batchgen's side runs them."""
    from batchgen import BeamSearchParams, SamplingParams

    if w.kind == "beam":
        return [BeamSearchParams(beam_width=w.beam_width, max_tokens=m, ignore_eos=True) for m in w.max_tokens]
    return [
        SamplingParams(
            n=w.n,
            temperature=0 if w.kind == "greedy" else w.temperature,
            top_p=w.top_p,
            max_tokens=m,
            ignore_eos=w.ignore_eos,
            seed=i,
            structured_outputs={"json": w.schema} if w.schema else None,
        )
        for i, m in enumerate(w.max_tokens)
    ]


def run_batchgen(
    model_dir: str, w: Workload, threads: int, settings: dict | None = None, dtype: str = "float32", extra=None,
    ready=None,
) -> dict:
    """``extra(llm)``: more figures of the run, taken after it. ``ready()``: called once the engine
    is warm, right before the timing (scripts/bench_contention.py starts replicas together)."""
    from batchgen import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model_dir, dtype=dtype, **engine_settings(w, threads, settings))
    params = request_params(w)
    # warm-up outside the timing; with a schema, also xgrammar's import and tokenizer view (as the
    # transformers side builds them untimed) on another grammar, so the schema's compile stays timed
    warm = {"choice": ["yes", "no"]} if w.schema else None
    llm.generate([w.prompts[0][:16]], SamplingParams(max_tokens=2, structured_outputs=warm), use_tqdm=False)
    before = {k: v for k, v in llm.stats().items() if k.startswith("grammar_")}
    llm.engine.reset_stats()
    if ready is not None:
        ready()
    t0 = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    t1 = time.perf_counter()
    wall = t1 - t0
    gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert gen == useful_tokens(w) or not w.ignore_eos, (gen, useful_tokens(w))
    stats = {k: v - before[k] if k in before else v for k, v in llm.stats().items()}  # this run's grammars
    prompt_tokens = sum(len(p) for p in w.prompts)
    return {
        "wall_s": wall,
        "start_end": (t0, t1),
        "generated_tokens": gen,
        "tokens_per_s": gen / wall,
        "prefill_tokens_per_s": prompt_tokens / stats["prefill_s"] if stats["prefill_s"] else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stats": stats,
        **(extra(llm) if extra is not None else {}),
    }


def left_padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left with 0 into one batch: (input ids, attention mask)."""
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def run_hf(model_dir: str, w: Workload, batch_sizes: list[int], threads: int, dtype: str = "float32") -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    grammar = None
    if w.schema:  # the same grammar (xgrammar, compiled for the model's vocabulary) as a logits processor
        import xgrammar as xgr
        from transformers import AutoTokenizer

        info = xgr.TokenizerInfo.from_huggingface(
            AutoTokenizer.from_pretrained(model_dir), vocab_size=model.config.vocab_size, stop_token_ids=[2]
        )
        grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(w.schema))
    results = {}
    for bs in batch_sizes:
        t0 = time.perf_counter()
        gen = 0
        for start in range(0, len(w.prompts), bs):
            batch = w.prompts[start : start + bs]
            limits = w.max_tokens[start : start + bs]
            ids, mask = left_padded(batch)
            width = ids.shape[1]
            top = max(limits)
            kwargs = dict(max_new_tokens=top, min_new_tokens=top, pad_token_id=0)
            if not w.ignore_eos:
                del kwargs["min_new_tokens"]
                kwargs["eos_token_id"] = 2
            if grammar is not None:
                import xgrammar as xgr

                kwargs["logits_processor"] = [xgr.contrib.hf.LogitsProcessor(grammar)]
            if bool((mask == 0).any()):  # no mask without padding: no [rows, ctx, ctx] mask at long contexts
                kwargs["attention_mask"] = mask
            if w.kind == "sample":
                kwargs.update(
                    do_sample=True,
                    temperature=w.temperature,
                    top_p=w.top_p,
                    top_k=0,
                    num_return_sequences=w.n,
                )
            elif w.kind == "beam":
                kwargs.update(do_sample=False, num_beams=w.beam_width, num_return_sequences=w.beam_width)
            else:
                kwargs.update(do_sample=False)
            with torch.no_grad():
                seqs = model.generate(ids, **kwargs)
            per = w.n if w.kind == "sample" else (w.beam_width if w.kind == "beam" else 1)
            if w.ignore_eos:
                gen += sum(min(m, top) * per for m in limits)  # only each row's own tokens count
            else:  # each completion's tokens up to its EOS (included)
                for row in seqs[:, width:].tolist():
                    gen += row.index(2) + 1 if 2 in row else len(row)
        wall = time.perf_counter() - t0
        results[bs] = {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall}
        print(f"    transformers batch {bs:>2}: {gen / wall:8.1f} tok/s ({wall:.1f} s)", flush=True)
    best = max(results, key=lambda b: results[b]["tokens_per_s"])
    out = {"per_batch_size": results, "best_batch_size": best, **results[best]}
    if w.long:  # prefill alone: one forward over each prompt
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in w.prompts:
                model(torch.tensor([p]))
        out["prefill_tokens_per_s"] = sum(len(p) for p in w.prompts) / (time.perf_counter() - t0)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def gemm_shapes(model_dir: str, rows: int = 128) -> list[tuple[int, int, int]]:
    """(rows, out, in) of every GEMM of one decode step of ``rows`` tokens: per layer q/k/v, o and
    the MLP (with experts: the router, and each of the ``top_k`` experts a token picks, at the
    ``rows * top_k / experts`` tokens an expert gets on average), then the LM head."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, h, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or d // h
    layer = [(rows, (h + 2 * kv) * hd, d), (rows, d, h * hd)]
    experts = getattr(c, "num_experts", None) or 0
    if experts:
        k, inter = c.num_experts_per_tok, c.moe_intermediate_size
        per = max(1, rows * k // experts)
        layer += [(rows, experts, d)] + [(per, 2 * inter, d), (per, d, inter)] * experts
    else:
        layer += [(rows, 2 * c.intermediate_size, d), (rows, d, c.intermediate_size)]
    return layer * c.num_hidden_layers + [(rows, c.vocab_size, d)]


ATTENTION_MFLOP = 3.0  # docs/benchmarks.md: bench-56m's 84 MFLOP per token = 2 x 40.5 M matmul parameters + 3


def mflop_per_token(model_dir: str) -> float:
    """MFLOP per processed token: 2 x the active matmul parameters (for an MoE model only the
    experts a token picks count) plus docs/benchmarks.md's attention allowance (both bench models
    have bench-56m's attention shape)."""
    shapes = gemm_shapes(model_dir, rows=128)
    return sum(2 * r * n * k for r, n, k in shapes) / 128 / 1e6 + ATTENTION_MFLOP


def gemm_gflops(
    model_dir: str, backend: str, threads: int, rows: int = 128, dtype: str = "float32", cold: bool = False
) -> float:
    """FLOP rate of the model's own GEMM shapes at a decode batch of ``rows`` (``gemm_shapes``),
    through ``F.linear`` ("torch"), oneDNN's packed GEMM ("onednn") or the compiled kernel
    ("cpu"), as the engine runs them, in ``dtype``; 0 where that backend cannot run here.
    ``cold``: every layer its own weight, as in the model, so that a pass reads them from memory
    as a decode step does (the default repeats one weight per shape, which then stays in cache)."""
    from batchgen.model.linear import Linear
    from batchgen.model.malloc import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    shapes = gemm_shapes(model_dir, rows)
    try:
        if cold:
            layers = [Linear((torch.randn(n, k) * 0.02).to(dt), backends=[backend], strict=True) for _, n, k in shapes]
        else:
            distinct = {
                (n, k): Linear((torch.randn(n, k) * 0.02).to(dt), backends=[backend], strict=True)
                for _, n, k in set(shapes)
            }
            layers = [distinct[n, k] for _, n, k in shapes]
    except ValueError:
        return 0.0
    xs = {(r, k): torch.randn(r, k).to(dt) for r, _, k in shapes}
    calls = [(layer, xs[r, k]) for layer, (r, _, k) in zip(layers, shapes, strict=True)]
    for layer, x in calls:  # warm-up
        layer(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for layer, x in calls:
            layer(x)
        best = min(best, time.perf_counter() - t0)
    return sum(2 * r * n * k for r, n, k in shapes) / best / 1e9


def processed_tokens(w: Workload) -> int:
    """Tokens whose activations must be computed: each distinct prompt token once, and every
    generated token (as the next step's input)."""
    shared = w.extra.get("shared_prefix", 0)  # computed once, with prefix caching
    once = w.extra.get("distinct_prefix_tokens", shared)
    return once + sum(len(p) - shared for p in w.prompts) + useful_tokens(w)


def floor_tok_s(w: Workload, gflops: float, mflop: float) -> float:
    """Generated tokens per second if every processed token cost only its ``mflop`` of matmuls at
    ``gflops``; 0 where that rate is 0 (a backend that cannot run the dtype here)."""
    if not gflops:
        return 0.0
    seconds = processed_tokens(w) * mflop * 1e6 / (gflops * 1e9)
    return useful_tokens(w) / seconds


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=["S", "B", "P", "D"])
    ap.add_argument("--model", default="models/bench-56m")
    ap.add_argument("--moe-model", default="models/bench-moe", help="the model of workload M")
    ap.add_argument("--deep-model", default="models/bench-deep", help="the model of workload R")
    ap.add_argument("--z-model", default="models/bench-z", help="the model of workload Z")
    ap.add_argument("--long-model", default="models/bench-56m-32k", help="the model of workload L")
    ap.add_argument("--gpt-oss-model", default="models/bench-gpt-oss", help="the model of workload QX")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides' dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-batch-sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--json", default="bench-cpu.json")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each side this many times, alternating, in fresh processes; report each side's median run",
    )
    ap.add_argument("--quant-formats", nargs="+", choices=list(QUANT_FORMATS), help="workload Q: only these formats")
    ap.add_argument(
        "--engine-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra LLM(...) setting for batchgen, e.g. linear_backend=torch (repeatable)",
    )
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, not {args.repeat}")
    settings = {}
    for item in args.engine_setting:
        key, _, value = item.partition("=")
        settings[key] = int(value) if value.lstrip("-").isdigit() else value
    names = [x.upper() for x in args.workloads]
    from batchgen.tiny import make_bench_model, make_bench_moe_model
    from fixtures.models import make_bench_deep_model, make_bench_z_model

    for path, make, wanted in (
        (args.model, make_bench_model, set(names) - {"M", "R", "L", "Z"}),
        (args.moe_model, make_bench_moe_model, {"M"} & set(names)),
        (args.deep_model, make_bench_deep_model, {"R", "Q"} & set(names)),
        (args.z_model, make_bench_z_model, {"Z"} & set(names)),
        (args.long_model, lambda p: make_bench_model(p, max_positions=32768), {"L"} & set(names)),
    ):
        if wanted and not (Path(path) / "config.json").exists():
            print(f"building the bench model in {path} ...", flush=True)
            make(path)
    from transformers import AutoConfig

    def model_of(w: Workload) -> str:
        return (
            args.moe_model
            if w.moe
            else args.deep_model
            if w.deep
            else args.z_model
            if w.z
            else args.long_model
            if w.long
            else args.model
        )

    # bench-56m, its 32k variant and the MoE model share one vocabulary: read it from the one built
    built = [p for p in (args.model, args.long_model, args.moe_model) if (Path(p) / "config.json").exists()]
    vocab = AutoConfig.from_pretrained(built[0]).vocab_size if built else 0  # 0: only R, which has its own
    vocab_deep = AutoConfig.from_pretrained(args.deep_model).vocab_size if {"R", "Q"} & set(names) else 49152
    rows = []
    workloads = make_workloads(vocab, names, vocab_deep)
    # L last: workloads that ran right after its transformers side (a 3 GB process) came out 35-40%
    # slower in two float32 runs than the same requests at other times
    workloads.sort(key=lambda w: w.long)
    lora_rows = []
    for w in [w for w in workloads if w.name == "A"]:
        print(f"workload A: {w.notes}, {len(w.prompts)} prompts ({args.model})", flush=True)
        lora_rows.append(bench_lora(args.model, w, args.threads, args.repeat, args.skip_baseline, args.dtype))
    for w in [w for w in workloads if w.name == "Q"]:
        print(f"workload Q: R's requests on {args.deep_model} in each quantized format", flush=True)
        lora_rows.append(bench_quant(args.deep_model, w, args.threads, "bfloat16", args.quant_formats, args.repeat))
    for w in [w for w in workloads if w.name == "QX"]:
        print(f"workload QX: {w.notes}, {len(w.prompts)} prompts ({args.gpt_oss_model})", flush=True)
        lora_rows.append(bench_mxfp4(args.gpt_oss_model, w, args.threads, args.repeat))
    workloads = [w for w in workloads if w.name not in ("A", "Q", "QX")]
    if not workloads:
        Path(args.json).write_text(json.dumps({"results": lora_rows}, indent=2, default=str))
        print(f"wrote {args.json}")
        return
    for w in workloads:
        model = model_of(w)
        print(f"workload {w.name}: {w.notes}, {len(w.prompts)} prompts ({model})", flush=True)
        skip = args.skip_baseline or (w.name == "P2-INPUT" and any(x.name == "P2" for x in workloads))
        bg_runs, hf_runs = [], []
        for _ in range(args.repeat):  # alternating, so that the machine's drift meets both sides
            bg_runs.append(in_fresh_process(run_batchgen, model, w, args.threads, settings, args.dtype))
            print(
                f"    batchgen:          {bg_runs[-1]['tokens_per_s']:8.1f} tok/s ({bg_runs[-1]['wall_s']:.1f} s)",
                flush=True,
            )
            if not skip:
                hf_runs.append(
                    in_fresh_process(
                        run_hf,
                        model,
                        w,
                        w.baseline_batch_sizes or args.baseline_batch_sizes,
                        args.threads,
                        args.dtype,
                    )
                )
        bg, hf = median_run(bg_runs), median_run(hf_runs) if hf_runs else None
        s = bg["stats"]
        if args.repeat > 1:
            print(
                f"    medians of {args.repeat}: batchgen {bg['tokens_per_s']:.1f}"
                + (f", transformers {hf['tokens_per_s']:.1f}" if hf else ""),
                flush=True,
            )
        if w.long:
            print(
                f"    batchgen prefill {bg['prefill_tokens_per_s']:.0f} prompt tok/s, peak RSS {bg['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        if w.moe:
            share = s["expert_s"] / bg["wall_s"]
            print(f"    expert GEMMs: {s['expert_s']:.1f} s, {share:.0%} of batchgen's time", flush=True)
        if "admission_order" in w.engine:
            from batchgen.engine.admission import PromptBlockCounter

            perfect = PromptBlockCounter(s["block_size"])
            for p in w.prompts:
                perfect.add(p)
            print(
                f"    prompt tokens computed: {s['prompt_tokens_computed']} (each distinct block once: "
                f"{perfect.tokens}; {s['prompt_tokens_computed'] / perfect.tokens:.2f}x), "
                f"prefix-cache hits {s['prefix_cache_hit_tokens']}, preemptions {s['num_preemptions']}",
                flush=True,
            )
        if hf and w.long:
            print(
                f"    transformers prefill {hf['prefill_tokens_per_s']:.0f} prompt tok/s, peak RSS {hf['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        rows.append(
            {
                "workload": w.name,
                "batchgen": bg,
                "transformers": hf,
                "ratio": bg["tokens_per_s"] / hf["tokens_per_s"] if hf else None,
                "runs_tokens_per_s": {
                    "batchgen": [r["tokens_per_s"] for r in bg_runs],
                    "transformers": [r["tokens_per_s"] for r in hf_runs],
                },
            }
        )
    print()
    print(
        "| workload | batchgen tok/s | transformers tok/s (best batch) | ratio | prefill s | decode s | "
        "other s | KV phys/logical slots | CoW copies | prefix hits |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        bg, s, hf = r["batchgen"], r["batchgen"]["stats"], r["transformers"]
        other = bg["wall_s"] - s["prefill_s"] - s["decode_s"]
        hf_txt = f"{hf['tokens_per_s']:.1f} (bs {hf['best_batch_size']})" if hf else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(
            f"| {r['workload']} | {bg['tokens_per_s']:.1f} | {hf_txt} | {ratio} | {s['prefill_s']:.1f} | "
            f"{s['decode_s']:.1f} | {other:.1f} | {s['peak_physical_kv_slots']} / {s['peak_logical_kv_tokens']} "
            f"({s['physical_over_logical']:.0%}) | {s['cow_copies']} | {s['prefix_cache_hit_tokens']} |"
        )
    by_name = {r["workload"]: r for r in rows}
    if "J" in by_name:
        j, st = by_name["J"], by_name["J"]["batchgen"]["stats"]
        line = f"\nJ: constrained {j['batchgen']['tokens_per_s']:.1f} tok/s"
        if "J-FREE" in by_name:
            free = by_name["J-FREE"]["batchgen"]["tokens_per_s"]
            line += f", {j['batchgen']['tokens_per_s'] / free:.2f}x batchgen unconstrained ({free:.1f})"
        if j["ratio"]:
            line += f", {j['ratio']:.2f}x transformers with the grammar"
        if "S" in by_name and by_name["S"]["ratio"]:
            line += f" (S: {by_name['S']['ratio']:.2f}x)"
        print(
            line + f"; grammar compiles {st['grammar_compiles']} ({st['grammar_compile_s'] * 1000:.1f} ms), "
            f"cache hits {st['grammar_cache_hits']}, masks {st['grammar_mask_s']:.2f} s"
        )
    if "P2" in by_name and "P2-INPUT" in by_name:
        a, b = by_name["P2-INPUT"]["batchgen"], by_name["P2"]["batchgen"]
        print(
            f"\nP2: prefix-aware admission {b['tokens_per_s']:.1f} tok/s vs input order "
            f"{a['tokens_per_s']:.1f} tok/s: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x; prompt tokens "
            f"computed {b['stats']['prompt_tokens_computed']} vs {a['stats']['prompt_tokens_computed']}"
        )
    rates: dict[str, dict[str, float]] = {}
    for model in {model_of(w) for w in workloads}:
        rates[model] = {
            b: in_fresh_process(gemm_gflops, model, b, args.threads, 128, args.dtype)
            for b in ("torch", "onednn", "cpu")
        }
        rates[model]["best"] = max(rates[model].values())
        rates[model]["cold"] = max(
            in_fresh_process(gemm_gflops, model, b, args.threads, 128, args.dtype, True) for b in ("onednn", "cpu")
        )
        print(
            f"\nGEMM rate of {model}'s shapes at 128 rows ({mflop_per_token(model):.0f} MFLOP per token): "
            f"F.linear (MKL) {rates[model]['torch']:.0f} GFLOP/s, oneDNN packed {rates[model]['onednn']:.0f}, "
            f"the compiled kernel (cpu_gemm) {rates[model]['cpu']:.0f}; every layer's own weight from memory "
            f"(the better of oneDNN and the kernel) {rates[model]['cold']:.0f}"
        )
    print(
        "| workload | matmul floor tok/s at F.linear rate | at oneDNN rate | at the compiled kernel's rate "
        "| batchgen share of the best floor | floor with the weights from memory | batchgen share of it |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r, w in zip(rows, workloads, strict=True):
        model = model_of(w)
        mflop = mflop_per_token(model)
        floors = {b: floor_tok_s(w, rate, mflop) for b, rate in rates[model].items()}
        r["floor_tok_s"] = floors
        got = r["batchgen"]["tokens_per_s"]
        print(
            f"| {w.name} | {floors['torch']:.0f} | {floors['onednn']:.0f} | {floors['cpu']:.0f} "
            f"| {got / floors['best']:.0%} | {floors['cold']:.0f} | {got / floors['cold']:.0%} |"
        )
    meta = {
        "machine": platform.platform(),
        "cpu": platform.processor(),
        "threads": args.threads,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "engine_settings": settings,
        "gemm_gflops": rates,
    }
    Path(args.json).write_text(json.dumps({"meta": meta, "results": rows + lora_rows}, indent=2, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
