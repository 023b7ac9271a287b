"""tests/core runs without torch: the root conftest, the helpers the core tests use and aserve.core
import neither torch nor transformers (so `pytest tests/core` is quick and checks the layering)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent
ROOT = CORE.parents[1]

# Runs pytest in-process in a fresh interpreter over tests/core (but this module), then says
# which of the heavy modules ended up imported.
SCRIPT = f"""
import sys
import pytest
code = pytest.main([{str(CORE)!r}, "-q", "-p", "no:cacheprovider",
                    "--ignore", {str(Path(__file__).resolve())!r}])
print("IMPORTED", sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
sys.exit(int(code))
"""


@pytest.mark.spawns
def test_core_tests_run_without_importing_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "IMPORTED []" in result.stdout, result.stdout[-3000:]
