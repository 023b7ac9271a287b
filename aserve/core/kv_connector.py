"""What the scheduler asks of a KV connector (vLLM V1's scheduler side), and what the workers
report back. The core defines this protocol and never imports `aserve.kv_transfer`: the engine
injects a connector into the `Scheduler`.

A connector moves KV blocks between this instance and somewhere else (a shared store, a peer
instance). Its lifecycle, seen from the scheduler:

    waiting request ─ get_num_new_matched_tokens(request, num_local_hit) ─► (n, load_async)
        n > 0: blocks allocated for hit + n tokens (not cached yet) ─ update_state_after_alloc
               status WAITING_FOR_REMOTE_KVS: not scheduled; the workers load (metadata)
        n = 0: admitted as usual ─ update_state_after_alloc(request, block_ids, 0)
    every schedule() ─ build_connector_meta(output) ─► output.kv_connector_metadata
    every step's ModelRunnerOutput.kv_connector_output (every rank's, combined):
        finished_recving: loaded → blocks cached, num_computed_tokens set (the last prompt
                          token is always recomputed), admitted before any waiting request
        failed_recving:   blocks freed, computed from scratch (counted), never asked again
        finished_sending: blocks held for a peer (delay_free) are freed
    request finished ─ request_finished(request, block_ids) ─► (delay_free, kv_transfer_params)

Only asynchronous loads are supported: `load_async` must be True whenever n > 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from aserve.core.request import Request


class KVConnectorScheduler(Protocol):
    """The scheduler side of a KV connector (method names and meaning are vLLM V1's)."""

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (the local prefix hit) that can be loaded for
        `request`, and whether they load asynchronously. Must leave the last token unloaded
        or let the scheduler recompute it (it does: see the module docstring)."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """The request's blocks (per KV cache group) once allocated; `num_external_tokens`
        of them are to be loaded (0: the request computes everything itself)."""
        ...

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the workers must do this step (loads to start, blocks to save, leases):
        picklable, handed to every rank with the step."""
        ...

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """`request` finished or was aborted: whether its blocks must stay allocated until
        the workers report them sent (`finished_sending`), and the `kv_transfer_params` to
        return to the client (what a consumer needs to pull them)."""
        ...


@dataclass
class KVConnectorOutput:
    """What the workers of one step report (rank 0 combines every rank's: a request counts
    once every rank has reported it). Transfer figures are this step's, summed over ranks."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
