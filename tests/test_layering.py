"""The import direction of docs/design.md §3, checked on the source with `ast`: the table is
read from the design doc itself (one source of truth), and `layers`, `models` and `runner` never
branch on a device nor call `torch.ops.mkldnn`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "aserve"
DESIGN = ROOT.parent / "docs" / "design.md"
SHARED = {"config", "sampling_params", "pooling_params", "assets"}  # dataclasses, data


def design_table(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """(package -> what it may import, the packages marked *no torch*) from the design doc's
    "Packages and who may import whom" table."""
    section = text.split("## 3. Packages and who may import whom", 1)[1].split("\n## ", 1)[0]
    allowed, no_torch = {}, set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`\w+`", cells[0]):
            continue
        package = cells[0].strip("`")
        allowed[package] = set(re.findall(r"`([\w.]+)`", cells[2]))
        if "*no torch*" in cells[1]:
            no_torch.add(package)
    return allowed, no_torch


ALLOWED, NO_TORCH = design_table(DESIGN.read_text())


def test_the_design_table_names_every_package():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if not p.stem.startswith("_")}
    assert packages <= set(ALLOWED), packages - set(ALLOWED)
    assert {"core", "server", "config"} <= NO_TORCH
    assert ALLOWED["layers"] == {"backends.ops", "distributed", "quantization.int_weights"}


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


def test_the_core_depends_on_the_connector_protocol_not_on_kv_transfer():
    """The engine injects the KV connector; the core knows only `core/kv_connector.py`'s
    protocol, and the connectors reach the core and nothing above it."""
    assert ALLOWED["core"] == set() and ALLOWED["kv_transfer"] == {"core"}
    for path in sorted((ROOT / "core").rglob("*.py")):
        assert not [n for n in imports_of(path) if n.startswith("aserve.kv_transfer")], path


def test_packages_import_only_what_design_allows():
    assert violations() == []


def test_checker_catches_a_forbidden_import(tmp_path, monkeypatch):
    bad = tmp_path / "aserve" / "core"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("import torch\nfrom aserve.runner import worker\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "aserve")
    assert len(violations()) == 2


DEVICE_NEUTRAL = ("runner", "models", "layers")  # kernels come from `self.ops` / the platform
DEVICE_NAMES = {"cuda", "cpu", "xla", "hip", "rocm", "mps"}


def device_branches(root: Path) -> list[str]:
    """`torch.cuda` / `torch_xla` uses, `.is_cuda`, `torch.ops.mkldnn`, and comparisons with a
    device name."""
    found = []
    for package in DEVICE_NEUTRAL:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute) and node.attr in ("cuda", "is_cuda", "hip",
                                                                     "mkldnn"):
                    found.append(f"{where} uses .{node.attr}")
                elif isinstance(node, ast.Name) and node.id == "torch_xla":
                    found.append(f"{where} uses torch_xla")
                elif isinstance(node, ast.Compare):
                    names = {c.value for c in [node.left, *node.comparators]
                             if isinstance(c, ast.Constant)}
                    if names & DEVICE_NAMES:
                        found.append(f"{where} compares with a device name")
    return found


def test_runner_models_and_layers_never_branch_on_the_device():
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
        "d = t.is_cuda\n"
        "e = torch.ops.mkldnn._linear_pointwise\n")
    (tmp_path / "aserve" / "layers").mkdir()
    assert len(device_branches(tmp_path / "aserve")) == 5


def test_native_code_lives_in_source_files_not_in_python_strings():
    """C++ is in aserve/kernels/csrc/*.h|cpp, built with cpp_extension.load(sources=...)."""
    offenders = [str(p) for p in ROOT.rglob("*.py")
                 if re.search(r"load_inline|#include\s*<|TORCH_CHECK\(|PYBIND11_MODULE",
                              p.read_text())]
    assert offenders == []
    assert (ROOT / "kernels" / "csrc" / "cpu_kernels.cpp").exists()
