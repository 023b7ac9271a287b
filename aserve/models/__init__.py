"""aserve.models: model families, the architecture registry and the weight loader."""

from __future__ import annotations

from aserve.models.arch_config import ModelArchConfig
from aserve.models.loader import effective_max_model_len, load_model

__all__ = ["ModelArchConfig", "effective_max_model_len", "load_model"]
