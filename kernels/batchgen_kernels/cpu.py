"""The compiled CPU kernels (``cpu_attention.cpp``: paged decode attention; ``cpu_prefill.cpp``:
prefill attention; ``cpu_sampling.cpp``: the sampler's fused full-vocabulary passes;
``cpu_ops.cpp``: RMSNorm, SwiGLU and rotary embeddings in one pass each, the KV-cache store;
``cpu_beam.cpp``: beam search's candidate step; ``cpu_gemm.cpp``: linear layers on packed
weights; headers ``cpu_simd.h``, vector helpers, and ``cpu_amx.h``, attention on AMX tiles for the
decode and prefill kernels), built into one shared library at first use.

The library is compiled with the system C++ compiler (``$CXX``, else g++, c++ or clang++; no
Python headers, no downloads; one object file per source, as many at once as there are CPUs, then
one link: about 10 seconds on 2 cores) into ``$BATCHGEN_CACHE`` (default ``~/.cache/batchgen``),
under a name keyed by the sources, the flags and the compiler, and loaded with ctypes. It links
OpenMP by soname, so it shares torch's OpenMP runtime (one thread pool). Where it cannot be built,
``load`` raises ``KernelUnavailable`` and callers keep their torch code, which stays the reference.

On x86-64 the sources build into one of several instruction-set variants (``VARIANTS``: avx2,
avx512, avx512_bf16, amx; ``default`` has none of them), each with its own ``-m`` flags; the
variant is chosen at run time, the best one this CPU's features allow.
``BATCHGEN_CPU_CAPABILITY=<variant>`` forces a lower one (as ``ATEN_CPU_CAPABILITY`` does
torch's), which is how the tests run every variant a CPU can execute. Elsewhere (aarch64) the one
variant is ``native``, built with ``-march=native``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [
    HERE / f"{name}.cpp"
    for name in ("cpu_attention", "cpu_prefill", "cpu_sampling", "cpu_ops", "cpu_beam", "cpu_gemm")
]
HEADERS = [HERE / "cpu_simd.h", HERE / "cpu_amx.h", HERE / "cpu_intrin.h"]
# -Wno-psabi: GCC notes that 64-byte vectors pass differently without AVX-512; the helpers taking
# them are inline and never cross the library's C entry points
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]
WARNINGS = ["-Wall", "-Wextra", "-Werror"]  # what tests/kernels/test_variants.py builds every variant with

_AVX2 = (["-mavx2", "-mfma", "-mf16c"], ["avx2", "fma", "f16c"])
_AVX512 = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"], ["avx512f", "avx512bw", "avx512vl", "avx512dq"])
_BF16 = (["-mavx512bf16"], ["avx512_bf16"])
_AMX = (["-mamx-tile", "-mamx-bf16", "-mamx-int8"], ["amx_tile", "amx_bf16", "amx_int8"])


def _variant(*parts: tuple[list[str], list[str]]) -> tuple[list[str], list[str]]:
    return [f for p in parts for f in p[0]], [f for p in parts for f in p[1]]


# x86-64 instruction-set variants, lowest first: name -> (compiler flags, /proc/cpuinfo features needed)
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "default": ([], []),
    "avx2": _variant(_AVX2),
    "avx512": _variant(_AVX2, _AVX512),
    "avx512_bf16": _variant(_AVX2, _AVX512, _BF16),
    "amx": _variant(_AVX2, _AVX512, _BF16, _AMX),
}
NATIVE: dict[str, tuple[list[str], list[str]]] = {"native": (["-march=native"], [])}  # other architectures: what the compiler sees here

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# q, k, v, tables, width, context lengths, rows, heads, kv_heads, dim, num_blocks, block_size, scale,
# window, softcap, sinks, out, threads, share (rows with common first blocks together)
_DECODE = [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _P, _P, _INT, _INT]
SIGNATURES = {
    "paged_decode_f32": (_INT, _DECODE),
    "paged_decode_bf16": (_INT, _DECODE),
    "paged_decode_bf16_widened": (_INT, _DECODE),
    "paged_decode_bf16_dot": (_INT, _DECODE),
    "bf16_dot_products": (_INT, []),
    "amx_tiles": (_INT, []),
    # adjusted, raw, rows, vocab, inv_temp, block, probs, block_sums, raw_lse, threads
    "tempered_softmax": (_INT, [_P, _P, _I, _I, _P, _I, _P, _P, _P, _INT]),
    # probs, vocab, row_index, n, threshold, out, threads
    "mass_above": (None, [_P, _I, _P, _I, _P, _P, _INT]),
    # adjusted, raw, rows, vocab, inv_temp, top_p, seeds, counters, rounds, block, bitmask, words,
    # mask_vocab, masked, token, logprob, rejected, threads
    "sample_rows": (_INT, [_P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I, _P, _P, _P, _P, _INT]),
    # adjusted, raw, rows, vocab, bitmask, words, mask_vocab, masked, token, raw_lse, threads
    "greedy_pick": (None, [_P, _P, _I, _I, _P, _I, _I, _P, _P, _P, _INT]),
    # logits, row stride, vocab, bitmask, words, row_index, n, threads
    "token_mask": (None, [_P, _I, _I, _P, _I, _P, _I, _INT]),
    # x, w, rows, dim, eps, out, threads
    "rms_norm_f32": (None, [_P, _P, _I, _I, _F, _P, _INT]),
    "rms_norm_bf16": (None, [_P, _P, _I, _I, _F, _P, _INT]),
    "add_rms_norm_f32": (None, [_P, _P, _P, _I, _I, _F, _P, _P, _INT]),
    "add_rms_norm_bf16": (None, [_P, _P, _P, _I, _I, _F, _P, _P, _INT]),
    # gate_up, rows, inter, out, threads
    "silu_mul_f32": (None, [_P, _I, _I, _P, _INT]),
    "silu_mul_bf16": (None, [_P, _I, _I, _P, _INT]),
    # x, rows, dim, out, threads
    "round_tokens_int8_f32": (None, [_P, _I, _I, _P, _INT]),
    "round_tokens_int8_bf16": (None, [_P, _I, _I, _P, _INT]),
    # k, k token stride, v, v token stride, k_cache, v_cache, slots, tokens, kv_heads, bytes, slots per head
    "kv_write": (_INT, [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I]),
    # cache, planes, blocks per plane, bytes per block, src, dst, pairs, threads
    "copy_blocks": (_INT, [_P, _I, _I, _I, _P, _P, _I, _INT]),
    # cache, planes, blocks per plane, bytes per block, ids, count, threads
    "zero_blocks": (_INT, [_P, _I, _I, _I, _P, _I, _INT]),
    # x, x token stride, cos, sin, tokens, heads, dim, out, threads
    "rotary_f32": (None, [_P, _I, _P, _P, _I, _I, _I, _P, _INT]),
    "rotary_bf16": (None, [_P, _I, _P, _P, _I, _I, _I, _P, _INT]),
    # q, k, v, table, n, ctx, heads, kv_heads, dim, num_blocks, block_size, scale, out, threads
    "prefill_bf16": (_INT, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _INT]),
    "prefill_f32": (_INT, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _INT]),
    "prefill_bf16_amx": (_INT, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _INT]),
    "prefill_bf16_amx_chunks": (_INT, [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _INT]),
    # logits, vocab, rows, running, groups, k, keep, scores, index, threads
    "beam_topk_f32": (_INT, [_P, _I, _P, _P, _I, _I, _I, _P, _P, _INT]),
    # on: 1 / 0 sets whether bf16 GEMMs run on AMX tiles, -1 asks; returns whether they do
    "gemm_amx": (_INT, [_INT]),
    # w, n, k, out
    "gemm_pack_f32": (_INT, [_P, _I, _I, _P]),
    "gemm_pack_bf16": (_INT, [_P, _I, _I, _P]),
    # x, x row stride, m, k, packed w, n, bias (float32 or null), y, y row stride, threads
    "gemm_f32": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT]),
    "gemm_bf16": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT]),
    "gemm_bf16_widened": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT]),
    # w (FP8 or int8 bytes), n, k, out
    "gemm_pack_bytes": (_INT, [_P, _I, _I, _P]),
    # int8 w, n, k, out (W8A8 on AMX-INT8 tiles; gemm_amx_int8: whether they run)
    "gemm_pack_int8_tiles": (_INT, [_P, _I, _I, _P]),
    "gemm_amx_int8": (_INT, []),
    # blocks, exponents, n, k, out, scales
    "gemm_pack_mxfp4": (_INT, [_P, _P, _I, _I, _P, _P]),
    # x, x row stride, m, k, packed w, n, scales (float32), bias (float32 or null), y, y row stride, threads
    **{f"gemm_{kind}_{dtype}": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _P, _I, _INT])
       for kind in ("fp8", "int8", "mxfp4", "w8a8_amx") for dtype in ("f32", "bf16")},
    # int4 codes (bytes), n, k, offset (0: unsigned codes, 8: signed), out
    "gemm_pack_int4": (_INT, [_P, _I, _I, _INT, _P]),
    # x, x row stride, m, k, int4 codes, n, scales, zero points, group, bias, y, y row stride, threads
    "gemm_int4_amx_bf16": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _P, _P, _I, _INT]),
    # the same with the scales' group (block-wise FP8) after the scales
    **{f"gemm_fp8_block_{dtype}": (_INT, [_P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _I, _INT]) for dtype in ("f32", "bf16")},
    "gemm_gated_f32": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT]),
    "gemm_gated_bf16": (_INT, [_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT]),
    # x, tokens, d, top_k, chosen, weights, experts, gate_up, gate_up bias, down, down bias, inter, out, threads
    "moe_experts_f32": (_INT, [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _I, _P, _INT]),
    "moe_experts_bf16": (_INT, [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _I, _P, _INT]),
}


# The compiled kernels a process can send to the library path they replace, with that path:
# ``BATCHGEN_LIBRARY_KERNELS=rms_norm,beam_topk`` (names from here) runs those on the library
# instead. scripts/kernel_ablation.py measures each kernel's gain this way (docs/kernels.md).
# The GEMM and attention kernels have engine settings for it (linear_backend, attention_backend).
LIBRARY_ALTERNATIVES = {
    "rms_norm": "F.rms_norm, after torch's residual addition",
    "rotary": "torch's elementwise rotary embedding",
    "silu_mul": "F.silu(gate) * up",
    "kv_write": "index_copy_ into the caches",
    "block_ops": "index_copy_ / zero_ on the cache's blocks",
    "sampling": "torch's softmax, sort and multinomial",
    "beam_topk": "log_softmax, then torch.topk",
    "token_mask": "xgrammar's apply_token_bitmask_inplace (structured outputs' mask)",
    "int8_gemm": "torch._weight_int8pack_mm, W8A8's activations rounded by torch (int8 and W8A8 checkpoints)",
    "int4_gemm": "torch._weight_int4pack_mm_for_cpu (int4 checkpoints in bf16 on a CPU with AMX)",
}


@functools.cache  # read once per process: the call sites ask at every step
def library_kernels() -> frozenset[str]:
    """The kernels ``BATCHGEN_LIBRARY_KERNELS`` sends to their library path; an unknown name raises."""
    names = frozenset(n.strip() for n in os.environ.get("BATCHGEN_LIBRARY_KERNELS", "").split(",") if n.strip())
    unknown = names - LIBRARY_ALTERNATIVES.keys()
    if unknown:
        raise ValueError(
            f"BATCHGEN_LIBRARY_KERNELS: unknown kernel {', '.join(sorted(unknown))} "
            f"(one of {', '.join(LIBRARY_ALTERNATIVES)})"
        )
    return names


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here (no compiler, a failed compile)."""


def cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen")
    return Path(root) / "kernels"


def cpu_features() -> set[str]:
    """This CPU's feature flags, as Linux lists them in ``/proc/cpuinfo``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def variants() -> dict[str, tuple[list[str], list[str]]]:
    """The variants this architecture has, lowest first."""
    return VARIANTS if platform.machine() in ("x86_64", "AMD64") else NATIVE


def runnable_variants() -> list[str]:
    """The variants this CPU can execute, lowest first."""
    features = cpu_features()
    return [name for name, (_, needs) in variants().items() if set(needs) <= features]


# oneDNN's and ATen's caps (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) for a CPU of each variant
LIBRARY_CAPS = {
    "default": ("SSE41", "default"),
    "avx2": ("AVX2", "avx2"),
    "avx512": ("AVX512_CORE", "avx512"),
    "avx512_bf16": ("AVX512_CORE_BF16", "avx512"),
    "amx": ("ALL", "avx512"),
}


def emulation_env(name: str) -> dict[str, str]:
    """The environment that makes this process stand in for a CPU of variant ``name``: the kernels
    forced to it, and torch's oneDNN and ATen kernels capped at the same instruction set (so that
    ``batchgen.utils.has_amx`` and the engine's choices follow). ``.ci/run`` runs the suite so on
    every variant this CPU executes; ``python -m batchgen_kernels.cpu --env avx2`` prints it."""
    if name not in variants():
        raise KernelUnavailable(f"{name!r} is not a variant here (one of {', '.join(variants())})")
    env = {"BATCHGEN_CPU_CAPABILITY": name}
    if name in LIBRARY_CAPS:
        env["ONEDNN_MAX_CPU_ISA"], env["ATEN_CPU_CAPABILITY"] = LIBRARY_CAPS[name]
    return env


def chosen_variant() -> str:
    """The variant ``load`` builds: the best this CPU runs, or ``BATCHGEN_CPU_CAPABILITY``'s."""
    runnable = runnable_variants()
    forced = os.environ.get("BATCHGEN_CPU_CAPABILITY", "").strip().lower()
    if not forced:
        return runnable[-1]
    if forced not in variants():
        raise KernelUnavailable(
            f"BATCHGEN_CPU_CAPABILITY={forced!r} is not a variant here (one of {', '.join(variants())})"
        )
    if forced not in runnable:
        raise KernelUnavailable(
            f"BATCHGEN_CPU_CAPABILITY={forced!r}: this CPU lacks "
            f"{', '.join(sorted(set(variants()[forced][1]) - cpu_features()))}"
        )
    return forced


def variant_flags(name: str) -> list[str]:
    """The compiler flags of variant ``name``; with ``BATCHGEN_KERNEL_DEBUG=1``, a build that also
    checks each entry point's preconditions (``BG_EXPECT``) and aborts naming a failed one."""
    debug = ["-DBATCHGEN_DEBUG"] if os.environ.get("BATCHGEN_KERNEL_DEBUG") == "1" else []
    return [*FLAGS, *variants()[name][0], *debug]


def compile_library(compiler: str, flags: list[str], out: Path) -> None:
    """Each source into an object file, as many at once as there are CPUs (the attention kernel's
    source alone takes most of the time), then one link into ``out``."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    objects = [out.with_name(f"{out.name}.{os.getpid()}.{src.stem}.o") for src in SOURCES]
    compile_flags = [f for f in flags if f != "-shared"]
    commands = [
        [compiler, *compile_flags, "-c", str(src), "-o", str(obj)]
        for src, obj in zip(SOURCES, objects, strict=True)
    ]
    commands.append([compiler, *flags, *map(str, objects), "-o", str(tmp)])  # the link, after them
    try:
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            failures = [f for f in pool.map(_run, commands[:-1]) if f]
        if not failures:
            link = _run(commands[-1])
            failures = [link] if link else []
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)
    if failures:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(failures[0])
    os.replace(tmp, out)  # atomic: concurrent first uses each compile, one file wins


def _run(cmd: list[str]) -> str | None:
    """None when ``cmd`` succeeds, else what went wrong."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(cmd)}: {e}"
    if done.returncode != 0:
        return f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}"
    return None


_lib: ctypes.CDLL | None = None
_error: KernelUnavailable | None = None


def load() -> ctypes.CDLL:
    """The compiled library, built on first use; ``KernelUnavailable`` (remembered) where it cannot be."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise _error
    try:
        _lib = _build_and_load()
    except KernelUnavailable as e:
        _error = e
        raise
    return _lib


def available() -> bool:
    if _lib is not None:  # the per-call fast path
        return True
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def compiler() -> str | None:
    """``$CXX``, else the first of g++, c++, clang++ on PATH; None when there is none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in names:
        if shutil.which(name):
            return name
    return None


def _build_and_load() -> ctypes.CDLL:
    global variant
    compiler_name = compiler()
    if compiler_name is None:
        raise KernelUnavailable("no C++ compiler on PATH (g++, c++ or clang++; or set CXX)")
    version = subprocess.run([compiler_name, "--version"], capture_output=True, text=True).stdout
    text = [p.read_text() for p in SOURCES + HEADERS]
    name = chosen_variant()
    flags = variant_flags(name)
    key = hashlib.sha256("\0".join([*text, *flags, version, platform.machine()]).encode())
    tag = "-debug" if "-DBATCHGEN_DEBUG" in flags else ""
    path = cache_dir() / f"batchgen_cpu-{name}{tag}-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            compile_library(compiler_name, flags, path)
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"{path}: {e}") from e
    for fn_name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.restype = restype
        fn.argtypes = argtypes
    variant = name
    return lib


variant: str | None = None  # the variant loaded, once ``load`` has built it


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m batchgen_kernels.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", metavar="VARIANT", required=True, help="print emulation_env(VARIANT) as NAME=value words")
    print(*(f"{k}={v}" for k, v in emulation_env(parser.parse_args().env).items()))
