"""Build a model from an HF directory: config.json -> `ModelArchConfig` -> model class on the
device in the chosen dtype -> safetensors weights streamed tensor by tensor through each
parameter's `weight_loader` (the model's `checkpoint_prefixes` table renames or skips name
prefixes, e.g. a multimodal checkpoint's text tower; its packed-modules table renames q/k/v and
gate/up).

Reads only local files (no hub downloads). Checkpoints: `model.safetensors`, the shards named
by `model.safetensors.index.json`, or every `*.safetensors` in the directory; or the GGUF file a
GGUF model's directory links to (`gguf_checkpoint.py`), dequantized to the model's dtype, with
how to read each weight's integers kept beside it for a platform's integer GEMM
(`quantization.int_weights`).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from aserve.config import ModelConfig
from aserve.distributed import get_tp_size
from aserve.layers.linear import load_into
from aserve.layers.moe import FusedMoE, expert_target
from aserve.models.arch_config import ModelArchConfig
from aserve.models.causal_lm import CausalLM
from aserve.models.gguf_checkpoint import GGUFCheckpoint
from aserve.models.registry import get_model_class
from aserve.quantization import QUANTIZATION_ALIASES, int_weights
from aserve.quantization.gguf_file import LINK_NAME as GGUF_LINK
from aserve.quantization.hf_checkpoint import QuantizedCheckpoint

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def load_model(model_config: ModelConfig, device: torch.device | str = "cpu",
               quantized_float16_as: torch.dtype | None = None
               ) -> tuple[nn.Module, ModelArchConfig]:
    """The model (eval mode, weights loaded) and its normalised architecture config.
    `quantized_float16_as`: the platform's dtype for a quantized checkpoint whose config says
    float16, under --dtype auto (`Platform.quantized_float16_as`)."""
    model_dir = Path(model_config.model)
    arch = read_arch_config(model_dir)
    effective_max_model_len(arch, model_config.max_model_len)  # refuses one too long
    model_cls = get_model_class(arch.architecture)
    config = _read_json(model_dir / "config.json")
    check_requested_quantization(model_config.quantization, config)
    source = quantization_source(config)
    dtype = resolve_dtype(model_config.dtype, arch)
    if (model_config.dtype == "auto" and dtype == torch.float16 and source is not None
            and quantized_float16_as is not None and not model_config.dequantize):
        dtype = quantized_float16_as
        logger.info("a quantized checkpoint runs in %s on this platform (config.json says "
                    "float16; --dtype float16 keeps it)", str(dtype).removeprefix("torch."))
    with default_dtype(dtype), torch.device(device):
        model = model_cls(arch, lm_head=model_config.pooler is None)
    quantization = config.get("quantization_config")
    load_weights(model, weight_files(model_dir), arch.tie_word_embeddings, quantization,
                 keep_integers=not model_config.dequantize)
    if source is not None:
        if "gguf" in config:
            source = source.replace("GGUF", f"GGUF {config['gguf']['file']}", 1)
        kept = ("" if model_config.dequantize or dtype == torch.float32 else
                ", where no integer GEMM keeps the integers")
        logger.info("weights: %s, dequantized to %s at load%s", source,
                    str(dtype).split(".")[-1], kept)
    return model.eval(), replace(arch, dtype=dtype)  # the dtype it runs in, not config.json's


def check_requested_quantization(requested: str | None, config: dict[str, Any]) -> None:
    """`--quantization` against the checkpoint: ValueError where they differ, or where a name
    is given for a float checkpoint (vLLM would quantize it at load; aserve does not)."""
    if requested is None:
        return
    quant = config.get("quantization_config")
    method = "gguf" if config.get("gguf") else (quant or {}).get("quant_method")
    if method is None:
        raise ValueError(f"--quantization {requested}: the checkpoint is not quantized, and "
                         "aserve does not quantize float weights at load.")
    if QUANTIZATION_ALIASES.get(requested, requested) != method:
        raise ValueError(f"--quantization {requested} does not match the checkpoint's "
                         f"quantization method {method!r}.")


def quantization_source(config: dict[str, Any]) -> str | None:
    """What a model directory's config.json says its checkpoint is quantized as: "gptq", or
    a GGUF's tensor types; None for a float checkpoint."""
    quantization, gguf = config.get("quantization_config"), config.get("gguf")
    if quantization:
        return str(quantization.get("quant_method"))
    if gguf:
        return "GGUF (" + ", ".join(f"{n} x{c}" for n, c in gguf["tensor_types"].items()) + ")"
    return None


def describe_quantization(model: nn.Module, model_dir: str | Path, dtype: torch.dtype
                          ) -> str | None:
    """What quantization runs (/v1/models says it): the checkpoint's, and how its linear
    weights run once bound: integer GEMMs (each packed weight's `quantization`, counted) or
    dequantized to `dtype`. None for a float checkpoint."""
    source = quantization_source(_read_json(Path(model_dir) / "config.json"))
    if source is None:
        return None
    kinds = Counter(q for m in model.modules()
                    if (q := getattr(getattr(m, "packed_weight", None), "quantization", None)))
    name = str(dtype).removeprefix("torch.")
    if not kinds:
        return f"{source}; dequantized to {name}"
    return (f"{source}; integer GEMM: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
            + f" linear weights, the rest {name}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} in {path.parent} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} in {path.parent} is not a JSON object.")
    return data


def read_arch_config(model_dir: Path) -> ModelArchConfig:
    """Parse config.json (required) and generation_config.json (optional) of `model_dir`."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist.")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in model directory {model_dir}.")
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    try:
        return ModelArchConfig.from_hf(_read_json(config_path), gen)
    except KeyError as e:
        raise ValueError(f"config.json in {model_dir} lacks required key {e}.") from None


def effective_max_model_len(arch: ModelArchConfig, requested: int | None) -> int:
    """`requested`, or the model's max_position_embeddings when None; never longer than it."""
    if requested is None:
        return arch.max_position_embeddings
    if requested < 1:
        raise ValueError(f"max_model_len must be at least 1, got {requested}.")
    if requested > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the model's "
                         f"max_position_embeddings ({arch.max_position_embeddings}).")
    return requested


def resolve_dtype(name: str, arch: ModelArchConfig) -> torch.dtype:
    """"auto" follows config.json (float32 when it names none); else a float dtype name."""
    if name == "auto":
        return arch.dtype or torch.float32
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 "
                         "or float16.")
    return _DTYPE_NAMES[name]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under `dtype` as torch's default (parameters made empty take it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def weight_files(model_dir: Path) -> list[Path]:
    gguf = model_dir / GGUF_LINK
    if gguf.exists():
        return [gguf]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}.")
    return files


def _renamed(name: str, prefixes: dict[str, str | None]) -> str | None:
    """A checkpoint name under the model's names (`checkpoint_prefixes`); None: skip it."""
    for prefix, replacement in prefixes.items():
        if name.startswith(prefix):
            return None if replacement is None else replacement + name[len(prefix):]
    return name


def packed_target(name: str, packed: dict[str, tuple[str, str | int]]
                  ) -> tuple[str, str | int | None]:
    """Checkpoint name -> (parameter name, shard id or None)."""
    for module, (packed_module, shard_id) in packed.items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{packed_module}."), shard_id
    return name, None


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name after the model's regex renames (`checkpoint_renames`)."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name


def _expected_names(model: CausalLM, packed: dict[str, tuple[str, str | int]]) -> set[str]:
    """Checkpoint names the model needs: its parameter names with packed modules unpacked
    (expert parameters aside: their `FusedMoE` accounts for them, `missing_weights`)."""
    experts = {name for prefix, module in model.named_modules() if isinstance(module, FusedMoE)
               for name in (f"{prefix}.{local}" for local, _ in module.named_parameters())}
    names = set()
    for name, _ in model.named_parameters():
        if name in experts:
            continue
        sources = [name.replace(f".{p}.", f".{m}.") for m, (p, _) in packed.items()
                   if f".{p}." in name]
        names.update(sources or [name])
    return names


def _missing(model: CausalLM, packed: dict[str, tuple[str, str | int]],
             loaded: set[str]) -> list[str]:
    missing = sorted(_expected_names(model, packed) - loaded)
    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE):
            missing += module.missing_weights(prefix.removesuffix(".experts"))
    return missing


def load_weights(model: CausalLM, files: list[Path], tied: bool,
                 quantization: dict[str, Any] | None = None, keep_integers: bool = True) -> None:
    """Stream every tensor of `files` into `model`; error naming any weight left unloaded.
    A quantized checkpoint (`quantization`: its config's `quantization_config`) is read as
    the float one it stands for (`QuantizedCheckpoint`), across all its files at once (a
    weight's scales may sit in another shard). `keep_integers`: where the checkpoint holds a
    weight as integers, how to read them stays on its parameter (`_keep_int_source`).

    A name is renamed (prefixes, then the model's regex renames), then matched as an expert
    tensor (`expert_target`: only this rank's experts are read) before the packed-module
    renames, so `experts.{e}.gate_proj` is an expert's and `mlp.gate_proj` the dense MLP's.
    """
    packed = model.packed_modules
    prefixes = {**model.checkpoint_prefixes, **model.bare_prefixes}
    renames, owns = model.checkpoint_renames, model.owns_weight  # (another stage's: skipped)
    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    for path, opener in _checkpoints(files, quantization):
        with opener() as f:
            for stored in f.keys():
                name = _renamed(stored, prefixes)
                if name is None:
                    continue
                name = _rename(name, renames)
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                if not owns(name):
                    continue
                expert = expert_target(name)
                if expert is not None and expert[0] in params:
                    _load_expert(params[expert[0]], f, stored, expert, path)
                    if keep_integers and expert[2] is not None:  # one expert's whole tensor
                        _keep_int_source(params[expert[0]], f, stored, expert[1:])
                    continue
                target, shard_id = packed_target(name, packed)
                if target not in params:
                    unexpected.append(name)
                    continue
                param = params[target]
                try:
                    load_into(param, f.get_tensor(stored), shard_id)
                except ValueError as e:
                    raise ValueError(f"cannot load weight {stored} from {path.name}: {e}"
                                     ) from None
                if keep_integers:
                    _keep_int_source(param, f, stored, shard_id)
                loaded.add(name)
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use: %s",
                       len(unexpected), ", ".join(unexpected[:8]))
    missing = _missing(model, packed, loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing[:8])}.")


def _keep_int_source(param: nn.Parameter, f, stored: str, shard_id) -> None:
    """Where the checkpoint holds `stored` as integers (`int_weight_source`: a GGUF's quant
    types), record how to read them on the parameter (`int_weights.attach`), for a platform
    whose integer kernels pack it when the model is bound. Whole weights only (no tensor
    parallelism): a rank's rows or columns would need their groups cut to match."""
    source = getattr(f, "int_weight_source", None)
    if source is None or get_tp_size() != 1:
        return
    read = source(stored)
    if read is not None:
        int_weights.attach(param, shard_id, read)


def _checkpoints(files: list[Path], quantization: dict[str, Any] | None):
    """(a path to name in errors, an opener of its tensors) for each checkpoint to read: each
    safetensors file, a GGUF (`GGUFCheckpoint`: HF's names, dequantized), or a quantized HF
    checkpoint's files together."""
    if quantization:
        return [(files[0].parent, lambda: QuantizedCheckpoint(files, quantization))]
    return [(path, lambda path=path: open_checkpoint(path)) for path in files]


def open_checkpoint(path: Path):
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    return safe_open(str(path), framework="pt", device="cpu")


def _load_expert(param: nn.Parameter, f, stored: str, target: tuple[str, str, int | None],
                 path: Path) -> None:
    """One expert tensor, if this rank holds the expert; a fused one, this rank's slice."""
    _, kind, expert = target
    experts = param.expert_range
    if expert is not None and expert not in experts:
        return  # another expert-parallel rank's: not read
    try:
        if expert is None:
            tensor = f.get_slice(stored)[experts.start:experts.stop]
        else:
            tensor = f.get_tensor(stored)
        param.weight_loader(param, tensor, (kind, expert))
    except ValueError as e:
        raise ValueError(f"cannot load weight {stored} from {path.name}: {e}") from None
