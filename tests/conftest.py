"""Session-wide fixtures: tiny HF model directories built once per (arch, overrides), and the C++
CPU kernels, built on first use by the tests that ask for them (never at collection).

This file imports neither torch nor transformers, so `pytest tests/core` runs without them
(tests/core/test_torch_free.py checks it); whatever needs torch imports it when it runs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Test modules that must import without torch: they are collected without the Triton check below.
TORCH_FREE = (TESTS / "core", TESTS / "test_layering.py", TESTS / "test_layout.py")


def _default_triton_interpret() -> None:
    """Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be set
    before any `@triton.jit` decorates one, i.e. before a test module imports aserve.kernels."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent):
    """Runs before each test module is imported."""
    path = module_path.resolve()
    if not any(path == p or p in path.parents for p in TORCH_FREE):
        _default_triton_interpret()
    return None  # pytest's own Module collector


def pytest_collection_modifyitems(items) -> None:
    """Every test under tests/parallel starts ranks (worker processes): mark it `spawns`."""
    for item in items:
        if TESTS / "parallel" in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.spawns)


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory) -> Callable[..., Path]:
    """`factory(arch="llama", **overrides) -> Path`, cached per (arch, overrides) for the session.

    Overrides are those of `make_hf_model` (config keys, `max_shard_size`, `seed`).
    """
    from helpers.hf_models import make_hf_model

    root = tmp_path_factory.mktemp("hf_models")
    cache: dict[str, Path] = {}

    def factory(arch: str = "llama", **overrides) -> Path:
        key = f"{arch}:{sorted(overrides.items())!r}"
        if key not in cache:
            name = f"{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            cache[key] = make_hf_model(root / name, arch, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama")


@pytest.fixture(scope="session")
def mistral_dir(model_dir_factory) -> Path:
    return model_dir_factory("mistral")


@pytest.fixture(scope="session")
def qwen2_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen3")


@pytest.fixture(scope="session")
def sliding_dir_factory(model_dir_factory) -> Callable[[str], Path]:
    """`factory(name) -> Path` for a model of `helpers.hf_models.SLIDING_CASES` (sliding-window
    and hybrid models whose windows bite in the tests)."""
    from helpers.hf_models import SLIDING_CASES

    def factory(name: str) -> Path:
        arch, overrides = SLIDING_CASES[name]
        return model_dir_factory(arch, **overrides)

    return factory


@pytest.fixture(scope="session")
def moe_dir_factory(model_dir_factory) -> Callable[..., Path]:
    """`factory(name, **extra) -> Path` for a model of `helpers.hf_models.MOE_CASES`."""
    from helpers.hf_models import MOE_CASES

    def factory(name: str, **extra) -> Path:
        arch, overrides = MOE_CASES[name]
        return model_dir_factory(arch, **overrides, **extra)

    return factory


@pytest.fixture(scope="session")
def gemma2_dir(sliding_dir_factory) -> Path:
    return sliding_dir_factory("gemma2")


@pytest.fixture(scope="session")
def gemma3_dir(sliding_dir_factory) -> Path:
    return sliding_dir_factory("gemma3")


@pytest.fixture(scope="session")
def gemma3_mm_dir(sliding_dir_factory) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (tiny vision tower) around gemma3's text."""
    return sliding_dir_factory("gemma3-mm")


# The C++ CPU extension compiles on first use (tens of seconds, then cached under the torch
# extensions dir). These fixtures build it when the first test that needs it runs and skip that
# test where it cannot be built; a module-level `skipif(load...())` would build it at collection.


@pytest.fixture(scope="session")
def cpu_attention_kernel():
    """The C++ paged-attention kernel module (`paged_attention_cpu.load_kernel()`)."""
    from aserve.kernels.paged_attention_cpu import load_kernel

    kernel = load_kernel()
    if kernel is None:
        pytest.skip("the C++ CPU kernels cannot be built here (no C++ toolchain)")
    return kernel


@pytest.fixture(scope="session")
def cpu_elementwise_kernels() -> None:
    """aserve's fused C++ CPU ops (rms_norm, rope, silu_and_mul, argmax) are built."""
    from aserve.kernels import cpu_elementwise

    if not cpu_elementwise.load():
        pytest.skip("the fused C++ CPU ops cannot be built here")


@pytest.fixture(scope="session")
def cpu_layer_kernel() -> None:
    """The whole decoder layer's C++ call runs here: aserve's packed GEMM and its attention rows
    (AVX-512's tiles, or AVX2's), and the batch-invariant kernels around them."""
    import torch

    from aserve.kernels import cpu_extension, cpu_gemm

    module = cpu_extension.load()
    if not cpu_gemm.available() or not module.rows_supported(
            torch.empty(1, 1, 64, dtype=torch.bfloat16)):
        pytest.skip("aserve's packed GEMM and attention rows are not built here")


@pytest.fixture(scope="session")
def cpu_gemm_kernel() -> None:
    """aserve's AVX512-BF16 GEMM (and the batch-invariant kernels around it, the fused MoE, the
    whole-layer call) is built."""
    from aserve.kernels import cpu_gemm

    if not cpu_gemm.avx512():
        pytest.skip("aserve's AVX512-BF16 GEMM is not built here (no AVX512-BF16 or toolchain)")
