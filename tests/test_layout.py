"""The layout of tests/, checked on the source with `ast`: test modules live in a folder named
after what they test (an aserve package, or parallel / benchmarks / xla), their names are unique
(pytest imports them by basename), shared code lives in tests/helpers/ and no test module imports
another test module or a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ASERVE = TESTS.parent / "aserve"
ROOT_TESTS = {"test_layering.py", "test_layout.py"}  # architecture tests, about the whole tree
OTHER_FOLDERS = {"parallel", "benchmarks", "xla"}  # distributed + executor, benchmarks/, torch_xla
PACKAGES = {p.name for p in ASERVE.iterdir() if (p / "__init__.py").exists()}


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def all_test_modules() -> list[Path]:
    return [p for p in python_files() if p.name.startswith("test_")]


def test_every_test_module_lives_in_a_package_folder():
    misplaced = []
    for path in all_test_modules():
        rel = path.relative_to(TESTS)
        if len(rel.parts) == 1:
            ok = rel.name in ROOT_TESTS
        else:
            ok = len(rel.parts) == 2 and rel.parts[0] in PACKAGES | OTHER_FOLDERS
        if not ok:
            misplaced.append(str(rel))
    assert not misplaced, f"test modules outside tests/<package>/: {misplaced}"


def test_test_module_names_are_unique():
    seen: dict[str, list[str]] = {}
    for path in all_test_modules():
        seen.setdefault(path.stem, []).append(str(path.relative_to(TESTS)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def test_only_helpers_conftests_and_test_modules():
    """Shared code is in tests/helpers/ (not a test module next to its users)."""
    others = [str(p.relative_to(TESTS)) for p in python_files()
              if not p.name.startswith("test_") and p.name not in {"conftest.py", "__init__.py"}
              and p.relative_to(TESTS).parts[0] != "helpers"]
    assert not others, f"move these to tests/helpers/: {others}"
    named_as_tests = [str(p.relative_to(TESTS)) for p in (TESTS / "helpers").rglob("test_*.py")]
    assert not named_as_tests, f"helpers that look like test modules: {named_as_tests}"


def imported_test_modules(path: Path) -> list[str]:
    """The test modules and conftests that `path` imports (absolute or relative)."""
    def is_test_module(name: str) -> bool:
        return any(part.startswith("test_") or part == "conftest" for part in name.split("."))

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if is_test_module(module):
                found.append(module)
            elif node.level:  # from . import test_x
                found += [alias.name for alias in node.names if is_test_module(alias.name)]
    return found


def test_no_module_imports_a_test_module_or_a_conftest():
    offenders = {str(p.relative_to(TESTS)): names for p in python_files()
                 if (names := imported_test_modules(p))}
    assert not offenders, f"import these from tests/helpers/ instead: {offenders}"


def test_the_import_checker_catches_each_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import test_a\nfrom conftest import serving\nfrom server.test_cli import x\n"
                      "from . import test_b\nfrom helpers.server import serving\nimport testing\n")
    assert imported_test_modules(sample) == ["test_a", "conftest", "server.test_cli", "test_b"]
