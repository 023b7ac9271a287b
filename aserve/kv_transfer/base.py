"""`KVConnectorBase`: vLLM V1's KV connector, both sides, and what aserve's connectors share.

One class, two roles. The engine builds the SCHEDULER side and injects it into the `Scheduler`
(which sees only `aserve.core.kv_connector.KVConnectorScheduler`); every rank builds a WORKER
side, which its `ModelRunner` calls around each step:

    scheduler side (engine thread)              worker side (each rank's worker thread)
    get_num_new_matched_tokens                  register_kv_caches (once, after allocation)
    update_state_after_alloc                    bind_connector_metadata(meta)   ┐ every step,
    build_connector_meta ── meta, to every rank ─► start_load_kv()              │ forward or
    request_finished → (delay_free, params)     wait_for_layer_load(layer)…     │ not
                                                (forward) save_kv_layer(layer)… │
                                                wait_for_save()                 │
                                                get_finished(finished_req_ids) ┘

aserve's runner calls the per-layer hooks around the whole forward, not between layers: every
load is asynchronous at the scheduler (its request waits, status WAITING_FOR_REMOTE_KVS, until
the workers report it), so `wait_for_layer_load` (called for each layer before the forward)
never has to wait, and `save_kv_layer` is called for each layer after it; aserve's connectors
save whole blocks over all layers in `wait_for_save`. With tensor
parallelism each rank moves its own kv heads, and rank 0 counts a request finished once every
rank has reported it (`RankReports`).

`PagedKV` reads and writes whole blocks of one KV cache group over the layers of this rank:
group g's block b is `kv_caches[layer][:, b]` for each of the group's layers, stacked.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from aserve.config import KVCacheGroupSpec, KVTransferConfig
from aserve.core.kv_connector import KVConnectorOutput
from aserve.core.request import Request

# What vLLM's proxies send and copy: every connector accepts these keys.
PROXY_PARAMS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_engine_id",
                          "remote_block_ids", "remote_host", "remote_port"})


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids: a consumer loads a peer's K/V only for the
    very prompt the peer computed."""
    return hashlib.sha256(repr(list(token_ids)).encode()).hexdigest()[:32]


class KVConnectorBase:
    """Subclasses implement the methods of their roles. `kv_cache_key` names what the K/V
    bytes depend on (`aserve.config.ModelInfo.kv_cache_key`); `kv_cache_groups` and
    `block_size` are the engine's block layout; `tp_rank` / `tp_size` place a worker."""

    # kv_transfer_params keys a request may carry to this connector (others are a 400)
    params_keys: ClassVar[frozenset[str]] = PROXY_PARAMS

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_key: str,
                 kv_cache_groups: Sequence[KVCacheGroupSpec], block_size: int,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.config = config
        self.role = role
        self.kv_cache_key = kv_cache_key
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.block_size = block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.paged: PagedKV | None = None
        self._metadata: Any = None

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Startup: a ValueError naming what is wrong with this connector's configuration."""

    @classmethod
    def check_params(cls, params: Mapping[str, Any], config: KVTransferConfig) -> None:
        """A request's kv_transfer_params, in the frontend: a ValueError (a 400) for keys
        this connector does not know or values of the wrong type."""
        unknown = sorted(set(params) - cls.params_keys)
        if unknown:
            raise ValueError(f"kv_transfer_params has keys {unknown} that the "
                             f"{config.kv_connector} connector does not know; known: "
                             f"{', '.join(sorted(cls.params_keys))}.")
        for key in ("do_remote_decode", "do_remote_prefill"):
            if params.get(key) not in (None, True, False):
                raise ValueError(f"kv_transfer_params.{key} must be a boolean, got "
                                 f"{params[key]!r}.")
        if params.get("do_remote_decode") and not config.is_producer:
            raise ValueError("kv_transfer_params.do_remote_decode asks this instance to "
                             f"produce KV, but its kv_role is {config.kv_role}.")
        if params.get("do_remote_prefill") and not config.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill asks this instance to "
                             f"load KV, but its kv_role is {config.kv_role}.")

    @classmethod
    def max_held_blocks(cls, config: KVTransferConfig, num_kv_blocks: int) -> int | None:
        """The most blocks a producer may hold for remote decodes (None: no cap); a request
        that would hold more is refused in the frontend with 503 + Retry-After."""
        return None

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: Mapping[int, torch.Tensor]) -> None:
        """This rank's KV buffers by model layer index (`runner/kv_cache.py` layout)."""
        self.paged = PagedKV(kv_caches, self.kv_cache_groups)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Start (or do) the loads this step's metadata asks for, before the forward."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads never overlap the forward here (see the module docstring): nothing to wait."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """After the forward, once per layer of this rank: `kv_layer` holds its K/V."""

    def wait_for_save(self) -> None:
        """After the forward: every save this step's metadata asks for is done on return."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose blocks this rank finished sending and finished loading since the
        last call (`finished_req_ids`: requests the scheduler has finished since)."""
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        """Requests whose load failed on this rank since the last call (recomputed)."""
        return set()

    def take_transfer_stats(self) -> tuple[int, float]:
        """Bytes moved and seconds spent moving them on this rank since the last call."""
        return 0, 0.0

    def shutdown(self) -> None:
        """Stop this side's threads and sockets."""

    def step_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """This rank's report of one step."""
        sending, recving = self.get_finished(finished_req_ids)
        num_bytes, seconds = self.take_transfer_stats()
        return KVConnectorOutput(set(sending), set(recving), self.get_failed_loads(),
                                 num_bytes, seconds)


class PagedKV:
    """Whole blocks of each KV cache group over this rank's layers (see the module doc)."""

    def __init__(self, kv_caches: Mapping[int, torch.Tensor],
                 kv_cache_groups: Sequence[KVCacheGroupSpec]) -> None:
        self.group_buffers = [[kv_caches[layer] for layer in group.layers if layer in kv_caches]
                              for group in kv_cache_groups]

    def read(self, group: int, block_ids: Sequence[int]) -> torch.Tensor:
        """[layers of the group, 2, len(block_ids), block_size, kv heads, head_dim]"""
        index = torch.tensor(list(block_ids), dtype=torch.int64,
                             device=self.group_buffers[group][0].device)
        return torch.stack([buf.index_select(1, index) for buf in self.group_buffers[group]])

    def write(self, group: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        buffers = self.group_buffers[group]
        if data.shape[0] != len(buffers) or data.shape[2] != len(block_ids):
            raise ValueError(f"group {group}: K/V of shape {tuple(data.shape)} for "
                             f"{len(buffers)} layers and {len(block_ids)} blocks.")
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=buffers[0].device)
        for buf, layer_data in zip(buffers, data, strict=True):
            buf.index_copy_(1, index, layer_data.to(buf.device, buf.dtype))

    def block_shape(self, group: int) -> tuple[int, ...]:
        """One block of the group: [layers, 2, 1, block_size, kv heads, head_dim]."""
        buffers = self.group_buffers[group]
        _, _, block_size, heads, head_dim = buffers[0].shape
        return (len(buffers), 2, 1, block_size, heads, head_dim)


class RankReports:
    """Rank 0's view of every rank's reports: a request is finished (sending or loading)
    once all `world_size` ranks have reported it, failed once any rank failed it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.counts: dict[tuple[str, str], int] = {}
        self.failed: set[str] = set()

    def combine(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        combined = KVConnectorOutput(num_bytes=sum(o.num_bytes for o in outputs),
                                     seconds=sum(o.seconds for o in outputs))
        for output in outputs:
            self.failed |= output.failed_recving
            for kind, req_ids in (("send", output.finished_sending),
                                  ("recv", output.finished_recving | output.failed_recving)):
                for req_id in req_ids:
                    key = (kind, req_id)
                    self.counts[key] = self.counts.get(key, 0) + 1
                    if self.counts[key] < self.world_size:
                        continue
                    del self.counts[key]
                    if kind == "send":
                        combined.finished_sending.add(req_id)
                    elif req_id in self.failed:
                        self.failed.discard(req_id)
                        combined.failed_recving.add(req_id)
                    else:
                        combined.finished_recving.add(req_id)
        return combined
