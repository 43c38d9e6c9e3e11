"""A regular (not editable) install of batchgen beside Hugging Face's ``kernels`` package, which
transformers 5.25 and later require: ``import kernels`` is Hugging Face's, transformers loads a
model, and batchgen generates on its compiled CPU path with its kernel sources found in the
installed package. The wheel is built from this checkout and installed into a folder of its own
that leads ``sys.path`` in a process started outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.metadata, pathlib, sys
target = pathlib.Path(sys.argv[1]).resolve()
model = sys.argv[2]
import kernels
where = pathlib.Path(kernels.__file__).resolve()
assert target not in where.parents and where.parent.name == "kernels", where
assert importlib.metadata.version("kernels"), "Hugging Face's kernels is not installed"
import batchgen, batchgen_kernels
from batchgen_kernels import cpu
for mod in (batchgen, batchgen_kernels):
    assert target in pathlib.Path(mod.__file__).resolve().parents, mod.__file__
for src in cpu.SOURCES + cpu.HEADERS:
    assert src.exists() and target in src.resolve().parents, src
import torch
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
prompt = [1, 5, 9, 14, 20]
want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 5:].tolist()
from batchgen import LLM, SamplingParams
llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=32)
got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
assert got == want, (got, want)
print("linear_backend", llm.stats()["linear_backend"])
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """batchgen's wheel, built without build isolation (no download) from a copy of the sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "batchgen", src / "batchgen", ignore=ignore)
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=ignore)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = (tmp / "dist").glob("batchgen-*.whl")
    return whl


def install(wheel: Path, target: Path) -> dict[str, str]:
    """Install the wheel alone into ``target``; the environment of a process that imports it first."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return {**os.environ, "PYTHONPATH": str(target)}


def test_the_wheel_installs_no_top_level_kernels(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"batchgen", "batchgen_kernels"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "batchgen_kernels/cpu_gemm.cpp" in names and "batchgen_kernels/cpu_simd.h" in names


def test_installed_batchgen_beside_hugging_faces_kernels(wheel, llama_dir, tmp_path):
    pytest.importorskip("kernels", reason="Hugging Face's kernels is a test dependency")
    target = tmp_path / "site"
    env = install(wheel, target)
    res = subprocess.run(
        [sys.executable, "-c", CHECK, str(target), llama_dir],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "linear_backend cpu" in res.stdout, res.stdout


def test_the_wheel_ships_no_test_fixtures(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "batchgen/tiny.py" in names  # ``demo`` and ``make-model`` build their models with it
    assert not [n for n in names if "tiny_quant" in n or "fixtures" in n or n.startswith("tests/")], names


def test_demo_and_make_model_run_from_the_installed_wheel(wheel, tmp_path):
    """``batchgen make-model`` and ``batchgen demo`` from the wheel alone, outside the checkout."""
    env = install(wheel, tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    res = subprocess.run([sys.executable, "-m", "batchgen", "make-model", "m", "--arch", "qwen3"],
                         capture_output=True, text=True, timeout=600, cwd=work, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (work / "m" / "config.json").is_file() and list((work / "m").glob("*.safetensors")), res.stdout
    res = subprocess.run([sys.executable, "-m", "batchgen", "demo"], capture_output=True, text=True, timeout=1200,
                         cwd=work, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    import pyarrow.parquet as pq

    rows = pq.read_table(work / "out" / "demo").to_pylist()
    assert len(rows) == 64 and sum(r["error"] is not None for r in rows) == 4, res.stdout
    assert "batchgen job report" in res.stdout
