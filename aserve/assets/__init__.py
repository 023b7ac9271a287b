"""Package data shipped with aserve: the built-in demo model.

`DEMO_MODEL_DIR` is an ordinary HF model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML chat template, generation_config.json),
loaded through the same path as any other model. It is what `LLM()` and the server run when no
model is named, under the served name `DEMO_MODEL_NAME`. It is a ~3.4M-parameter Llama trained
from scratch by `scripts/train_demo_model.py` on chatterbot-corpus: a demo that answers greetings
in words, not a useful assistant (see its MODEL_CARD.md).

This module imports only the standard library.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "aserve-demo"
DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / DEMO_MODEL_NAME

__all__ = ["DEMO_MODEL_DIR", "DEMO_MODEL_NAME"]
