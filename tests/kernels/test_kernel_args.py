"""The compiled kernels' entry points refuse what they cannot take: each wrapper checks dtypes,
shapes, device and layout before the call and raises ``KernelArgumentError`` naming the kernel and
the argument; a debug build (``BATCHGEN_KERNEL_DEBUG=1``, which ``.ci/run`` runs the kernel tests
under once) checks the C++ side's preconditions too and aborts naming the failed one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from batchgen_kernels import cpu, cpu_attention, cpu_beam, cpu_gemm, cpu_ops, cpu_sampling
from batchgen_kernels.cpu_args import KernelArgumentError

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the compiled kernels do not build here")

f32, bf16 = torch.float32, torch.bfloat16


def decode_args(**change):
    args = {
        "q": torch.zeros(2, 4, 64),
        "k_cache": torch.zeros(2, 8, 16, 64),
        "v_cache": torch.zeros(2, 8, 16, 64),
        "tables": torch.zeros(2, 3, dtype=torch.int64),
        "context_lens": torch.ones(2, dtype=torch.int64),
        "scale": 0.125,
    }
    return {**args, **change}


CASES = [
    (
        lambda: cpu_ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6),
        "rms_norm: x must be float32 or bfloat16, got float64",
    ),
    (lambda: cpu_ops.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6), "rms_norm: weight must have shape [8], got [4]"),
    (
        lambda: cpu_ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=bf16), torch.ones(8), 1e-6),
        "add_rms_norm: residual must be float32, got bfloat16",
    ),
    (
        lambda: cpu_ops.rotary(torch.zeros(3, 2, 8), torch.zeros(4, 8), torch.zeros(3, 8)),
        "rotary: cos must have shape [3, 8], got [4, 8]",
    ),
    (
        lambda: cpu_ops.kv_write(
            torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), torch.zeros(2, 8, 16, 64)[:, ::2],
            torch.zeros(2, 4, 16, 64), torch.zeros(2, dtype=torch.int64),
        ),
        "kv_write: k_cache must be contiguous",
    ),
    (
        lambda: cpu_ops.kv_write(
            torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), torch.zeros(2, 8, 16, 64),
            torch.zeros(2, 8, 16, 64), torch.zeros(2, dtype=torch.int32),
        ),
        "kv_write: slots must be int64, got int32",
    ),
    (
        lambda: cpu_attention.paged_decode(**decode_args(k_cache=torch.zeros(2, 8, 16, 64, dtype=bf16))),
        "paged_decode: k_cache must be float32, got bfloat16",
    ),
    (
        lambda: cpu_attention.paged_decode(**decode_args(tables=torch.zeros(2, 3, dtype=torch.int32))),
        "paged_decode: tables must be int64, got int32",
    ),
    (
        lambda: cpu_attention.paged_decode(**decode_args(context_lens=torch.ones(3, dtype=torch.int64))),
        "paged_decode: context_lens must have shape [2], got [3]",
    ),
    (
        lambda: cpu_attention.paged_decode(**decode_args(q=torch.zeros(2, 4, 32))),
        "paged_decode: k_cache must have shape [*, *, *, 32], got [2, 8, 16, 64]",
    ),
    (
        lambda: cpu_sampling.greedy_pick(torch.zeros(2, 10), torch.zeros(2, 10, dtype=bf16)),
        "greedy_pick: raw must be float32, got bfloat16",
    ),
    (
        lambda: cpu_sampling.sample_rows(
            torch.zeros(2, 10), torch.zeros(2, 10), torch.ones(2), torch.ones(3), [0, 1], [0, 0], 4, 16
        ),
        "sample_rows: top_p must have shape [2], got [3]",
    ),
    (
        lambda: cpu_beam.beam_topk(torch.zeros(4, 10), torch.arange(3), torch.zeros(3), 2, 2),
        "beam_topk: rows (3) must be whole groups of k = 2 beams",
    ),
    (
        lambda: cpu_beam.beam_topk(torch.zeros(4, 10), torch.tensor([0, 9]), torch.zeros(2), 2, 2),
        "beam_topk: rows must index logits' 4 rows",
    ),
    (lambda: packed(torch.zeros(32, 16))(torch.zeros(3, 8)), "gemm: x must have shape [*, 16], got [3, 8]"),
    (
        lambda: packed(torch.zeros(32, 16))(torch.zeros(3, 16, dtype=bf16)),
        "gemm: x must be float32, got bfloat16",
    ),
]


def packed(weight: torch.Tensor) -> cpu_gemm.PackedWeight:
    """The weight packed for the GEMM kernel, which builds in the avx2 variant and above."""
    w = cpu_gemm.pack(weight)
    if w is None:
        pytest.skip(f"the GEMM kernel does not run in variant {cpu.variant}")
    return w


@pytest.mark.parametrize("call, message", CASES, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(CASES)])
def test_a_wrong_argument_is_refused_by_name(call, message):
    with pytest.raises(KernelArgumentError) as e:
        call()
    assert str(e.value).startswith(message), str(e.value)


def test_a_tensor_on_another_device_is_refused():
    x = torch.zeros(2, 8, device="meta")
    with pytest.raises(KernelArgumentError, match="rms_norm: x must be on the CPU, got meta"):
        cpu_ops.rms_norm(x, torch.ones(8), 1e-6)


def _kv(**change):
    args = {
        "k": torch.zeros(3, 2, 8),
        "v": torch.zeros(3, 2, 8),
        "k_cache": torch.zeros(2, 4, 16, 8),
        "v_cache": torch.zeros(2, 4, 16, 8),
        "slots": torch.zeros(3, dtype=torch.int64),
    }
    return {**args, **change}


META = torch.zeros(2, 8, device="meta")
# The hot wrappers' arguments, each wrong on its own (device, dtype, shape, layout, type): expect's
# common-case test must let none of them through.
HOT_ARGUMENTS = [
    (lambda: cpu_ops.add_rms_norm(torch.zeros(2, 8), META, torch.ones(8), 1e-6), "add_rms_norm: residual must be on the CPU"),
    (lambda: cpu_ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(7), 1e-6), "add_rms_norm: weight must have shape [8]"),
    (lambda: cpu_ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6), "add_rms_norm: residual must have shape [2, 8]"),
    (lambda: cpu_ops.add_rms_norm([0.0], torch.zeros(2, 8), torch.ones(8), 1e-6), "add_rms_norm: x must be a tensor"),
    (lambda: cpu_ops.rotary(torch.zeros(3, 2, 8), torch.zeros(3, 8), torch.zeros(3, 8, device="meta")), "rotary: sin must be on the CPU"),
    (lambda: cpu_ops.rotary(torch.zeros(3, 2, 8), torch.zeros(3, 8), torch.zeros(3, 8, dtype=bf16)), "rotary: sin must be float32"),
    (lambda: cpu_ops.rotary(torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3, 8)), "rotary: x must have shape [*, *, *]"),
    (lambda: cpu_ops.kv_write(**_kv(v=torch.zeros(3, 2, 8, device="meta"))), "kv_write: v must be on the CPU"),
    (lambda: cpu_ops.kv_write(**_kv(k_cache=torch.zeros(2, 4, 16, 9))), "kv_write: k_cache must have shape [2, *, *, 8]"),
    (lambda: cpu_ops.kv_write(**_kv(v_cache=torch.zeros(2, 16, 4, 8).transpose(1, 2))), "kv_write: v_cache must be contiguous"),
    (lambda: cpu_ops.kv_write(**_kv(slots=torch.zeros(2, dtype=torch.int64))), "kv_write: slots must have shape [3]"),
    (lambda: cpu_attention.paged_decode(**decode_args(v_cache=torch.zeros(2, 8, 16, 64, device="meta"))), "paged_decode: v_cache must be on the CPU"),
    (lambda: cpu_attention.paged_decode(**decode_args(out=torch.zeros(2, 4, 64, dtype=bf16))), "paged_decode: out must be float32"),
    (lambda: cpu_attention.paged_decode(**decode_args(out=torch.zeros(2, 64, 4).transpose(1, 2))), "paged_decode: out must be contiguous"),
    (lambda: cpu_attention.paged_decode(**decode_args(tables=torch.zeros(3, 3, dtype=torch.int64))), "paged_decode: tables must have shape [2, *]"),
    (lambda: packed(torch.zeros(32, 16))(torch.zeros(3, 16, device="meta")), "gemm: x must be on the CPU"),
    (lambda: packed(torch.zeros(32, 16))(torch.zeros(16)), "gemm: x must have shape [*, 16], got [16]"),
]


@pytest.mark.parametrize("call, message", HOT_ARGUMENTS, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(HOT_ARGUMENTS)])
def test_each_hot_argument_wrong_on_its_own_is_refused_by_name(call, message):
    with pytest.raises(KernelArgumentError) as e:
        call()
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.skipif(os.environ.get("BATCHGEN_KERNEL_DEBUG") != "1", reason="needs the debug build (.ci/run)")
def test_a_debug_build_aborts_naming_the_failed_precondition():
    code = "from batchgen_kernels import cpu\ncpu.load().rms_norm_f32(None, None, 2, 0, 1e-6, None, 1)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "batchgen kernel rms_norm: precondition failed: x && w && out && rows >= 0 && dim > 0" in done.stderr


RUN = """
import json, sys
from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen_kernels import cpu_beam, cpu_ops, cpu_sampling
calls = {}
def counted(module, name):
    fn = getattr(module, name)
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    setattr(module, name, wrapper)
for module, names in ((cpu_ops, ["rms_norm", "add_rms_norm", "rotary", "kv_write", "zero_blocks", "copy_blocks"]),
                      (cpu_beam, ["beam_topk"]), (cpu_sampling, ["sample_rows", "tempered_softmax", "greedy_pick", "token_mask"])):
    for name in names:
        counted(module, name)
llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=64, block_size=8, seed=0)
prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 2 + i, 7] for i in range(3)]
greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
beams = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=6))
pattern = StructuredOutputsParams(regex=r"[a-c]{2,5}\\.(x|yz)")
constrained = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                                                   structured_outputs=pattern), use_tqdm=False)
constrained_beams = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                    BeamSearchParams(beam_width=2, max_tokens=12, structured_outputs=pattern))
print(json.dumps({
    "greedy": [o.outputs[0].token_ids for o in greedy],
    "constrained": [[c.text for c in o.outputs] for o in constrained],
    "constrained_beams": [[s.text for s in b.sequences] for b in constrained_beams],
    "beams": [[s.tokens for s in b.sequences] for b in beams],
    "linear_backend": llm.stats()["linear_backend"],
    "calls": sorted(calls),
}))
"""


def run_engine(model: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RUN, model], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_sent_to_its_library_path_gives_the_same_tokens(llama_dir):
    """``BATCHGEN_LIBRARY_KERNELS`` (how scripts/kernel_ablation.py measures each kernel) swaps
    paths, not results: greedy tokens, beams and regex-constrained samples and beams (the mask in
    the sampling kernel and the mask kernel, and xgrammar's) equal the all-compiled engine's."""
    compiled = run_engine(llama_dir)
    library = run_engine(llama_dir, BATCHGEN_LIBRARY_KERNELS=",".join(cpu.LIBRARY_ALTERNATIVES))
    calls = {"add_rms_norm", "rotary", "kv_write", "zero_blocks", "beam_topk", "sample_rows", "token_mask"}
    assert calls <= set(compiled.pop("calls"))
    for texts in compiled["constrained"] + compiled["constrained_beams"]:
        assert texts and all(re.fullmatch(r"[a-c]{2,5}\.(x|yz)", text) for text in texts)
    assert library.pop("calls") == []  # no compiled kernel but the GEMM's ran
    gemm = cpu_gemm.pack(torch.zeros(16, 16)) is not None  # else the layers run on oneDNN
    assert compiled == library and compiled["linear_backend"] == ("cpu" if gemm else "onednn")
    unknown = subprocess.run(
        [sys.executable, "-c", RUN, llama_dir], capture_output=True, text=True, timeout=600,
        env={**os.environ, "BATCHGEN_LIBRARY_KERNELS": "rms_norm,warp_drive"},
    )
    assert unknown.returncode != 0 and "BATCHGEN_LIBRARY_KERNELS: unknown kernel warp_drive" in unknown.stderr
