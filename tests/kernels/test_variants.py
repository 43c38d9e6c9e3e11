"""The instruction-set variants of the compiled CPU kernels.

Every variant builds warning-free (``-Wall -Wextra -Werror``), the ones this CPU cannot execute
included, so that a build break in any of them fails CI: about three minutes on 2 cores, so
``.ci/run`` runs it (``BATCHGEN_BUILD_VARIANTS=1``) beside the suite. ``.ci/run`` also runs the
engine's, model's and kernels' tests once more as on a CPU of each lower variant this CPU executes
(``cpu.emulation_env``). Here: the variant loaded is the best this CPU executes, or the forced one;
a variant that cannot run is refused by name; the emulated CPU's torch kernels and AMX test follow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchgen_kernels import cpu

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler")


@pytest.mark.skipif(
    not os.environ.get("BATCHGEN_BUILD_VARIANTS"), reason="every variant's -Werror build runs in .ci/run"
)
@pytest.mark.parametrize("name", list(cpu.variants()))
def test_every_variant_builds_with_warnings_as_errors(name, tmp_path):
    out = tmp_path / f"{name}.so"
    cpu.compile_library(cpu.compiler(), [*cpu.variant_flags(name), *cpu.WARNINGS], out)
    assert out.stat().st_size > 0


@pytest.mark.skipif(
    not os.environ.get("BATCHGEN_BUILD_VARIANTS") or "avx2" not in cpu.variants(),
    reason="every variant's -Werror build runs in .ci/run",
)
def test_the_halves_through_memory_build_with_warnings_as_errors(tmp_path):
    """cpu_simd.h's 8-lane halves without __builtin_shufflevector (compilers before GCC 12)."""
    out = tmp_path / "avx2-no-shufflevector.so"
    flags = [*cpu.variant_flags("avx2"), "-DBATCHGEN_NO_SHUFFLEVECTOR", *cpu.WARNINGS]
    cpu.compile_library(cpu.compiler(), flags, out)
    assert out.stat().st_size > 0


def test_the_variant_loaded_is_the_forced_one_else_the_best_this_cpu_runs():
    runnable = cpu.runnable_variants()
    assert runnable[0] in ("default", "native")
    cpu.load()
    assert cpu.variant == (os.environ.get("BATCHGEN_CPU_CAPABILITY") or runnable[-1])


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )


def test_a_variant_this_cpu_lacks_or_an_unknown_one_is_refused_by_name():
    code = "from batchgen_kernels import cpu\ntry:\n    cpu.load()\nexcept cpu.KernelUnavailable as e:\n    print(e)\n"
    unknown = run_python(code, BATCHGEN_CPU_CAPABILITY="avx9")
    assert "BATCHGEN_CPU_CAPABILITY='avx9' is not a variant here" in unknown.stdout, unknown.stderr
    missing = [name for name in cpu.variants() if name not in cpu.runnable_variants()]
    if missing:
        lacking = run_python(code, BATCHGEN_CPU_CAPABILITY=missing[-1])
        assert f"BATCHGEN_CPU_CAPABILITY={missing[-1]!r}: this CPU lacks" in lacking.stdout, lacking.stderr


@pytest.mark.parametrize("name", ["default", "avx512_bf16"])
def test_the_emulated_cpu_loads_its_variant_and_caps_torch_at_it(name):
    if name not in cpu.runnable_variants():
        pytest.skip(f"this CPU does not execute {name}")
    code = (
        "import torch\nfrom batchgen_kernels import cpu\nfrom batchgen.utils import has_amx\n"
        "cpu.load()\nprint(cpu.variant, torch.backends.cpu.get_cpu_capability(), has_amx())"
    )
    res = run_python(code, **cpu.emulation_env(name))
    assert res.returncode == 0, res.stderr
    # ATen's name for its baseline: "DEFAULT" ("NO AVX" in older releases, torch 2.6 among them)
    aten = {"default": ["DEFAULT", "NO AVX"], "avx512_bf16": ["AVX512"]}[name]
    words = res.stdout.split()
    assert words[0] == name and " ".join(words[1:-1]) in aten and words[-1] == "False", res.stdout
