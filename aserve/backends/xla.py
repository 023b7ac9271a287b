"""The XLA platform: TPUs (or other PJRT devices, PJRT's CPU device included) through torch_xla.

torch_xla is imported lazily, inside `probe()` and the methods, never at module import: importing
`aserve.backends` must not pull it in. PJRT gives each process one device, so a rank's device is
whatever the runtime assigned to its process. Every kernel is the torch reference (`REF_OPS`);
random draws are made on the host (torch_xla has no `torch.Generator`) and copied over. On
PJRT's CPU device, which only an explicit `--device xla` gets, memory and the KV-cache budget
are the host's.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from aserve.backends.base import Platform, Probe
from aserve.backends.cpu import CpuPlatform


def _xla_model() -> ModuleType:
    import torch_xla.core.xla_model as xm

    return xm


def _pjrt_on_host_cpu() -> bool:
    """Whether torch_xla's PJRT device is the host CPU (False where torch_xla is missing)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    import torch_xla.runtime as xr

    return (xr.device_type() or "").upper() == "CPU"


class XlaPlatform(Platform):
    """One PJRT device per process; collectives through the "xla" backend.

    On PJRT's CPU device, whose allocator keeps no statistics, memory is the host's: `host` (the
    CPU platform, whose files tests replace) answers `mem_info` and the KV-cache budget.
    """

    name = "xla"
    dist_backend = "xla"
    static_shapes = True
    supports_inference_mode = False

    def __init__(self, host: CpuPlatform | None = None) -> None:
        self.host = host if host is not None else CpuPlatform()

    @staticmethod
    def probe() -> Probe:
        """Available when torch_xla imports and PJRT names a device type, CPU included; only an
        accelerator (TPU, CUDA, ...) is auto-selectable: "--device auto" leaves PJRT's CPU
        device, which importing torch_xla picks when nothing else is found, to the CPU platform.

        Reads the device type that importing torch_xla chose (`torch_xla.runtime.device_type()`,
        from PJRT_DEVICE) without starting the runtime, so the probe claims no TPU.
        """
        try:
            if importlib.util.find_spec("torch_xla") is None:
                return Probe(False, "torch_xla is not installed")
            import torch_xla.runtime as xr

            kind = xr.device_type()
        except Exception as e:  # a broken install is "not available", with the reason
            return Probe(False, f"torch_xla failed to load: {type(e).__name__}: {e}")
        if not kind:
            return Probe(False, "torch_xla found no PJRT device (PJRT_DEVICE unset, no TPU)")
        if kind.upper() == "CPU":
            return Probe(True, "torch_xla PJRT device CPU (the host CPU: used for --device xla, "
                               "never picked by --device auto)", auto_selectable=False)
        return Probe(True, f"torch_xla PJRT device {kind}")

    def device_for_rank(self, local_rank: int) -> torch.device:
        import torch_xla

        if hasattr(torch_xla, "device"):
            return torch.device(torch_xla.device())
        return torch.device(_xla_model().xla_device())

    def mem_info(self, device: torch.device | None = None) -> tuple[int, int]:
        if _pjrt_on_host_cpu():
            return self.host.mem_info()
        xm = _xla_model()
        if not hasattr(xm, "get_memory_info"):
            raise RuntimeError("this torch_xla has no xla_model.get_memory_info, so device memory "
                               "cannot be probed: size the KV cache with --kv-cache-memory")
        info = xm.get_memory_info(device)
        if "bytes_limit" in info:
            total = int(info["bytes_limit"])
            return total - int(info["bytes_used"]), total
        if "kb_total" in info:
            return int(info["kb_free"]) * 1024, int(info["kb_total"]) * 1024
        raise RuntimeError(f"xla_model.get_memory_info returned unknown keys {sorted(info)}: "
                           "size the KV cache with --kv-cache-memory")

    def synchronize(self, device: torch.device | None = None) -> None:
        self.mark_step()  # cut the lazy graph so that the queued work is launched
        _xla_model().wait_device_ops()

    def mark_step(self) -> None:
        """Cut the traced graph here: without a cut each step's graph would also hold every
        earlier step's KV-cache writes, and compile ever more slowly."""
        import torch_xla

        if hasattr(torch_xla, "sync"):  # newer torch_xla, which deprecates xm.mark_step
            torch_xla.sync()
        else:
            _xla_model().mark_step()

    def generator_device(self, device: torch.device) -> torch.device:
        """The host: torch_xla has no `torch.Generator` for its devices."""
        return torch.device("cpu")

    def seed_everything(self, seed: int) -> None:
        super().seed_everything(seed)
        _xla_model().set_rng_state(seed)

    def default_kv_cache_bytes(self) -> int | None:
        """On PJRT's CPU device the CPU platform's budget; on an accelerator None (profile)."""
        return self.host.default_kv_cache_bytes() if _pjrt_on_host_cpu() else None
