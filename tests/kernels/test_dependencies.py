"""A CPU-only install has no Triton (1 GB nothing on a CPU uses; a GPU build of torch brings its
own): pyproject's dependencies leave it to the test extra, and every `import triton` in aserve
sits in a `try` that catches ImportError, so the package imports and serves without it."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_triton_is_not_a_runtime_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["test"])


def test_every_triton_import_is_guarded():
    unguarded = []
    for path in sorted((ROOT / "aserve").rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    h.type is not None and "ImportError" in ast.unparse(h.type)
                    for h in node.handlers):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "triton" for n in names) and id(node) not in guarded:
                unguarded.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unguarded == []
