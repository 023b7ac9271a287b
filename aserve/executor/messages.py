"""The rank protocol: what rank 0 tells ranks 1..N-1, one frozen dataclass per message.

    rank 0 (the executor)                               rank r > 0 (`handle`)
    ProfileRun(num_tokens, num_reqs) ─────────────────► the same profiling forward, no cache
    InitKVCache(num_blocks, groups)  ─────────────────► allocate the same cache (and graphs)
    RunStep(inputs, kv_metadata)     ── per forward ──► the same forward on its own shard
    KVConnectorStep(kv_metadata)     ── per step without a forward (KV transfers only)
    KVConnectorReport(output)        ◄── after either, with a KV connector: this rank's loads
                                         and sends finished (rank 0 counts a request done
                                         once every rank has reported it)
    Stop()                           ─────────────────► leave the process groups and exit

Messages travel over the control channel (`aserve.distributed.send_control`, pickled once per
message) in the order sent, and are dispatched by type (`handle`); a rank answers none of them
but the KV connector's steps: the model's own collectives (and pipeline sends) are where ranks
meet. A new message is a new dataclass here plus its case in `handle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aserve.config import KVCacheGroupSpec
from aserve.core.kv_connector import KVConnectorOutput
from aserve.distributed import send_to_first_rank
from aserve.runner.input_batch import PreparedInputs
from aserve.runner.worker import Worker


@dataclass(frozen=True)
class ProfileRun:
    """Run the KV-cache sizing forward of the largest step, as rank 0 does."""

    num_tokens: int
    num_reqs: int


@dataclass(frozen=True)
class InitKVCache:
    """Allocate a KV cache of `num_blocks` blocks (rank 0 sized it) laid out for these KV
    cache groups, and bind it."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]


@dataclass(frozen=True)
class RunStep:
    """Run one step's forward on these inputs (rank 0 runs the same; only it samples), with
    the KV connector's work of the step around it (None: no connector)."""

    inputs: PreparedInputs
    kv_metadata: Any = None


@dataclass(frozen=True)
class KVConnectorStep:
    """A step without a forward: only the KV connector's work (loads, leases, reports)."""

    kv_metadata: Any


@dataclass(frozen=True)
class KVConnectorReport:
    """Rank r > 0 to rank 0, after each step with a KV connector: what it finished."""

    output: KVConnectorOutput


@dataclass(frozen=True)
class Stop:
    """Leave the process groups and exit."""


RankMessage = ProfileRun | InitKVCache | RunStep | KVConnectorStep | Stop


def handle(worker: Worker, message: RankMessage) -> bool:
    """Carry out one message on a rank > 0; False once it is told to stop."""
    match message:
        case RunStep(inputs, kv_metadata) if worker.runner.kv_connector is not None:
            report = worker.runner.run_rank_step(inputs, kv_metadata)
            send_to_first_rank(KVConnectorReport(report))
        case KVConnectorStep(kv_metadata):
            report = worker.runner.run_rank_step(None, kv_metadata)
            send_to_first_rank(KVConnectorReport(report))
        case RunStep(inputs, _):
            worker.runner.run_model(inputs)
        case InitKVCache(num_blocks, kv_cache_groups):
            worker.initialize_kv_cache(num_blocks, kv_cache_groups)
        case ProfileRun(num_tokens, num_reqs):
            worker.runner.profile_run(num_tokens, num_reqs)
        case Stop():
            return False
        case _:
            raise TypeError(f"not a rank message: {message!r}")
    return True
