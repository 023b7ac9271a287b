"""The mixture-of-experts layers: `FusedMoE` (a layer's experts, run by the platform's fused op)
and `SparseMoeBlock` (router + experts + an optional shared expert, the block a model uses).

Placement. Without expert parallelism every rank holds every expert, each sliced like a dense
MLP (gate / up rows and down columns by TP rank), and the partial outputs meet in one
all-reduce. With it (`--enable-expert-parallel`) a rank holds whole experts,
`expert_range(E)` of them, and `expert_map` sends the others' slots nowhere:

```
E = 5 experts, ep = 2            rank 0: experts 0 1 2     rank 1: experts 3 4
expert_map on rank 1:            [-1, -1, -1, 0, 1]        (global id -> local index)
combine "all-reduce":            every rank routes every token; sum of the ranks' partials
combine "all-to-all":            rank r takes its share of the tokens, dispatches each slot to
                                 the expert's rank and gets it back (`distributed.all_to_all`),
                                 then the ranks all-gather the tokens (within the TP group:
                                 under SP the EP group is the whole stage, TP × SP ranks)
```

Loading. One layout on every rank whatever the checkpoint's (`aserve.kernels.moe`): `w13`
[E, 2I, H] as [gate; up] rows, `w2` [E, H, I]. `expert_target` maps checkpoint names onto it —
per-expert tensors (`experts.{e}.w1/w3/w2`, `experts.{e}.gate_proj/up_proj/down_proj`) or
fused 3-D ones (`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]; gpt-oss'
[E, H, 2I] with interleaved gate / up columns and [E, I, H]). The loader reads only this rank's
experts (a fused tensor through its `expert_range` slice).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from aserve.backends.ops import ExpertWeights, FusedMoEFn
from aserve.config import MoEConfig
from aserve.distributed.all_to_all import all_gather_rows, all_to_all_moe, expert_owners
from aserve.distributed.state import (
    expert_range,
    get_ep_size,
    get_moe_combine,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
)
from aserve.layers.bind import OpsLayer, PreparedLayer
from aserve.layers.linear import ReplicatedLinear
from aserve.quantization.int_weights import experts as int_experts
from aserve.quantization.int_weights import release

# checkpoint name -> (parameter, shard kind, expert id or None for a fused tensor)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.(weight|bias)$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down", "gate_up_proj": "gate_up"}


def expert_target(name: str) -> tuple[str, str, int | None] | None:
    """(parameter name, shard kind, expert id or None) for an expert tensor's checkpoint name;
    None for any other tensor. Kinds: gate, up, down (one expert's), gate_up, down (fused)."""
    match = _PER_EXPERT.match(name)
    if match:
        prefix, proj, leaf = match.group(1), _KIND[match.group(3)], match.group(4)
        param = ("w2" if proj == "down" else "w13") + ("_weight" if leaf == "weight" else "_bias")
        return f"{prefix}.{param}", proj, int(match.group(2))
    match = _FUSED.match(name)
    if match:
        prefix, proj = match.group(1), _KIND[match.group(2)]
        param = ("w2" if proj == "down" else "w13") + ("_bias" if match.group(3) else "_weight")
        return f"{prefix}.{param}", proj, None
    return None


class FusedMoE(PreparedLayer):
    """A MoE layer's experts on this rank: (x [T, H], topk_weights [T, k], topk_ids [T, k]) ->
    [T, H], through the bound ops' `fused_moe` (prepared once after loading, `prepare`).

    `forward` returns this rank's PARTIAL sum under the all-reduce combine (the block adds its
    other partial sums and all-reduces them once), the full output under `all_to_all`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 bias: bool = False, activation: str = "silu", alpha: float = 1.702,
                 limit: float | None = None, interleaved_checkpoint: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.interleaved_checkpoint = interleaved_checkpoint  # gpt-oss' fused layout
        self.ep_size = get_ep_size()
        # tokens travel to their experts' ranks and back (set before the model is built)
        self.all_to_all = self.ep_size > 1 and get_moe_combine() == "all-to-all"
        self.tp_rank, self.tp_size = (0, 1) if self.ep_size > 1 else (get_tp_rank(),
                                                                      get_tp_size())
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible "
                             f"by tp {self.tp_size} (expert parallelism keeps experts whole).")
        self.local_experts = expert_range(num_experts)
        num_local, size = len(self.local_experts), intermediate_size // self.tp_size
        self.intermediate_size = size  # this rank's share of each expert
        self.w13_weight = self._param(num_local, 2 * size, hidden_size)
        self.w2_weight = self._param(num_local, hidden_size, size)
        self.w13_bias = self._param(num_local, 2 * size) if bias else None
        self.w2_bias = self._param(num_local, hidden_size) if bias else None
        self.expert_map: torch.Tensor | None = None
        if self.ep_size > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.local_experts.start:self.local_experts.stop] = torch.arange(num_local)
            self.expert_map = expert_map.to(self.w13_weight.device)
        self._loaded: set[tuple[str, int | None]] = set()
        self._run: FusedMoEFn | None = None
        self._owners: torch.Tensor | None = None  # all-to-all: each expert's rank

    def _param(self, *shape: int) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape), requires_grad=False)
        param.weight_loader = self.weight_loader
        param.expert_range = self.local_experts  # the loader reads only these experts
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: tuple[str, int | None]) -> None:
        """One expert's gate / up / down tensor (its global id), or a fused tensor already
        narrowed to this rank's experts (id None)."""
        kind, expert = shard
        is_bias = param is self.w13_bias or param is self.w2_bias
        suffix = "_bias" if is_bias else ""
        if expert is None:
            self._load_fused(param, loaded, kind, is_bias)
            kinds = ("gate", "up") if kind == "gate_up" else (kind,)
            self._loaded.update((k + suffix, e) for k in kinds for e in self.local_experts)
        elif expert in self.local_experts:
            self._load_one(param.data[expert - self.local_experts.start], loaded, kind, is_bias)
            self._loaded.add((kind + suffix, expert))

    def _load_one(self, dst: torch.Tensor, loaded: torch.Tensor, kind: str,
                  is_bias: bool) -> None:
        """One expert: gate / up rows [I, H] (or [I] bias) into dst [2I_tp, ...]'s half, down
        [H, I] (or [H]) into dst [H, I_tp]; narrowed to this TP rank's share."""
        size, rank = self.intermediate_size, self.tp_rank
        if kind == "down":
            if is_bias:
                _copy(dst, loaded)
            else:
                _copy(dst, loaded.narrow(1, rank * size, size))
            return
        offset = 0 if kind == "gate" else size
        _copy(dst.narrow(0, offset, size), loaded.narrow(0, rank * size, size))

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor, kind: str,
                    is_bias: bool) -> None:
        """This rank's experts of a fused tensor, in the checkpoint's layout."""
        if kind == "gate_up":
            if self.interleaved_checkpoint:  # [E, H, 2I] / [E, 2I] with gate, up alternating
                gate, up = loaded[..., 0::2], loaded[..., 1::2]
                if not is_bias:
                    gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            else:  # [E, 2I, H] / [E, 2I]: gate rows then up rows
                gate, up = loaded.chunk(2, dim=1)
            for e in range(param.shape[0]):
                self._load_one(param.data[e], gate[e], "gate", is_bias)
                self._load_one(param.data[e], up[e], "up", is_bias)
            return
        if self.interleaved_checkpoint and not is_bias:  # [E, I, H]
            loaded = loaded.transpose(1, 2)
        for e in range(param.shape[0]):
            self._load_one(param.data[e], loaded[e], "down", is_bias)

    def missing_weights(self, prefix: str) -> list[str]:
        """What this rank's experts still lack after loading, e.g. "<prefix>.experts.3.up"."""
        kinds = ("gate", "up", "down") + (("gate_bias", "up_bias", "down_bias")
                                          if self.w13_bias is not None else ())
        return [f"{prefix}.experts.{e}.{kind}" for kind in kinds for e in self.local_experts
                if (kind, e) not in self._loaded]

    def prepare(self) -> None:
        """Hand the loaded weights to the bound ops' `fused_moe`; where it keeps a packed copy
        of its own (`packed` set on what it returns), the loaded ones are dropped."""
        tp_rank_adds_bias = self.tp_rank == 0
        quantized = int_experts(self.w13_weight, self.w2_weight, self.local_experts)
        self._run = self.ops.fused_moe(ExpertWeights(
            w13=self.w13_weight.data, w2=self.w2_weight.data,
            w13_bias=None if self.w13_bias is None else self.w13_bias.data,
            w2_bias=(self.w2_bias.data if self.w2_bias is not None and tp_rank_adds_bias
                     else None),
            activation=self.activation, alpha=self.alpha, limit=self.limit,
            expert_map=self.expert_map, quantized=quantized))
        release(self.w13_weight)
        release(self.w2_weight)
        if getattr(self._run, "packed", False):
            for param in (self.w13_weight, self.w2_weight):
                param.data = param.data.new_empty(0)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if self._run is None:
            self.prepare()
        if self.all_to_all:
            return self._all_to_all(x, topk_weights, topk_ids)
        return self._run(x, topk_weights, topk_ids)  # [T, H], partial

    def _all_to_all(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """The tokens of this rank's TP group (the same on each of its ranks): each rank takes
        its share, dispatches it over the EP group (the stage: TP × SP ranks), and the shares
        are gathered back within the TP group. Under sequence parallelism the group already
        holds only its own slice of the step's tokens."""
        rank, size, num_tokens = get_tp_rank(), get_tp_size(), x.shape[0]
        bounds = [r * num_tokens // size for r in range(size + 1)]
        mine = slice(bounds[rank], bounds[rank + 1])
        if self._owners is None:
            self._owners = expert_owners(self.num_experts, x.device)
        out = all_to_all_moe(x[mine], topk_weights[mine], topk_ids[mine], self._owners,
                             self._run)
        counts = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        return all_gather_rows(out, counts, get_tp_group())


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint "
                         f"{tuple(src.shape)}.")
    dst.copy_(src)


class SparseMoeBlock(OpsLayer):
    """Router, experts and (Qwen2-MoE) a sigmoid-gated shared expert:

        weights, ids = select_experts(gate(x))      top-k of a float32 softmax (or gpt-oss')
        out = experts(x, weights, ids) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]

    One all-reduce per block: the experts' and the shared expert's partial sums meet in it.
    `shared_expert` is the model's dense MLP class built with `reduce_results=False`.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.scoring, self.renormalize = moe.top_k, moe.scoring, moe.renormalize
        self.round_weights = moe.round_weights
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.intermediate_size,
                                bias=moe.expert_bias, activation=moe.activation,
                                alpha=moe.swiglu_alpha, limit=moe.swiglu_limit,
                                interleaved_checkpoint=moe.interleaved_gate_up)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False)
                                   if shared_expert is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E]
        weights, ids = self.ops.select_experts(
            logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize,
            weights_dtype=x.dtype if self.round_weights else None)  # [T, k] each
        out = self.experts(x, weights, ids)  # [T, H]
        shared = None
        if self.shared_expert is not None:
            shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # partial
        if self.experts.all_to_all:
            return out if shared is None else out + tp_all_reduce(shared)
        return tp_all_reduce(out if shared is None else out + shared)
