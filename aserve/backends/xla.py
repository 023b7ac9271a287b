"""The XLA platform: TPUs (or other PJRT accelerators) through torch_xla.

torch_xla is imported lazily, inside `probe()` and the methods, never at module import: importing
`aserve.backends` must not pull it in. PJRT gives each process one device, so a rank's device is
whatever the runtime assigned to its process. Attention runs the torch reference kernels.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from aserve.backends.base import Platform, Probe


def _xla_model() -> ModuleType:
    import torch_xla.core.xla_model as xm

    return xm


class XlaPlatform(Platform):
    """One PJRT accelerator device per process; collectives through the "xla" backend."""

    name = "xla"
    dist_backend = "xla"
    attention_backend = "ref"

    @staticmethod
    def probe() -> Probe:
        """Available when torch_xla imports and PJRT names an accelerator (not CPU) device type.

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
            return Probe(False, "torch_xla found no accelerator (PJRT_DEVICE unset, no TPU)")
        if kind.upper() == "CPU":
            return Probe(False, "torch_xla's PJRT device is CPU, not an accelerator "
                                "(use --device cpu)")
        return Probe(True, f"torch_xla PJRT device {kind}")

    def device_for_rank(self, local_rank: int) -> torch.device:
        import torch_xla

        if hasattr(torch_xla, "device"):
            return torch.device(torch_xla.device())
        return torch.device(_xla_model().xla_device())

    def mem_info(self, device: torch.device | None = None) -> tuple[int, int]:
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
        xm = _xla_model()
        xm.mark_step()  # cut the lazy graph so that the queued work is launched
        xm.wait_device_ops()

    def seed_everything(self, seed: int) -> None:
        super().seed_everything(seed)
        _xla_model().set_rng_state(seed)
