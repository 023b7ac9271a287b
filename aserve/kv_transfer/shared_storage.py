"""`SharedStorageConnector` (vLLM's name): KV blocks in files under a directory every instance
can reach, content-addressed by aserve's chained block hashes.

    <shared_storage_path>/<kv_cache_key>/<hash[:2]>/<block hash>.rank<r>.safetensors
        tensors "g0", "g1", ...: the block's K/V in each KV cache group over this rank's
        layers, [layers, 2, 1, block_size, kv heads, head_dim]; metadata: the key and hash

A producer (kv_producer, kv_both) writes every full prompt block it computes, right after the
step that computed it (`wait_for_save`; written to a temporary file, then renamed, so that a
reader never sees half a block). A consumer (kv_consumer, kv_both) asks the store for the
blocks of a prompt past its local prefix hit: the longest run whose files exist for every
rank, never the block holding the last prompt token. The load runs before the next forward
(`start_load_kv`), each file checked against this engine's key and the block's hash; one bad
file fails the whole load and the request is computed here. Since the key covers the model,
dtype, block size and TP layout, the store is also a prefix cache shared across instances and
restarts: blocks of another model, dtype or layout live under another key and are never read.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from aserve.config import KVTransferConfig
from aserve.core.hashing import update_block_hashes
from aserve.core.outputs import SchedulerOutput
from aserve.core.request import Request
from aserve.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockFile:
    """One block of a request: its hash (hex) and its block id in each KV cache group."""

    block_hash: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StorageLoad:
    req_id: str
    blocks: tuple[BlockFile, ...]


@dataclass(frozen=True)
class StorageMetadata:
    loads: tuple[StorageLoad, ...] = ()
    saves: tuple[BlockFile, ...] = ()


class SharedStorageConnector(KVConnectorBase):
    """See the module docstring."""

    EXTRA_KEYS = frozenset({"shared_storage_path"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = Path(self.config.kv_connector_extra_config["shared_storage_path"])
        self.engine_id = self.config.engine_id or uuid.uuid4().hex
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[list[int]]] = {}  # per group, as the runner keeps them
        self._loads: list[StorageLoad] = []
        # worker side
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._num_bytes, self._seconds = 0, 0.0

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - cls.EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_connector_extra_config has keys {unknown} that "
                             "SharedStorageConnector does not know; known: shared_storage_path.")
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config."
                             "shared_storage_path: a directory every instance can reach.")
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_connector_extra_config.shared_storage_path {path!r} cannot "
                             f"be created: {e}.") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"kv_connector_extra_config.shared_storage_path {path!r} is not "
                             "a writable directory.")

    def block_path(self, block_hash: str, rank: int) -> Path:
        return (self.root / self.kv_cache_key / block_hash[:2]
                / f"{block_hash}.rank{rank}.safetensors")

    def is_stored(self, block_hash: str) -> bool:
        return all(self.block_path(block_hash, r).is_file() for r in range(self.tp_size))

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.is_consumer:
            return 0, True
        size = self.block_size
        update_block_hashes(request, size)
        first = num_computed_tokens // size
        end = min((request.num_tokens - 1) // size, len(request.block_hashes))
        num_blocks = 0
        for index in range(first, end):
            if not self.is_stored(request.block_hashes[index].hex()):
                break
            num_blocks += 1
        return (first + num_blocks) * size - num_computed_tokens if num_blocks else 0, True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        blocks = tuple(
            BlockFile(request.block_hashes[i].hex(), tuple(ids[i] for ids in block_ids))
            for i in range(first, first + num_external_tokens // self.block_size))
        self._loads.append(StorageLoad(request.request_id, blocks))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorageMetadata:
        so = scheduler_output
        for req_id in so.preempted_req_ids:
            self._tables.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._tables[new.req_id] = [list(ids) for ids in new.block_ids]
        for cached in so.scheduled_cached_reqs:
            for table, ids in zip(self._tables[cached.req_id], cached.new_block_ids,
                                  strict=True):
                table.extend(ids)
        saves: list[BlockFile] = []
        if self.config.is_producer:
            computed = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
            computed += [(c.req_id, c.num_computed_tokens) for c in so.scheduled_cached_reqs]
            for req_id, start in computed:
                saves += self._blocks_to_save(req_id, start, so.num_scheduled_tokens[req_id])
        loads, self._loads = tuple(self._loads), []
        return StorageMetadata(loads, tuple(saves))

    def _blocks_to_save(self, req_id: str, start: int, num_tokens: int) -> list[BlockFile]:
        """The prompt blocks this step fills up that the store does not hold yet."""
        request, size = self._requests.get(req_id), self.block_size
        if request is None:
            return []
        update_block_hashes(request, size)
        end = min(start + num_tokens, request.num_prompt_tokens)
        table = self._tables[req_id]
        saves = []
        for index in range(start // size, end // size):
            block_hash = request.block_hashes[index].hex()
            if not self.is_stored(block_hash):
                saves.append(BlockFile(block_hash, tuple(ids[index] for ids in table)))
        return saves

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._tables.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        # The blocks are in the store already (saved by the steps that computed them):
        # the consumer finds them by its own prompt's hashes.
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.engine_id, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}

    # ---------------------------------------------------------------- worker side

    def start_load_kv(self) -> None:
        for load in self._metadata.loads if self._metadata is not None else ():
            start = time.perf_counter()
            try:
                for block in load.blocks:
                    self._num_bytes += self._load_block(block)
            except Exception as e:  # noqa: BLE001 - a bad or missing file: recompute
                logger.warning("KV load of %s from %s failed (%s: %s); it is recomputed",
                               load.req_id, self.root, type(e).__name__, e)
                self._failed.add(load.req_id)
            else:
                self._recving.add(load.req_id)
            self._seconds += time.perf_counter() - start

    def _load_block(self, block: BlockFile) -> int:
        path = self.block_path(block.block_hash, self.tp_rank)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("kv_cache_key") != self.kv_cache_key
                    or meta.get("block_hash") != block.block_hash):
                raise ValueError(f"{path.name} holds {meta.get('kv_cache_key')} / "
                                 f"{meta.get('block_hash')}, not this engine's block")
            num_bytes = 0
            for group, block_id in enumerate(block.block_ids):
                data = f.get_tensor(f"g{group}")
                if tuple(data.shape) != self.paged.block_shape(group):
                    raise ValueError(f"{path.name}: group {group} has shape "
                                     f"{tuple(data.shape)}, not {self.paged.block_shape(group)}")
                self.paged.write(group, [block_id], data)
                num_bytes += data.numel() * data.element_size()
        return num_bytes

    def wait_for_save(self) -> None:
        for block in self._metadata.saves if self._metadata is not None else ():
            path = self.block_path(block.block_hash, self.tp_rank)
            if path.is_file():
                continue  # another instance (or step) wrote it
            start = time.perf_counter()
            tensors = {f"g{group}": self.paged.read(group, [block_id]).cpu().contiguous()
                       for group, block_id in enumerate(block.block_ids)}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
            save_file(tensors, str(tmp), metadata={"kv_cache_key": self.kv_cache_key,
                                                   "block_hash": block.block_hash})
            os.replace(tmp, path)
            self._num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            self._seconds += time.perf_counter() - start

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        recving, self._recving = self._recving, set()
        return set(), recving

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def take_transfer_stats(self) -> tuple[int, float]:
        stats = (self._num_bytes, self._seconds)
        self._num_bytes, self._seconds = 0, 0.0
        return stats
