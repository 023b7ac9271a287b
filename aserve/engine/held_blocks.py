"""A KV producer's cap on the blocks it holds for consumers to pull, checked as requests arrive.

A remote decode (`kv_transfer_params.do_remote_decode`) leaves its prompt's blocks held once it
finishes, until a consumer pulls them or the lease ends (`P2pConnector`: 120 s). Cheap such
requests that nobody pulled could hold all of a producer's cache
(docs/benchmarks/before-after.md, "What the guards answer"). So the frontend admits one only
while the blocks held now (the engine's stats), plus those of the remote decodes in flight
(held once they finish), plus its own stay within the connector's `max_held_blocks`; beyond it
the request is refused with 503 + Retry-After.
"""

from __future__ import annotations


class ServerBusyError(Exception):
    """The server refuses a request to protect its capacity (a 503 with Retry-After)."""


class HeldBlocksBudget:
    def __init__(self, max_blocks: int, block_size: int, num_groups: int) -> None:
        self.max_blocks, self.block_size, self.num_groups = max_blocks, block_size, num_groups
        self.reserved: dict[str, int] = {}  # remote decodes in flight → blocks they will hold

    def blocks_of(self, num_prompt_tokens: int) -> int:
        """An upper bound: every group's blocks of the prompt (a window's may hold fewer)."""
        return -(-num_prompt_tokens // self.block_size) * self.num_groups

    def reserve(self, request_id: str, num_prompt_tokens: int, num_held_now: int) -> None:
        need = self.blocks_of(num_prompt_tokens)
        in_flight = sum(self.reserved.values())
        if num_held_now + in_flight + need > self.max_blocks:
            raise ServerBusyError(
                f"This KV producer holds {num_held_now} blocks for consumers to pull and "
                f"{in_flight} more for remote decodes in flight; this request's {need} would "
                f"pass its cap of {self.max_blocks} (kv_connector_extra_config.max_held_share). "
                "Retry later.")
        self.reserved[request_id] = need

    def release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
