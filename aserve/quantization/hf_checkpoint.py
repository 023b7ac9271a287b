"""A quantized HF checkpoint seen as the float one it stands for (the float reference path:
weights dequantized at load into the model's dtype). `quantization_config` names the method,
as vLLM's `--quantization` does:

    fp8                  `X.weight` float8 (e4m3 / e5m2) and `X.weight_scale_inv` per
                         `weight_block_size` block (DeepSeek / Qwen3-FP8), or `X.weight_scale`
                         per tensor or per output channel
    compressed-tensors   float-quantized (FP8 W8A8 / W8A16) and int-quantized (int8 W8A8 /
                         W8A16): `X.weight` with `X.weight_scale` (tensor, channel or group) and
                         an optional `X.weight_zero_point`; pack-quantized (W4A16 / W8A16):
                         `X.weight_packed` int32 words of 32 / bits values along the input,
                         stored unsigned (offset 2 ** (bits - 1)), `X.weight_scale` per group,
                         `X.weight_shape`
    gptq / awq           `X.qweight`, `X.qzeros`, `X.scales` (`X.g_idx`): `awq_gptq.py`

Activation scales (`X.input_scale`), KV-cache scales and a packed tensor's companions are read
with their weight, not as weights of their own. A method, format or bit width outside these is
a ValueError naming it, before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aserve.quantization.awq_gptq import (
    AWQ_BITS,
    GPTQ_BITS,
    GroupedCodes,
    awq_codes,
    gptq_codes,
    gptq_zero_offset,
)
from aserve.quantization.int_weights import IntWeight

METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
COMPANIONS = ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
              "input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale",
              "qzeros", "scales", "g_idx")
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


def check_quantization(quant: Any) -> str:
    """The method of a `quantization_config` aserve can dequantize; ValueError naming what it
    cannot (a method, a compressed-tensors format, a bit width)."""
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object, got {type(quant).__name__}.")
    method = quant.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is not supported (supported: "
                         f"{', '.join(METHODS)}).")
    if method == "compressed-tensors":
        fmt = quant.get("format")
        if fmt not in CT_FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                             f"(supported: {', '.join(CT_FORMATS)}).")
        for group in (quant.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if fmt == "pack-quantized" and weights.get("num_bits") not in (4, 8):
                raise ValueError(f"compressed-tensors pack-quantized weights of "
                                 f"{weights.get('num_bits')} bits are not supported (4, 8).")
    allowed = {"gptq": GPTQ_BITS, "awq": AWQ_BITS}.get(method)
    if allowed and quant.get("bits", 4) not in allowed:
        raise ValueError(f"{method} with {quant.get('bits')} bits is not supported "
                         f"({', '.join(map(str, allowed))}).")
    if method == "gptq":
        gptq_zero_offset(quant.get("checkpoint_format"))  # (a format it does not know: named)
    return method


class QuantizedCheckpoint:
    """Every tensor of `files` under the float model's names (`keys()`), a quantized weight
    dequantized by `get_tensor` (float32); `get_slice` is `get_tensor`."""

    def __init__(self, files: list[Path], quant: dict[str, Any]) -> None:
        self.method = check_quantization(quant)
        self.quant = quant
        groups = [g for g in (quant.get("config_groups") or {}).values() if g]
        self.packed_bits = int(((groups[0] if groups else {}).get("weights") or {}).get(
            "num_bits", 4))
        self.files = files
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}

    def __enter__(self) -> QuantizedCheckpoint:
        for path in self.files:
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[path] = handle.__enter__()
            for name in self._handles[path].keys():
                self._where[name] = path
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _raw(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def _has(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterator[str]:
        for name in self._where:
            module, _, leaf = name.rpartition(".")
            if leaf in COMPANIONS:
                continue
            if leaf in ("weight_packed", "qweight"):
                yield f"{module}.weight"
            else:
                yield name

    def get_tensor(self, name: str) -> torch.Tensor:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and self._has(f"{module}.qweight"):
            return self._gptq_awq(module)
        if leaf == "weight" and self._has(f"{module}.weight_packed"):
            return self._packed(module)
        tensor = self._raw(name)
        if leaf == "weight" and tensor.element_size() == 1:  # fp8 or int8
            return self._scaled(module, tensor)
        return tensor

    get_slice = get_tensor

    # ----------------------------------------------------------------------------- methods

    def _scaled(self, module: str, weight: torch.Tensor) -> torch.Tensor:
        """An 8-bit weight (fp8 or int8) times its scale: per tensor, per output channel, per
        group of the input, or per `weight_block_size` block."""
        for leaf in ("weight_scale_inv", "weight_scale"):
            if self._has(f"{module}.{leaf}"):
                scale = self._raw(f"{module}.{leaf}").float()
                break
        else:
            raise ValueError(f"{module}.weight is {weight.dtype} but has no weight_scale.")
        values = weight.float()
        if self._has(f"{module}.weight_zero_point"):
            zero = self._raw(f"{module}.weight_zero_point").float()
            values = values - _expand(zero, values.shape, module)
        return values * _expand(scale, values.shape, module)

    def _packed(self, module: str) -> torch.Tensor:
        """compressed-tensors pack-quantized: unsigned codes, offset 2 ** (bits - 1)."""
        codes = self._packed_codes(module).float() - (1 << (self.packed_bits - 1))
        scale = self._raw(f"{module}.weight_scale").float()
        return codes * _expand(scale, codes.shape, module)

    def _packed_codes(self, module: str) -> torch.Tensor:
        """A pack-quantized weight's unsigned codes [rows, cols] (int32)."""
        packed = self._raw(f"{module}.weight_packed")
        rows, cols = (int(n) for n in self._raw(f"{module}.weight_shape").tolist())
        bits = self.packed_bits
        per_word = 32 // bits
        if packed.shape != (rows, math.ceil(cols / per_word)):
            raise ValueError(f"{module}.weight_packed is {tuple(packed.shape)}, not the "
                             f"{bits}-bit packing of a {rows} x {cols} weight.")
        shifts = torch.arange(per_word, dtype=torch.int32) * bits
        codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        if self._has(f"{module}.weight_zero_point"):
            raise ValueError(f"{module}: asymmetric pack-quantized weights are not supported.")
        return codes.reshape(rows, -1)[:, :cols]

    # ------------------------------------------------------------------ the integer forms

    def int_weight_source(self, name: str) -> Callable[[], IntWeight | None] | None:
        """How to read `name`'s integer form (`int_weights.IntWeight`) when a kernel packs it,
        for GPTQ / AWQ, pack-quantized and int8 weights (the tensors it needs are read now:
        the checkpoint closes after loading); None for float and fp8 weights."""
        module, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return None
        if self._has(f"{module}.qweight"):
            return self._gptq_awq_source(module)
        if self._has(f"{module}.weight_packed"):
            codes, bits = self._packed_codes(module), self.packed_bits
            scale = self._raw(f"{module}.weight_scale").float()
            return lambda: _grouped(codes, scale, 1 << (bits - 1), bits)
        if (not self._has(name) or not self._has(f"{module}.weight_scale")
                or self._handles[self._where[name]].get_slice(name).get_dtype() != "I8"):
            return None  # (a float weight is not read twice)
        weight = self._raw(name)
        scale = self._raw(f"{module}.weight_scale").float()
        zero = (self._raw(f"{module}.weight_zero_point").float()
                if self._has(f"{module}.weight_zero_point") else None)
        return lambda: _grouped(weight.to(torch.int32) + 128, scale, 128, 8, zero)

    def _gptq_awq_source(self, module: str) -> Callable[[], IntWeight | None]:
        tensors = self._gptq_awq_tensors(module)  # packed: small to keep until packing
        return lambda: self._gptq_awq_codes(tensors).int_weight()

    def _gptq_awq(self, module: str) -> torch.Tensor:
        return self._gptq_awq_codes(self._gptq_awq_tensors(module)).dequantize()

    def _gptq_awq_tensors(self, module: str) -> dict[str, torch.Tensor]:
        return {leaf: self._raw(f"{module}.{leaf}") for leaf in ("qweight", "qzeros", "scales",
                                                                 "g_idx")
                if self._has(f"{module}.{leaf}")}

    def _gptq_awq_codes(self, t: dict[str, torch.Tensor]) -> GroupedCodes:
        quant = self.quant
        bits, group_size = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
        if self.method == "awq":
            return awq_codes(t["qweight"], t["qzeros"], t["scales"], group_size, bits=bits)
        return gptq_codes(
            t["qweight"], t.get("qzeros"), t["scales"], t.get("g_idx"), bits=bits,
            group_size=group_size, sym=bool(quant.get("sym", True)),
            zero_offset=gptq_zero_offset(quant.get("checkpoint_format")))


def _grouped(codes: torch.Tensor, scale: torch.Tensor, offset: int, bits: int,
             zero: torch.Tensor | None = None) -> IntWeight | None:
    """W = (codes - offset - zero) * scale as an IntWeight, for a scale per tensor, output
    channel or group of the input; None for other shapes (blocks)."""
    rows, cols = codes.shape
    if scale.numel() == 1 or (scale.numel() == rows and scale.dim() <= 2 and
                              (scale.dim() < 2 or scale.shape[1] == 1)):
        scale = scale.reshape(-1, 1).expand(rows, 1)
    if scale.dim() != 2 or scale.shape[0] != rows or cols % scale.shape[1]:
        return None
    shift = torch.full_like(scale, float(offset))
    if zero is not None:  # one per tensor, or one per scale
        if zero.numel() not in (1, scale.numel()):
            return None
        shift = shift + (zero.reshape(()) if zero.numel() == 1 else zero.reshape(scale.shape))
    scale = scale.contiguous()
    return IntWeight(codes.to(torch.uint8).contiguous(), scale, (-scale * shift).contiguous(),
                     cols // scale.shape[1], bits)


def _expand(scale: torch.Tensor, shape: torch.Size, module: str) -> torch.Tensor:
    """A scale (or zero point) broadcast over a weight of `shape` [out, in]: a scalar, one per
    output row, one per group of the input (`[out, in / g]`), or one per block
    (`[ceil(out / b0), ceil(in / b1)]`)."""
    rows, cols = shape
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1):
        if scale.numel() == rows:
            return scale.reshape(rows, 1)
    if scale.dim() == 2:
        out_blocks, in_blocks = scale.shape
        if out_blocks == rows and cols % in_blocks == 0:  # groups along the input
            return scale.repeat_interleave(cols // in_blocks, dim=1)
        b0, b1 = math.ceil(rows / out_blocks), math.ceil(cols / in_blocks)
        if math.ceil(rows / b0) == out_blocks and math.ceil(cols / b1) == in_blocks:
            return (scale.repeat_interleave(b0, dim=0)[:rows]
                    .repeat_interleave(b1, dim=1)[:, :cols])
    raise ValueError(f"{module}: a scale of shape {tuple(scale.shape)} does not fit a weight of "
                     f"shape {tuple(shape)}.")
