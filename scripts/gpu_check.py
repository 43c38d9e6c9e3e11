"""The GPU check: on one CUDA device, in a few minutes,

1. measures device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate;
2. checks every Triton kernel against its torch reference at real sizes (relative error in float64,
   outputs poisoned with NaN first so that every element must be written);
3. times each kernel (median of many runs, CUDA events via ``triton.testing.do_bench``) against its
   memory floor (bytes it must move / measured bandwidth);
4. checks the engine paths that only exist on a GPU on a small float32 model: decode steps replayed
   through CUDA graphs against eager steps (same greedy tokens, time per step), swap preemption to
   pinned host memory against recompute (same tokens), and times the block swap; every family's
   small model against transformers; structured outputs (JSON schema), a LoRA adapter and six
   quantized formats through the engine against the engine on the CPU;
5. runs workloads S-gpu and B-gpu of docs/benchmarks.md (bench-1b shape, random weights, bfloat16) for
   batchgen and the transformers ``generate`` baseline;

then prints one table and writes ``gpu_check.json`` to ``$OUT`` (or the current directory).

    python scripts/gpu_check.py [--scale 1.0] [--skip-workloads] [--model-dir /tmp/bench-1b]

``--scale`` shrinks the workloads' prompt counts (e.g. 0.25) to fit a short lease.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback
from pathlib import Path

import torch

from batchgen.utils import cdiv


def bandwidth_gbs() -> float:
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def matmul_tflops() -> float:
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def kernel_row(name: str, ok: bool, ms: float, nbytes: int, bw: float) -> dict:
    """A table row for a kernel that moves ``nbytes`` in ``ms`` (exact result: ``ok``)."""
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": name,
        "rel_err": 0.0 if ok else 1.0,
        "all_written": ok,
        "ms": ms,
        "GB/s": gbs,
        "of_copy_bw": gbs / bw,
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_attention(bw: float, rows: list) -> None:
    gemma = {"window": 4096, "softcap": 50.0}  # Gemma 2's settings
    for name, seqs, ctx_len, kvh, h, d, bs, opts in [
        ("decode 256 x 2k", 256, 2048, 8, 32, 64, 16, {}),
        ("decode 4 x 32k (split-KV)", 4, 32768, 8, 32, 64, 16, {}),
        ("decode 64 x 4k, d128", 64, 4096, 8, 32, 128, 32, {}),
        ("decode 64 x 8k, window 4k + soft-cap 50 (Gemma 2)", 64, 8192, 8, 16, 256, 16, gemma),
        ("decode 4 x 32k split-KV, sinks + window 128 (gpt-oss)", 4, 32768, 8, 64, 64, 16, {"window": 128}),
        ("prefill 4 x 2k tokens (K/V read once at least)", 4, 2048, 8, 32, 128, 16, {}),
    ]:
        try:
            rows.extend(attention_case(bw, name, seqs, ctx_len, kvh, h, d, bs, opts))
        except Exception as e:  # noqa: BLE001 - one shape failing must not hide the others
            traceback.print_exc()
            rows.append({"kernel": f"paged_attention {name}", "error": repr(e)})


def attention_case(
    bw: float, name: str, seqs: int, ctx_len: int, kvh: int, h: int, d: int, bs: int, opts: dict
) -> list[dict]:
    prefill = name.startswith("prefill")
    import triton.testing

    from batchgen_kernels.paged_attention import paged_attention
    from batchgen_kernels.reference import paged_attention_ref

    nb_per = cdiv(ctx_len, bs)
    num_blocks = seqs * nb_per + 8
    dt = torch.bfloat16
    kc = torch.randn((kvh, num_blocks, bs, d), device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks - 8, device="cuda")[: seqs * nb_per] + 8
    tables = perm.view(seqs, nb_per).contiguous()
    if prefill:  # every position of each sequence is a query token (a whole prompt's prefill)
        rows_t = torch.arange(seqs, device="cuda").repeat_interleave(ctx_len)
        ctx = torch.arange(1, ctx_len + 1, device="cuda").repeat(seqs)
    else:
        rows_t = torch.arange(seqs, device="cuda")
        ctx = torch.full((seqs,), ctx_len, device="cuda")
    q = torch.randn((len(rows_t), h, d), device="cuda", dtype=dt)
    if "gpt-oss" in name:
        opts = {**opts, "sinks": torch.randn(h, device="cuda")}
    ref_opts = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    sub = torch.tensor([0, 1, len(rows_t) // 2, len(rows_t) - 1]) if prefill else slice(0, min(seqs, 4))
    ref = paged_attention_ref(
        q[sub].cpu().float(),
        kc.cpu().float(),
        vc.cpu().float(),
        tables.cpu(),
        rows_t[sub].cpu(),
        ctx[sub].cpu(),
        d**-0.5,
        **ref_opts,
    )
    read = min(ctx_len, opts.get("window") or ctx_len)  # positions whose K/V are read (at least once)
    nbytes = 2 * seqs * read * kvh * d * kc.element_size() + 2 * q.numel() * q.element_size()
    rows = []
    for variant, kw in ATTENTION_VARIANTS.items():
        out = torch.full_like(q, float("nan"))  # every element must be written
        launch = functools.partial(
            paged_attention,
            q,
            kc,
            vc,
            tables,
            rows_t,
            ctx,
            d**-0.5,
            max_context=ctx_len,
            out=out,
            **opts,
            **kw,
        )
        launch()
        torch.cuda.synchronize()
        err = rel_err(out[sub].float().cpu(), ref)
        written = bool(torch.isfinite(out).all())
        ms = triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "kernel": f"paged_attention {name} [{variant}]",
                "rel_err": err,
                "all_written": written,
                "ms": ms,
                "GB/s": gbs,
                "of_copy_bw": gbs / bw,
            }
        )
    return rows


# the attention kernel's inner loops side by side: elementwise products over one block (16 keys) a
# step, and tl.dot over 64 keys (the default)
ATTENTION_VARIANTS = {
    "elementwise, 16 keys": dict(use_dot=False, keys_per_step=16),
    "dot, 64 keys (default)": dict(use_dot=True, keys_per_step=64),
}


def check_small_kernels(bw: float, rows: list) -> None:
    import triton.testing

    from batchgen_kernels.block_ops import copy_blocks
    from batchgen_kernels.kv_write import write_kv
    from batchgen_kernels.reference import copy_blocks_ref

    kvh, nb, bs, d, t = 8, 4096, 16, 128, 8192
    kc = torch.randn((kvh, nb, bs, d), device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k = torch.randn((t, kvh, d), device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[::97] = -1
    write_kv(k, v, kc, vc, slots)
    ok = bool(
        torch.equal(kc[:, slots[slots >= 0] // bs, slots[slots >= 0] % bs].transpose(0, 1), k[slots >= 0])
    )
    ms = triton.testing.do_bench(
        lambda: write_kv(k, v, kc, vc, slots), warmup=25, rep=200, return_mode="median"
    )
    nbytes = 4 * k.numel() * k.element_size()
    rows.append(kernel_row("write_kv 8192 tokens", ok, ms, nbytes, bw))

    cache = torch.randn((16, 2, kvh, 2048, bs, d), device="cuda", dtype=torch.bfloat16)
    src = torch.randperm(1024, device="cuda")[:256]
    dst = torch.randperm(1024, device="cuda")[:256] + 1024
    ref = cache.clone()
    copy_blocks(cache, src, dst)
    copy_blocks_ref(ref, src, dst)
    ok = bool(torch.equal(cache, ref))
    ms = triton.testing.do_bench(
        lambda: copy_blocks(cache, src, dst), warmup=25, rep=200, return_mode="median"
    )
    nbytes = 2 * 256 * 16 * 2 * kvh * bs * d * cache.element_size()
    rows.append(kernel_row("copy_blocks 256 pairs x 16 layers", ok, ms, nbytes, bw))

    # structured outputs' token mask: 256 rows of a 151,936-token vocabulary (Qwen's), every
    # third row unconstrained (left as it was)
    from batchgen_kernels.reference import token_mask_ref
    from batchgen_kernels.token_mask import token_mask

    r, vocab = 256, 151936
    scores = torch.randn((r, vocab), device="cuda")
    mask = torch.randint(-(2**31), 2**31 - 1, (r, (vocab + 31) // 32), device="cuda", dtype=torch.int32)
    masked = [i for i in range(r) if i % 3]
    got, want = scores.clone(), scores.clone()
    token_mask(got, mask, masked)
    token_mask_ref(want, mask, masked)
    ok = bool(torch.equal(got, want))
    ms = triton.testing.do_bench(lambda: token_mask(got, mask, masked), warmup=25, rep=200, return_mode="median")
    nbytes = len(masked) * (2 * vocab * 4 + mask.shape[1] * 4)
    rows.append(kernel_row("token_mask 256 rows x 151936 (2/3 masked)", ok, ms, nbytes, bw))


def check_lora_kernels(bw: float, rows: list) -> None:
    """LoRA's SGMV shrink and expand at bench-1b's qkv shape (hidden 2048 -> 3072), 4 adapters of
    rank 16 per part over 512 tokens in 8 segments, bf16, against the torch references."""
    import triton.testing

    from batchgen_kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

    t, hidden, out, rank, slots = 512, 2048, 3072, 48, 4
    x = torch.randn((t, hidden), device="cuda", dtype=torch.bfloat16)
    a = torch.randn((slots, rank, hidden), device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn((slots, out, rank), device="cuda", dtype=torch.bfloat16) * 0.02
    starts = list(range(0, t, t // 8))
    seg = torch.tensor([starts, [t // 8] * 8, [i % slots for i in range(8)]], dtype=torch.int32, device="cuda")
    shrunk = lora_shrink(x, a, seg, t // 8)
    err = rel_err(shrunk, lora_shrink_ref(x, a, seg))
    ms = triton.testing.do_bench(lambda: lora_shrink(x, a, seg, t // 8), warmup=25, rep=200, return_mode="median")
    rows.append({**kernel_row("lora_shrink 512 tokens, 8 segments", err < 1e-2, ms,
                              x.numel() * 2 + a.numel() * 2 + t * rank * 4, bw), "rel_err": err})
    y = torch.randn((t, out), device="cuda", dtype=torch.bfloat16)
    want = y.clone()
    lora_expand_ref(shrunk, b, want, seg)
    lora_expand(shrunk, b, y, seg, t // 8)
    err = rel_err(y, want)
    ms = triton.testing.do_bench(lambda: lora_expand(shrunk, b, y, seg, t // 8), warmup=25, rep=200,
                                 return_mode="median")
    rows.append({**kernel_row("lora_expand 512 tokens, 8 segments", err < 1e-2, ms,
                              2 * y.numel() * 2 + b.numel() * 2 + t * rank * 4, bw), "rel_err": err})


def check_quant_gemm(bw: float, rows: list) -> None:
    """The quantized checkpoints' weight-only GEMM at bench-1b's gate_up shape (2048 -> 16384), 64
    rows of bf16 activations: int4 (groups of 128, zero points), int8 and FP8 per row, FP8 per block
    of 128 inputs (the hub's fine-grained FP8), MXFP4, against the torch reference; bytes moved are
    the packed weight's."""
    import triton.testing

    from batchgen_kernels.quant_gemm import pack_int4, quant_gemm, quant_gemm_ref

    m, n, k = 64, 16384, 2048
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    for kind, group in (("int4", 128), ("int8", 2048), ("fp8", 2048), ("fp8", 128), ("mxfp4", 32)):
        scale = torch.rand((n, k // group), device="cuda") * 0.01 + 0.001
        zero = None
        if kind == "mxfp4":
            packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
            scale = torch.ldexp(torch.ones((n, k // group), device="cuda"), torch.randint(-9, -5, (n, k // group), device="cuda"))
        elif kind == "int4":
            packed = pack_int4(torch.randint(0, 16, (n, k), device="cuda"))
            zero = torch.randint(0, 16, (n, k // group), device="cuda").float()
        elif kind == "int8":
            packed = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        else:
            packed = (torch.randn((n, k), device="cuda") * 50).to(torch.float8_e4m3fn)
            if group == k:
                fp8, fp8_scale = packed, scale
        err = rel_err(quant_gemm(x, kind, packed, scale, zero, group), quant_gemm_ref(x, kind, packed, scale, zero, group))
        args = (x, kind, packed, scale, zero, group)
        ms = triton.testing.do_bench(lambda args=args: quant_gemm(*args), warmup=25, rep=200, return_mode="median")
        nbytes = packed.numel() * packed.element_size() + scale.numel() * 8 + x.numel() * 2 + m * n * 2
        name = f"quant_gemm {kind}{' per 128 inputs' if kind == 'fp8' and group < k else ''} 64 x 2048 -> 16384"
        rows.append({**kernel_row(name, err < 1e-2, ms, nbytes, bw), "rel_err": err})
    # FP8 x FP8 on torch._scaled_mm (checkpoints with dynamic per-token FP8 activations), where the
    # device has it: QuantLinear's path against the same product of the FP8-rounded activations
    from batchgen.model.quant import QuantLinear, QWeight, fp8_tokens

    qw = QWeight("fp8", 8, fp8.cpu(), fp8_scale.cpu(), None, k, activations="fp8-token")
    layer = QuantLinear(qw, None, torch.device("cuda"), torch.bfloat16)
    if layer.path == "fp8-scaled-mm":
        xq, xs = fp8_tokens(x.float())
        want = (xq.float() * xs) @ (fp8.float() * fp8_scale).T
        err = rel_err(layer(x), want)
        ms = triton.testing.do_bench(lambda: layer(x), warmup=25, rep=200, return_mode="median")
        nbytes = fp8.numel() + x.numel() * 2 + m * n * 2
        rows.append({**kernel_row("_scaled_mm fp8 x fp8 64 x 2048 -> 16384", err < 2e-2, ms, nbytes, bw), "rel_err": err})
    else:
        rows.append({"kernel": "_scaled_mm fp8 x fp8", "error": f"not used on this device (path {layer.path})"})


def check_engine_paths(bw: float, kernel_rows: list, rows: list) -> None:
    import numpy as np
    import triton.testing

    from batchgen import LLM, SamplingParams
    from batchgen.tiny import make_bench_model
    from batchgen_kernels.swap import swap_blocks

    # block swap device -> pinned host -> device, all layers at once
    cache = torch.randn((16, 2, 8, 1024, 16, 128), device="cuda", dtype=torch.bfloat16)
    host = torch.empty((16, 2, 8, 512, 16, 128), dtype=torch.bfloat16, pin_memory=True)
    src = torch.randperm(1024, device="cuda")[:256]
    dst = torch.arange(256)
    swap_blocks(cache, host, src, dst)
    back = torch.zeros_like(cache)
    swap_blocks(host, back, dst, src.cpu())
    torch.cuda.synchronize()
    ok = bool(torch.equal(back[..., src, :, :], cache[..., src, :, :]))
    ms = triton.testing.do_bench(lambda: swap_blocks(host, cache, dst, src.cpu()), warmup=5, rep=50)
    nbytes = 256 * 16 * 2 * 8 * 16 * 128 * 2
    kernel_rows.append(kernel_row("swap_blocks host->device 256 blocks x 16 layers", ok, ms, nbytes, bw))
    # the swap's own ceiling: one contiguous pinned host -> device copy of the same bytes
    flat_host = host.view(-1)[: nbytes // 2]
    flat_dev = torch.empty(flat_host.shape, dtype=flat_host.dtype, device="cuda")
    ms = triton.testing.do_bench(lambda: flat_dev.copy_(flat_host, non_blocking=True), warmup=5, rep=50)
    kernel_rows.append(kernel_row("contiguous pinned host->device copy, same bytes", True, ms, nbytes, bw))

    path = "/tmp/bench-56m"
    if not (Path(path) / "config.json").exists():
        make_bench_model(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 32000, size=int(n)).tolist() for n in rng.integers(64, 300, size=24)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def timed(**kw):
        llm = LLM(path, dtype="float32", device="cuda", **kw)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        s = llm.stats()
        return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0, s, llm

    eager, t_eager, s_eager, _ = timed(cuda_graphs=False)
    graph, t_graph, s_graph, llm = timed()
    replays = llm.engine.runner.graphs.replays if llm.engine.runner.graphs is not None else 0
    same = sum(a == b for a, b in zip(eager, graph, strict=True)) / len(eager)
    rows.append(
        {
            "check": "CUDA graphs vs eager, 24 prompts x 64 greedy tokens (float32)",
            "same_tokens": same,
            "eager_decode_ms_per_step": 1000 * s_eager["decode_s"] / max(1, s_eager["steps"]),
            "graph_decode_ms_per_step": 1000 * s_graph["decode_s"] / max(1, s_graph["steps"]),
            "wall_ratio": t_eager / t_graph,
            "graph_replays": replays,
        }
    )
    recompute, _, s_rec, _ = timed(num_kv_blocks=200, preemption_mode="recompute")
    swapped, _, s_swap, _ = timed(num_kv_blocks=200, preemption_mode="swap", swap_space_gb=1.0)
    rows.append(
        {
            "check": "swap vs recompute preemption, 200-block pool",
            "same_tokens": sum(a == b for a, b in zip(recompute, swapped, strict=True)) / len(recompute),
            "preemptions": s_swap["num_preemptions"],
            "swap_outs": s_swap["num_swap_outs"],
            "swapped_blocks": s_swap["swapped_blocks"],
            "recompute_preemptions": s_rec["num_preemptions"],
        }
    )


@torch.no_grad()
def hf_greedy(path: str, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens on the CPU in float32, by whole forward passes. Eager attention:
    the reference implementation of every family (some transformers versions pick SDPA for Gemma 2,
    which drops its attention soft-capping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def check_families() -> dict:
    """Every family's small test model on the GPU (Triton attention, CUDA graphs where the model
    allows) against transformers on the CPU in float32: greedy tokens, prompts past the window."""
    from batchgen import LLM, SamplingParams
    from batchgen.tiny import FAMILY_ARCHS, make_model

    prompts = [[5], list(range(20, 57)), [(7 * i) % 380 + 3 for i in range(90)]]
    same = {}
    for arch in FAMILY_ARCHS:
        try:
            path = f"/tmp/family-{arch}"
            if not (Path(path) / "config.json").exists():
                make_model(path, arch, seed=1)
            llm = LLM(path, dtype="float32", device="cuda", block_size=16, num_kv_blocks=64)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            hits = [
                o.outputs[0].token_ids == hf_greedy(path, p, 8) for o, p in zip(outs, prompts, strict=True)
            ]
            cpu = LLM(path, dtype="float32", device="cpu", block_size=16, num_kv_blocks=64)
            cpu_outs = cpu.generate(prompts, params, use_tqdm=False)
            as_cpu = [
                a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, cpu_outs, strict=True)
            ]
            same[arch] = {"transformers": sum(hits) / len(hits), "batchgen_cpu": sum(as_cpu) / len(as_cpu)}
        except Exception as e:  # noqa: BLE001 - one family failing must not hide the others
            traceback.print_exc()
            same[arch] = repr(e)
        print(f"  {arch}: {same[arch]}", flush=True)
    return {
        "check": "families, greedy: share of 3 prompts x 8 tokens equal to transformers (CPU, fp32, eager) "
        "and to batchgen on the CPU",
        **same,
    }


def check_features(device: str = "cuda") -> dict:
    """Structured outputs, LoRA and quantized checkpoints through the engine on ``device`` (on a
    GPU: the Triton token mask, SGMV and quantized GEMMs), float32, greedy, against batchgen on the
    CPU; the JSON outputs validated against their schema; the weight-only formats also against
    transformers on the dequantized weights (W8A8 rounds its activations, so only the CPU side)."""
    from batchgen import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
    from batchgen.tiny import make_model
    from fixtures.models import make_adapter
    from fixtures.quant import quantize_model

    root = Path("/tmp/gpu-features")
    src = root / "llama"
    if not (src / "config.json").exists():
        make_model(src, "llama", seed=3)
    prompts = [[5], list(range(20, 57)), [(7 * i) % 380 + 3 for i in range(90)]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result: dict = {"check": f"features on {device}, greedy: share of 3 prompts x 8 tokens equal to batchgen "
                    "on the CPU (and to transformers where given); JSON outputs that validate"}

    def tokens(path: str, params, on: str, lora_request=None, **kw) -> tuple[list[list[int]], LLM]:
        llm = LLM(path, dtype="float32", device=on, block_size=16, num_kv_blocks=128, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        return [o.outputs[0].token_ids for o in outs], llm

    def share(a: list, b: list) -> float:
        return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)

    def part(name: str, fn) -> None:
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one feature failing must not hide the others
            traceback.print_exc()
            result[name] = repr(e)
        print(f"  {name}: {result[name]}", flush=True)

    def structured() -> dict:
        import jsonschema

        schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                  "age": {"type": "integer"}, "tag": {"enum": ["red", "green"]}},
                  "required": ["name", "age", "tag"], "additionalProperties": False}
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
        got, llm = tokens(str(src), params, device)
        cpu, _ = tokens(str(src), params, "cpu")
        sampled = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=60, seed=0,
                                                       structured_outputs=spec), use_tqdm=False)
        def validates(text: str) -> bool:
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError):
                return False
            return True

        stopped = [c.text for out in sampled for c in out.outputs if c.finish_reason == "stop"]
        return {"greedy_as_cpu": share(got, cpu), "sampled_stopped": len(stopped),
                "sampled_valid": sum(map(validates, stopped))}

    def lora() -> dict:
        adapter = root / "adapter"
        if not (adapter / "adapter_config.json").exists():
            make_adapter(adapter, src, rank=8, alpha=16, seed=1, scale=0.2)
        req = LoRARequest("a", 1, str(adapter))
        kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, lora_request=[req, None, req])
        got, _ = tokens(str(src), greedy, device, **kw)
        cpu, _ = tokens(str(src), greedy, "cpu", **kw)
        base, _ = tokens(str(src), greedy, "cpu")
        return {"as_cpu": share(got, cpu), "adapter_changes_tokens": got[0] != base[0]}

    def quantized(fmt: str, opts: dict) -> dict:
        path = root / fmt
        if not (path / "q" / "config.json").exists():
            quantize_model(src, path / "q", fmt, oracle=path / "oracle", **opts)
        got, llm = tokens(str(path / "q"), greedy, device)
        cpu, _ = tokens(str(path / "q"), greedy, "cpu")
        row = {"as_cpu": share(got, cpu), "paths": llm.stats()["quantized_paths"]}
        if fmt != "ct-w8a8":
            row["as_transformers"] = share(got, [hf_greedy(str(path / "oracle"), p, 8) for p in prompts])
        return row

    part("structured outputs (JSON schema)", structured)
    part("LoRA", lora)
    for fmt, opts in (("gptq", dict(bits=4, group=32)), ("awq", dict(group=32, sym=False)),
                      ("ct-int8", dict(group=-1)), ("ct-w8a8", {}), ("ct-fp8", dict(per_channel=True)),
                      ("fp8", dict(block=(48, 48)))):
        part(f"quantized {fmt}", functools.partial(quantized, fmt, opts))
    return result


def run_workloads(model_dir: str, scale: float, rows: list) -> None:
    import numpy as np
    from transformers import AutoModelForCausalLM

    from batchgen import LLM, BeamSearchParams, SamplingParams

    rng = np.random.default_rng(0)
    vocab = 128256
    specs = [("S-gpu", int(512 * scale), 256, "sample"), ("B-gpu", int(256 * scale), 128, "beam")]
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=512, max_num_batched_tokens=8192)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    for name, n, new, kind in specs:
        prompts = [rng.integers(3, vocab, size=int(x)).tolist() for x in rng.integers(128, 1025, size=n)]
        if kind == "sample":
            params = SamplingParams(n=8, temperature=0.8, top_p=0.95, max_tokens=new, ignore_eos=True, seed=0)
            useful = n * 8 * new
        else:
            params = BeamSearchParams(beam_width=4, max_tokens=new, ignore_eos=True)
            useful = n * 4 * new
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        bg = useful / (time.perf_counter() - t0)
        best = 0.0
        for bsz in (8, 32):
            t0 = time.perf_counter()
            for i in range(0, n, bsz):
                batch = prompts[i : i + bsz]
                width = max(map(len, batch))
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, p in enumerate(batch):
                    ids[j, width - len(p) :] = torch.tensor(p)
                    mask[j, width - len(p) :] = 1
                kw = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0, attention_mask=mask.cuda())
                if kind == "sample":
                    kw.update(do_sample=True, temperature=0.8, top_p=0.95, num_return_sequences=8)
                else:
                    kw.update(num_beams=4, num_return_sequences=4, do_sample=False)
                with torch.no_grad():
                    hf.generate(ids.cuda(), **kw)
            torch.cuda.synchronize()
            best = max(best, useful / (time.perf_counter() - t0))
        rows.append(
            {
                "workload": name,
                "prompts": n,
                "batchgen_tok_s": bg,
                "transformers_tok_s": best,
                "ratio": bg / best,
            }
        )


def run_all_workloads(args: argparse.Namespace, rows: list) -> None:
    if not (Path(args.model_dir) / "config.json").exists():
        from fixtures.models import make_bench_1b_model

        make_bench_1b_model(args.model_dir)
    run_workloads(args.model_dir, args.scale, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--skip-workloads", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/bench-1b")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs a CUDA device"
    out_dir = Path(os.environ.get("OUT", "."))
    bw = bandwidth_gbs()
    tf = matmul_tflops()
    print(
        f"device {torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s"
    )
    kernels: list = []
    engine_checks: list = []
    workloads: list = []

    def section(name: str, fn, *a) -> None:
        """Run one part; a failure is reported (with its traceback) and the check goes on."""
        t0 = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - report it and go on to the next part
            traceback.print_exc()
            engine_checks.append({"check": name, "error": repr(e)})
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)

    section("attention kernels", check_attention, bw, kernels)
    section("KV write and block copy", check_small_kernels, bw, kernels)
    section("LoRA kernels", check_lora_kernels, bw, kernels)
    section("quantized GEMM", check_quant_gemm, bw, kernels)
    section("engine paths", check_engine_paths, bw, kernels, engine_checks)
    section("families", lambda: engine_checks.append(check_families()))
    section("structured outputs, LoRA, quantized checkpoints", lambda: engine_checks.append(check_features()))
    for r in engine_checks:
        print(json.dumps(r))
    if not args.skip_workloads:
        section("workloads", run_all_workloads, args, workloads)
    print("| kernel | rel. error | all written | median ms | GB/s | of copy bandwidth |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in kernels:
        if "error" in r:
            print(f"| {r['kernel']} | {r['error']} | | | | |")
            continue
        print(
            f"| {r['kernel']} | {r['rel_err']:.1e} | {r['all_written']} | {r['ms']:.3f} | {r['GB/s']:.0f} | "
            f"{r['of_copy_bw']:.0%} |"
        )
    if workloads:
        print("| workload | batchgen tok/s | transformers tok/s | ratio |")
        print("| --- | --- | --- | --- |")
        for r in workloads:
            print(
                f"| {r['workload']} ({r['prompts']} prompts) | {r['batchgen_tok_s']:.0f} | "
                f"{r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x |"
            )
    (out_dir / "gpu_check.json").write_text(
        json.dumps(
            {
                "copy_GBs": bw,
                "bf16_TFLOPs": tf,
                "kernels": kernels,
                "engine_checks": engine_checks,
                "workloads": workloads,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
