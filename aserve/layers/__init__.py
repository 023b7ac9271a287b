"""aserve.layers: tensor-parallel-ready building blocks that model files are made of. Each runs
its kernels through the `KernelOps` bound by `bind_ops` (see `bind.py`)."""

from __future__ import annotations

from aserve.layers.activation import SiluAndMul
from aserve.layers.attention import Attention, AttentionMetadata
from aserve.layers.bind import OpsLayer, bind_ops
from aserve.layers.embedding import LMHead, VocabEmbedding
from aserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention", "AttentionMetadata", "ColumnParallelLinear", "LMHead",
    "MergedColumnParallelLinear", "OpsLayer", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear",
    "RotaryEmbedding", "RowParallelLinear", "SiluAndMul", "VocabEmbedding", "bind_ops",
    "get_rope",
]
