"""The import direction of DESIGN.md §2, checked on the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "aserve"
SHARED = {"config", "sampling_params", "assets"}  # frozen dataclasses, package data
ALLOWED = {
    "config": set(),
    "sampling_params": set(),
    "assets": set(),
    "core": set(),
    "kernels": set(),
    "backends": {"kernels"},
    "distributed": {"backends"},
    "layers": {"kernels", "backends", "distributed"},
    "models": {"layers", "distributed", "kernels", "backends"},
    "runner": {"models", "layers", "backends", "distributed", "kernels", "core.outputs"},
    "executor": {"runner", "distributed", "core.outputs"},
    "kv_transfer": {"core"},
    "engine": {"core", "executor"},
    "server": {"engine"},
}
NO_TORCH = {"core", "server", "config", "sampling_params", "assets"}


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def violations() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        package = package_of(path)
        if package not in ALLOWED:
            continue  # aserve/__init__.py, __main__.py: the entry points
        allowed = ALLOWED[package] | SHARED | {package}
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in ("torch", "triton", "torch_xla") and package in NO_TORCH:
                found.append(f"{path.relative_to(ROOT.parent)} imports {name}")
            if top != "aserve" or name == "aserve":
                continue
            target = name.split(".")[1]
            dotted = ".".join(name.split(".")[1:3])
            if target not in allowed and dotted not in allowed:
                found.append(f"{path.relative_to(ROOT.parent)} ({package}) imports {name}")
    return found


def test_packages_import_only_what_design_allows():
    assert violations() == []


def test_checker_catches_a_forbidden_import(tmp_path, monkeypatch):
    bad = tmp_path / "aserve" / "core"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("import torch\nfrom aserve.runner import worker\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "aserve")
    assert len(violations()) == 2


DEVICE_NEUTRAL = ("runner", "models")  # they ask `aserve.backends`, never the device itself
DEVICE_NAMES = {"cuda", "cpu", "xla", "hip", "rocm", "mps"}


def device_branches(root: Path) -> list[str]:
    """`torch.cuda` / `torch_xla` uses, `.is_cuda`, and comparisons with a device name."""
    found = []
    for package in DEVICE_NEUTRAL:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute) and node.attr in ("cuda", "is_cuda", "hip"):
                    found.append(f"{where} uses .{node.attr}")
                elif isinstance(node, ast.Name) and node.id == "torch_xla":
                    found.append(f"{where} uses torch_xla")
                elif isinstance(node, ast.Compare):
                    names = {c.value for c in [node.left, *node.comparators]
                             if isinstance(c, ast.Constant)}
                    if names & DEVICE_NAMES:
                        found.append(f"{where} compares with a device name")
    return found


def test_runner_and_models_never_branch_on_the_device():
    assert device_branches(ROOT) == []


def test_device_branch_checker_catches_each_kind(tmp_path):
    runner = tmp_path / "aserve" / "runner"
    runner.mkdir(parents=True)
    (tmp_path / "aserve" / "models").mkdir()
    (runner / "x.py").write_text(
        "import torch\n"
        "a = torch.cuda.is_available()\n"
        "b = x.device.type == 'cuda'\n"
        "c = 'cpu' != y\n"
        "d = t.is_cuda\n")
    assert len(device_branches(tmp_path / "aserve")) == 4
