"""The README and docs/ as a reader meets them: the README stays short, every relative link
resolves (file and heading), and every repository path that the docs or the code cite exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [p for d in ("batchgen", "kernels", "scripts", "tests", "jobs") for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".cpp", ".h", ".sh", ".yaml")]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:batchgen|kernels|scripts|tests|jobs|docs)/[\w./-]*\w)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_cited_repository_paths_exist():
    missing = set()
    for path in DOCS + CODE:
        for cited in PATH.findall(path.read_text(errors="replace")):
            cited = cited.rstrip(".")
            if any(c in cited for c in "*{}") or re.search(r"[A-Z]{3,}", cited):
                continue  # a pattern or a placeholder (part-NNNNNN, OUT/...)
            if cited.startswith("kernels/__init__"):
                continue  # cited as what must not exist (tests/test_architecture.py)
            if not (ROOT / cited).exists():
                missing.add(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, sorted(missing)
