"""aserve's C++ CPU extension: one build holding every CPU kernel.

The C++ lives in `aserve/kernels/csrc/`: a header per kernel family (`simd.h`, the AVX-512 helpers
they share; `sinks.h`, the attention sinks' argument; `activation.h`, the gated activations of
`elementwise.h` and `gemm.h`; `paged_decode.h`, `attention_tiles.h`, `attention_rows.h`,
`elementwise.h`, `gemm.h`, `qlayout.h`, `qgemm.h`, `decoder_layer.h`, `moe.h`, `qmoe.h`) and ONE
translation unit, `cpu_kernels.cpp`, that includes them and binds the functions Python calls: a
single build parses torch's headers once, not once per translation unit. `load()` compiles it on
first use (then loads the cached build) with `-march=native`, keyed by the sources, this CPU's
instruction-set flags, torch's version and the compiler flags; without a C++ compiler or ninja,
`load()` is None (one warning) and every caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
TRANSLATION_UNIT = CSRC / "cpu_kernels.cpp"  # includes the headers beside it
EXTENSION = "aserve_cpu_kernels"
# More compiler flags for the build, e.g. "-mno-avx512bf16" or "-mno-avx512f" to build and test
# the fallback paths of a CPU without those instructions (the cache key includes them).
EXTRA_CFLAGS_ENV = "ASERVE_CPU_CFLAGS"

_built: dict[str, object] = {}  # extension name -> module, or None when the build failed


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary may not be on it (pyenv shims
    appear only after a rehash, a venv's bin only when activated)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def _sources_digest() -> bytes:
    """Every file of csrc/, name and contents, sorted by name."""
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.digest()


def load():
    """The one extension of every CPU kernel (compiled on first use, then the cached build), or
    None if it cannot be built here (no compiler or ninja), with one warning. Every kernel call
    asks, so the answer comes from `_built` once known."""
    if EXTENSION in _built:
        return _built[EXTENSION]
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    name, cflags = build_name()
    cached = _is_built(name)
    if not cached:  # the first start says why it is slow (the server's log shows INFO)
        logger.info("Compiling aserve's C++ CPU kernels for this CPU, once (about a minute; "
                    "then cached by torch's extension loader) ...")
    start = time.monotonic()
    try:
        module = load_extension(
            name=name, sources=[str(TRANSLATION_UNIT)],
            extra_include_paths=[str(CSRC)], extra_cflags=cflags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - no compiler / ninja: the references still work
        module = None
        logger.warning("The C++ CPU extension %s could not be built (%s); using the torch "
                       "references instead.", EXTENSION, e)
    if module is not None and not cached:
        logger.info("Compiled aserve's C++ CPU kernels in %.0f s.", time.monotonic() - start)
    _built[EXTENSION] = module
    return module


def build_name() -> tuple[str, list[str]]:
    """The build's name (keyed by the sources, this CPU's flags, torch's version and the
    compiler flags) and its compiler flags."""
    import torch

    cflags = ["-O3", "-march=native", "-fopenmp", *os.environ.get(EXTRA_CFLAGS_ENV, "").split()]
    key = hashlib.sha256(_sources_digest() + (_cpu_flags() + torch.__version__
                                              + " ".join(cflags)).encode()).hexdigest()[:12]
    return f"{EXTENSION}_{key}", cflags


def _is_built(name: str) -> bool:
    """Whether torch's loader has a build of `name` already (then it only loads it)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001 - a private helper: at worst the message is left out
        return True
