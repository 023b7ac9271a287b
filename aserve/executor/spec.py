"""What every executor is built from: `WorkerSpec` (what one rank builds) and `RankLayout` (how
many ranks, where they meet). One process or many, the same spec builds every rank's `Worker`.

Plain data, importable without torch (the CLI builds specs before anything loads a model):
`build` imports the runner when it runs.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aserve.config import DistributedConfig, DraftConfig, KVTransferConfig, ModelConfig

if TYPE_CHECKING:
    from aserve.core.kv_connector import KVConnectorOutput
    from aserve.runner.input_batch import PreparedInputs
    from aserve.runner.worker import Worker


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class WorkerSpec:
    """The arguments of every rank's `Worker`."""

    model_config: ModelConfig
    block_size: int
    device: str = "auto"
    enforce_eager: bool = False
    max_num_seqs: int = 256
    kv_transfer_config: KVTransferConfig | None = None  # each rank builds a worker side
    # speculative decoding's draft model or EAGLE head (runner/spec_draft.py, spec_eagle.py)
    draft: DraftConfig | None = None
    num_speculative_tokens: int = 0  # k of any method: verification steps get graphs too

    def build(self, distributed: DistributedConfig | None = None,
              publish_inputs: Callable[[PreparedInputs | None, Any], None] | None = None,
              gather_kv_reports: Callable[[], list[KVConnectorOutput]] | None = None
              ) -> Worker:
        """This rank's worker; `distributed` is None for a single rank, `publish_inputs` is
        rank 0's way of handing each step's inputs (and KV connector work) to the others,
        `gather_kv_reports` its way of collecting their KV connector reports (None
        elsewhere)."""
        from aserve.runner.worker import Worker

        return Worker(self.model_config, self.block_size, self.device,
                      local_rank=distributed.local_rank if distributed else 0,
                      enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
                      distributed=distributed, publish_inputs=publish_inputs,
                      kv_transfer_config=self.kv_transfer_config,
                      gather_kv_reports=gather_kv_reports,
                      draft=self.draft, num_speculative_tokens=self.num_speculative_tokens)


@dataclass(frozen=True)
class RankLayout:
    """How ranks are laid out: world = pp × sp × tp ranks over `nnodes` nodes (rank = node ×
    ranks per node + local rank; stage = rank // (sp × tp), tp fastest), meeting at
    master_addr:master_port (None: a free port of this machine, chosen when the ranks
    start)."""

    world_size: int = 1
    tp_size: int = 1
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    pp_layer_partition: tuple[int, ...] | None = None
    enable_expert_parallel: bool = False
    moe_combine: str = "all-reduce"
    sp_size: int = 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def num_stages(self) -> int:
        return self.world_size // (self.tp_size * self.sp_size)

    def with_port(self) -> RankLayout:
        """This layout with a port to meet at: its own, else a free one."""
        return self if self.master_port is not None else replace(self, master_port=free_port())

    def config(self, node_rank: int, local_rank: int) -> DistributedConfig:
        if self.master_port is None:
            raise ValueError("a rank layout needs a master port before ranks join (with_port)")
        return DistributedConfig(node_rank * self.ranks_per_node + local_rank, self.world_size,
                                 local_rank, self.master_addr, self.master_port,
                                 tp_size=self.tp_size, sp_size=self.sp_size,
                                 pp_layer_partition=self.pp_layer_partition,
                                 enable_expert_parallel=self.enable_expert_parallel,
                                 moe_combine=self.moe_combine)
