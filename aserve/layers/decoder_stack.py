"""The decoder stack every model family builds from its own parts: this pipeline stage's share of
the decoder layers, the token embedding where the stage needs it, the final norm on the last.

```
first stage:   ids ─ embed_tokens ─► (hidden, None) ─┐
other stages:  (hidden, residual) from the previous ─┴─► the stage's layers, one after another
                                                         (or the platform's fused call for them)
last stage:    ─► norm(hidden, residual) ─► [T, hidden]      others: (hidden, residual) onward
```

A stage builds only its own layers (`distributed.stage_layers`); the others' indices hold a
`MissingLayer`, so that parameter names stay the checkpoint's. The platform may run the stage's
layers as one call (`backends.ops.fuse_layers`, for layers of the pre-norm form it describes):
`bind_ops` asks for it once, here in `prepare`; `forward` then tries that call first and runs the
layers itself wherever it covers no step (`unfused`: every step).

`capture(layer_ids)` keeps the residual stream entering those layers at every forward, in
`aux_hidden` (an EAGLE-3 head reads them: `models/eagle.py`); the stage's layers then run in
segments between them, each segment the platform's call where it has one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from aserve.backends.ops import DecoderLayerFn, fuse_layers, unfused
from aserve.distributed import get_pp_rank, get_pp_size, stage_layers
from aserve.layers.attention import AttentionMetadata
from aserve.layers.bind import PreparedLayer


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage runs: keeps layer indices (and so
    checkpoint names) aligned, holds nothing, is never called."""


class DecoderStack(PreparedLayer):
    """This stage's decoder layers between the embedding and the final norm.

    `layer(i)` builds layer i, called as `layer(positions, hidden, residual, attn_metadata) ->
    (hidden, residual)` (residual None into the first); `embedding()` the token embedding, built
    on the first stage and on a last stage whose LM head is tied to it; `norm()` the final norm,
    called as `norm(hidden, residual) -> (normed, hidden + residual)`. `rotary_emb` is the rope
    the layers share; `pre_norm`: the layers have `backends.ops`' pre-norm form, which a
    platform may run whole.
    """

    def __init__(self, num_layers: int, layer: Callable[[int], nn.Module], *,
                 embedding: Callable[[], nn.Module], norm: Callable[[], nn.Module],
                 tied_embedding: bool, rotary_emb: nn.Module, pre_norm: bool = False) -> None:
        super().__init__()
        self.is_first = get_pp_rank() == 0
        self.is_last = get_pp_rank() == get_pp_size() - 1
        self.rotary_emb = rotary_emb
        needs_embedding = self.is_first or (self.is_last and tied_embedding)
        self.embed_tokens = embedding() if needs_embedding else None
        self.owned = stage_layers(num_layers)
        self.layers = nn.ModuleList(layer(i) if i in self.owned else MissingLayer()
                                    for i in range(num_layers))
        self.norm = norm() if self.is_last else None
        self.pre_norm = pre_norm
        self.aux_layer_ids: tuple[int, ...] = ()  # see `capture`
        self.aux_hidden: list[torch.Tensor] = []
        # (first layer, end, the platform's call for them) per segment of the stage's layers
        self.segments: list[tuple[int, int, DecoderLayerFn]] = [
            (self.owned.start, self.owned.stop, unfused)]

    def prepare(self) -> None:
        """The platform's fused form of this stage's layers (of each segment between captured
        layers), where they are pre-norm ones."""
        cuts = sorted({self.owned.start, self.owned.stop, *(
            i for i in self.aux_layer_ids if self.owned.start < i < self.owned.stop)})
        self.segments = [
            (start, stop, fuse_layers(self.ops, list(self.layers[start:stop]))
             if self.pre_norm else unfused)
            for start, stop in itertools.pairwise(cuts)]

    def capture(self, layer_ids: tuple[int, ...]) -> None:
        """Keep the residual stream entering each of `layer_ids` (this stage's) at every
        forward, in `aux_hidden`, in layer order."""
        self.aux_layer_ids = tuple(sorted(layer_ids))
        self.prepare()

    def owned_layers(self) -> Iterator[nn.Module]:
        """The layers this stage runs, in order."""
        return itertools.islice(self.layers, self.owned.start, self.owned.stop)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[T] ids (first stage) or the previous stage's (hidden, residual) -> final hidden
        states [T, hidden] (last stage) or this stage's (hidden, residual)."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        aux = []
        for start, stop, fused in self.segments:
            if start in self.aux_layer_ids:  # (a new tensor: the layers work in place)
                aux.append(hidden.clone() if residual is None else hidden + residual)
            out = fused(positions, hidden, residual, attn_metadata)  # None: not this step
            if out is None:
                for layer in itertools.islice(self.layers, start, stop):
                    hidden, residual = layer(positions, hidden, residual, attn_metadata)
            else:
                hidden, residual = out
        self.aux_hidden = aux
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [T, hidden]
