"""The C++ extension compiles for CPUs other than this one: code outside an instruction set's
`#ifdef` that names something only that block defines breaks every other host's build, and
then aserve silently runs its torch references there (it happened: every AVX2-only host lost
every C++ kernel). A syntax-only compile (templates instantiated, no code generated) per
target, ~1 minute each on 2 cores: the default suite checks the AVX2 build (x86-64-v3: AMD Zen
2 / 3, the portable tiles of gemm_avx2.h / qgemm_avx2.h) where this host builds AVX-512; the
other targets, and the GEMM tests run against the AVX2 tiles on an AVX-512 host, when
ASERVE_TEST_BUILDS=1 (minutes more)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import pytest

from aserve.kernels import cpu_extension, cpu_gemm

TARGETS = {
    "avx2": ["-march=x86-64-v3"],  # AVX2 + FMA + F16C, no AVX-512
    "avx512-no-bf16": ["-march=skylake-avx512"],  # AVX-512 attention, AVX2 GEMM tiles
    "amx": ["-march=sapphirerapids"],  # AVX512-BF16 / VNNI GEMMs and AMX tiles
    "scalar": ["-march=x86-64"],  # no AVX at all: every kernel's scalar loop
}


def compile_for(flags: list[str]) -> subprocess.CompletedProcess:
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    return subprocess.run(
        ["g++", "-fsyntax-only", "-std=c++20", "-fopenmp", *flags,
         "-DTORCH_EXTENSION_NAME=syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
         f"-I{cpu_extension.CSRC}", *includes, str(cpu_extension.TRANSLATION_UNIT)],
        capture_output=True, text=True, timeout=600)


def _skip_unless_x86_gxx() -> None:
    if shutil.which("g++") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs g++ on Linux")
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")


def _skip_unless_asked() -> None:
    import os

    if os.environ.get("ASERVE_TEST_BUILDS") != "1":
        pytest.skip("ASERVE_TEST_BUILDS=1 runs it (minutes)")


@pytest.mark.parametrize("target", [
    pytest.param(t, marks=() if t == "avx2" else pytest.mark.slow) for t in TARGETS])
def test_the_extension_compiles_for(target):
    _skip_unless_x86_gxx()
    if target != "avx2":
        _skip_unless_asked()
    if target == "avx2" and cpu_gemm.isa() == "avx2":
        pytest.skip("this host's own build is the AVX2 one")
    done = compile_for(TARGETS[target])
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) or done.stderr[-4000:]


@pytest.mark.slow
def test_the_avx2_tiles_pass_the_gemm_tests_on_an_avx512_host():
    """Where this host builds AVX-512, the AVX2 tiles never run in the suite: build them
    (ASERVE_CPU_CFLAGS' -march comes after -march=native, so it wins) and run the GEMM tests
    against them in a process of their own (~3 minutes)."""
    import os

    _skip_unless_x86_gxx()
    _skip_unless_asked()
    if cpu_gemm.isa() != "avx512":
        pytest.skip("this host's own build is not the AVX-512 one")
    env = {**os.environ, cpu_extension.EXTRA_CFLAGS_ENV: "-march=x86-64-v3"}
    code = ("from aserve.kernels import cpu_gemm, cpu_qgemm; "
            "assert cpu_gemm.isa() == cpu_qgemm.isa() == 'avx2', cpu_gemm.isa()")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=900)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_cpu_qgemm.py", "tests/kernels/test_kernels_cpu.py", "-k", "gemm"],
        env=env, capture_output=True, text=True, timeout=1800,
        cwd=cpu_extension.CSRC.parents[2])
    assert done.returncode == 0, done.stdout[-4000:]
