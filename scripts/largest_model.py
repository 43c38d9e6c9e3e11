"""The memory demonstration of quantized checkpoints: write a random-weight model of the Llama-3-70B
layer shape (hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 32000) with as many
layers as asked, in bfloat16 or as a GPTQ int4 checkpoint (groups of 128), straight to sharded
safetensors (one shard per layer, no float copy in memory), then run a small job on it in a fresh
process and report its parameter count, the job's exit code and the process's peak RSS.

    python scripts/largest_model.py DIR --layers N --format bf16|gptq-int4 [--linear-backend torch]

Random int4 values and scales stand in for a quantized model: the point is memory, not text.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden=8192, inter=28672, heads=64, kv_heads=8, vocab=32000)
GROUP = 128


def projections(h: int, inter: int, heads: int, kv: int) -> dict[str, tuple[int, int]]:
    d = h // heads
    return {
        "self_attn.q_proj": (heads * d, h),
        "self_attn.k_proj": (kv * d, h),
        "self_attn.v_proj": (kv * d, h),
        "self_attn.o_proj": (h, heads * d),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }


def parameter_count(layers: int) -> int:
    s = SHAPE
    per_layer = sum(o * i for o, i in projections(s["hidden"], s["inter"], s["heads"], s["kv_heads"]).values())
    return layers * (per_layer + 2 * s["hidden"]) + 2 * s["vocab"] * s["hidden"] + s["hidden"]


def write(path: Path, layers: int, fmt: str) -> None:
    from safetensors.torch import save_file

    from batchgen.tiny import build_tokenizer

    s = SHAPE
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}

    def dense(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": dense(s["vocab"], s["hidden"]),
                                "lm_head.weight": dense(s["vocab"], s["hidden"]),
                                "model.norm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16)})
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors = {p + "input_layernorm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(s["hidden"], dtype=torch.bfloat16)}
        for name, (o, i) in projections(s["hidden"], s["inter"], s["heads"], s["kv_heads"]).items():
            if fmt == "bf16":
                tensors[p + name + ".weight"] = dense(o, i)
                continue
            # GPTQ v1, 4 bits, symmetric: qweight [in / 8, out], qzeros 7 (= 8 - 1) packed along out
            tensors[p + name + ".qweight"] = torch.randint(-(2**31), 2**31, (i // 8, o), generator=gen).to(torch.int32)
            tensors[p + name + ".qzeros"] = torch.full((i // GROUP, o // 8), 0x77777777, dtype=torch.int32)
            tensors[p + name + ".scales"] = (torch.rand(i // GROUP, o, generator=gen) * 0.004 + 0.001).half()
            tensors[p + name + ".g_idx"] = (torch.arange(i) // GROUP).to(torch.int32)
        shard(f"layer-{layer:03d}.safetensors", tensors)
        print(f"  layer {layer + 1}/{layers} written", flush=True)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    if fmt == "gptq-int4":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True,
                                         "desc_act": False, "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(512).save_pretrained(str(path))


def run_job(model: Path, linear_backend: str) -> dict:
    """A 4-row job (8 new tokens each) in a fresh process; its exit code, wall time and peak RSS."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    work = model / "job"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    pq.write_table(pa.table({"prompt": ["the cat sat on", "a dog", "once upon a time", "hello"]}), work / "in.parquet")
    config = {
        "model": str(model),
        "engine": {"dtype": "bfloat16", "max_num_seqs": 4, "max_model_len": 256, "kv_cache_memory_gb": 0.25,
                   "linear_backend": linear_backend},
        "input": {"path": str(work / "in.parquet"), "prompt_column": "prompt"},
        "generation": {"max_tokens": 8, "temperature": 0, "ignore_eos": True},
        "output": {"path": str(work / "out")},
    }
    (work / "job.yaml").write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "batchgen", "job", str(work / "job.yaml"), "--no-progress"],
                         capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return {"rc": res.returncode, "wall_s": time.perf_counter() - start, "peak_rss_gib": peak,
            "tail": (res.stdout + res.stderr)[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--format", choices=["bf16", "gptq-int4"], required=True)
    ap.add_argument("--linear-backend", default="auto", help="the engine's linear_backend for the job")
    ap.add_argument("--skip-write", action="store_true")
    args = ap.parse_args()
    path = Path(args.dir)
    n = parameter_count(args.layers)
    print(f"{args.format}, {args.layers} layers of the Llama-3-70B shape: {n / 1e9:.2f}B parameters", flush=True)
    if not args.skip_write:
        write(path, args.layers, args.format)
    r = run_job(path, args.linear_backend)
    print(json.dumps({"format": args.format, "layers": args.layers, "parameters": n,
                      "linear_backend": args.linear_backend, **r}, indent=2))


if __name__ == "__main__":
    main()
