"""Which runner serves a model (`--runner auto | generate | pooling`, vLLM's flag), read from
the model directory alone (torch-free: the CLI decides before anything loads).

    auto ─ sentence-transformers modules.json with a Pooling module ─┐
         ─ config.json architectures[0] a bare decoder (`*Model`) ───┴─► pooling
         ─ otherwise ───────────────────────────────────────────────────► generate

A pooling model's defaults (`PoolerConfig`) come from its `Pooling` module's config.json
(`pooling_mode_lasttoken` → LAST, `pooling_mode_mean_tokens` → MEAN, `pooling_mode_cls_token`
→ CLS) and whether a `Normalize` module follows it; without sentence-transformers config
they are vLLM's for decoders: the last token, normalised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aserve.config import BARE_DECODERS, RUNNERS, PoolerConfig

_ST = "sentence_transformers.models."
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # what aserve runs of a pipeline


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None


def architecture_of(model_dir: Path) -> str | None:
    """config.json's first architecture (None: no config.json, or none named)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    archs = _read_json(path).get("architectures") or [None]
    return archs[0]


def sentence_transformers_pooler(model_dir: Path) -> PoolerConfig | None:
    """The `PoolerConfig` a sentence-transformers directory's modules.json describes (None:
    none, or no Pooling module); ValueError for modules or modes aserve does not run."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{path} is not a list of modules.")
    kinds = {str(m.get("type", "")).removeprefix(_ST): m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None
    others = sorted(set(kinds) - set(_ST_MODULES))
    if others:
        raise ValueError(f"sentence-transformers module(s) {', '.join(others)} in {path} are not "
                         f"supported (aserve runs {', '.join(_ST_MODULES)}).")
    config = _read_json(model_dir / pooling.get("path", "") / "config.json")
    used = [key for key in (*_ST_MODES, *_ST_UNSUPPORTED_MODES) if config.get(key)]
    if len(used) != 1 or used[0] not in _ST_MODES:
        raise ValueError(f"the Pooling module of {model_dir} sets {used or 'no mode'}; aserve "
                         f"pools with exactly one of {', '.join(_ST_MODES)}.")
    return PoolerConfig(_ST_MODES[used[0]], normalize="Normalize" in kinds)


def choose_pooler(model: str, runner: str) -> PoolerConfig | None:
    """The pooling runner's defaults when `runner` (auto resolved from the directory) pools
    `model`; None: the generate runner. ValueError for an unknown runner, or a bare decoder
    (no LM head) asked to generate."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    model_dir = Path(model or "")
    if not model or not model_dir.is_dir():  # (a GGUF file's directory is made later: a causal LM)
        if runner == "pooling":
            return PoolerConfig()
        return None
    architecture = architecture_of(model_dir)
    st_pooler = sentence_transformers_pooler(model_dir)
    bare = architecture in BARE_DECODERS
    if runner == "generate" and bare:
        raise ValueError(f"{architecture} is a bare decoder without an LM head: it cannot "
                         "generate. Serve it with --runner pooling (embeddings, score, rerank).")
    if runner == "generate" or (runner == "auto" and st_pooler is None and not bare):
        return None
    return st_pooler or PoolerConfig()
