"""aserve.layers: tensor-parallel-ready building blocks that model files are made of. Each runs
its kernels through the `KernelOps` bound by `bind_ops` (see `bind.py`)."""

from __future__ import annotations

from aserve.layers.activation import GeluTanhAndMul, SiluAndMul
from aserve.layers.attention import Attention, AttentionMetadata
from aserve.layers.bind import OpsLayer, bind_ops
from aserve.layers.decoder_stack import DecoderStack
from aserve.layers.embedding import LMHead, ScaledVocabEmbedding, VocabEmbedding
from aserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from aserve.layers.norm import GemmaRMSNorm, RMSNorm
from aserve.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention", "AttentionMetadata", "ColumnParallelLinear", "DecoderStack", "GeluTanhAndMul",
    "GemmaRMSNorm", "LMHead", "MergedColumnParallelLinear", "OpsLayer", "QKVParallelLinear",
    "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear",
    "ScaledVocabEmbedding", "SiluAndMul", "VocabEmbedding", "bind_ops", "get_rope",
]
