"""Device selection: which `Platform` this process runs on.

    select_platform("auto")   ROCm if torch is a HIP build with a visible GPU, else CUDA if
                              torch.cuda.is_available(), else XLA if torch_xla has an
                              accelerator (not its PJRT CPU device), else CPU
    select_platform("cuda")   that platform, or ValueError saying what its probe found
    select_platform("xla")    any PJRT device, the CPU one included

Each adapter's static `probe()` decides availability; selection calls nothing else, so tests
fake a device by replacing probes. Importing this package never imports torch_xla: only the XLA
probe and the XLA adapter's methods do.
"""

from __future__ import annotations

from aserve.backends.base import Platform, Probe
from aserve.backends.cpu import CpuPlatform
from aserve.backends.cuda import CudaPlatform
from aserve.backends.rocm import RocmPlatform
from aserve.backends.xla import XlaPlatform

PLATFORMS: tuple[type[Platform], ...] = (RocmPlatform, CudaPlatform, XlaPlatform, CpuPlatform)
"""Every platform, in the order "auto" tries them."""

DEVICES: tuple[str, ...] = ("auto", *(p.name for p in PLATFORMS))
"""The values `--device` accepts."""

_current: Platform | None = None


def select_platform(device: str = "auto") -> Platform:
    """The platform for `--device`: for "auto" the first one available and auto-selectable,
    else the one named (available is enough).

    Raises ValueError for an unknown name or a named platform that is not available, quoting
    what its probe checked.
    """
    if device == "auto":
        return _first_available()
    by_name = {p.name: p for p in PLATFORMS}
    if device not in by_name:
        raise ValueError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    probe = by_name[device].probe()
    if not probe.available:
        raise ValueError(f"--device {device} is not available: {probe.detail}")
    return by_name[device]()


def _first_available() -> Platform:
    found = []
    for platform in PLATFORMS:
        probe = platform.probe()
        if probe.available and probe.auto_selectable:
            return platform()
        found.append(f"{platform.name}: {probe.detail}")
    raise ValueError("no platform is available: " + "; ".join(found))


def set_platform(platform: Platform | str) -> Platform:
    """Fix this process's platform (an instance, or a `--device` value to select); returns it."""
    global _current
    _current = select_platform(platform) if isinstance(platform, str) else platform
    return _current


def current_platform() -> Platform:
    """The platform set by `set_platform`, or the "auto" choice, made once and remembered."""
    return _current if _current is not None else set_platform("auto")


__all__ = [
    "DEVICES", "PLATFORMS", "CpuPlatform", "CudaPlatform", "Platform", "Probe", "RocmPlatform",
    "XlaPlatform", "current_platform", "select_platform", "set_platform",
]
