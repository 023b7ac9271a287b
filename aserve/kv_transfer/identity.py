"""`kv_cache_key`: what a KV block's bytes depend on, as one hex digest.

Two instances may exchange K/V only when their keys are equal: the same weights and config
(the model's identity), dtype, block size, tensor-parallel layout (kv heads per rank) and KV
cache groups (layer windows). The shared store keeps blocks under this key and checks it on
every load; a peer-to-peer consumer checks the producer's before it pulls.

The model's identity is read from its files, not its path: config.json whole, and each
*.safetensors file's name, size and first and last 64 KiB (its header, and weights enough to
tell two random-weight checkpoints of one config apart) — cheap at any model size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

_SAMPLE = 1 << 16


def model_identity(model_dir: str | Path) -> str:
    """The digest of a model directory's config and weight files (see the module doc)."""
    root = Path(model_dir)
    digest = hashlib.sha256(b"aserve.model.v1")
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def kv_cache_key(model_dir: str | Path, dtype: str, block_size: int, tp_size: int,
                 num_kv_heads: int, head_dim: int,
                 layer_windows: Sequence[int | None]) -> str:
    """The key of this engine's KV blocks (32 hex digits)."""
    parts = (model_identity(model_dir), dtype, block_size, tp_size, num_kv_heads, head_dim,
             tuple(layer_windows))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
