"""`P2pConnector`: a consumer pulls a finished prefill's KV blocks straight from its producer,
over a torch.distributed process group of their own (gloo; one per producer rank and consumer
rank pair, built on first use).

    producer (kv_producer / kv_both)                consumer (kv_consumer / kv_both)
    request {"do_remote_decode": true} finishes
      request_finished → delay_free, params: host,
      port, handle, block ids, prompt digest, key,
      signed with the shared secret ──────────────► request {"do_remote_prefill": true, ...}:
                                                      signature (and allow-list) checked in
                                                      the frontend and again here
      rank r registers the handle (lease starts)      blocks allocated, WAITING_FOR_REMOTE_KVS
      rank r listens on kv_ip:kv_port + r  ◄── TCP ── rank r's thread for that producer:
        nonce; proof of the secret checked ◄────────  hello (its key, proof)
        TCPStore + ProcessGroupGloo(rank 0 of 2) ───  ProcessGroupGloo(rank 1 of 2)
        {"handle", "block_ids"} ◄────────────────────  the blocks it needs, per group
        {"shapes", "dtype"} ─────────────────────────► checked against its own layout
        send each group's blocks ───── gloo ────────► recv, copy into its own blocks, ack
      finished_sending: the blocks are freed          finished_recving: the request is queued

The producer's side is `p2p_send.Sender`, the consumer's `p2p_pull.Puller`, the wire
`p2p_wire`, the secret and the allow-list `p2p_auth`. Each rank moves its own kv heads; the
scheduler counts a transfer finished once every rank has (`RankReports`). Nothing hangs: the
producer frees a handle's blocks once sent, when its consumer fails mid-way, or when nobody
pulled within `lease_timeout_s`; a consumer whose pull fails (its producer gone, the handle
unknown or expired, a reply that is not its own layout, no answer within `pull_timeout_s`)
computes the prompt itself, as it does when the params are not signed, name a producer outside
`producers`, or name another key, TP size or prompt. Pulls from different producers run
concurrently: a stalled producer delays only its own.

`kv_connector_extra_config`: `secret` (or env `ASERVE_KV_SECRET`, preferred; required),
`producers` (["host:port", ...]: the only producers a consumer pulls from; default: any whose
params are signed), `max_held_share` (0.5: of its KV cache, what a producer holds for pulls;
a remote decode beyond it is a 503 in the frontend), `lease_timeout_s` (120),
`connect_timeout_s` (5), `transfer_timeout_s` (30), `pull_timeout_s` (30: a pull's whole
life, queued included).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aserve.config import KVTransferConfig
from aserve.core.outputs import SchedulerOutput
from aserve.core.request import Request, RequestStatus
from aserve.kv_transfer.base import PROXY_PARAMS, KVConnectorBase, prompt_digest
from aserve.kv_transfer.p2p_auth import (
    SIGNATURE_KEY,
    has_valid_signature,
    is_allowed,
    parse_producers,
    resolve_secret,
    sign_params,
)
from aserve.kv_transfer.p2p_pull import Pull, Puller
from aserve.kv_transfer.p2p_send import Send, Sender

logger = logging.getLogger(__name__)

TIMEOUTS = {"lease_timeout_s": 120.0, "connect_timeout_s": 5.0, "transfer_timeout_s": 30.0,
            "pull_timeout_s": 30.0}
EXTRA_KEYS = (*TIMEOUTS, "secret", "producers", "max_held_share")
# A producer holds at most this share of its KV cache for consumers to pull (finished prefills
# waiting up to lease_timeout_s); a remote decode beyond it is a 503. Without a cap, cheap
# requests that nobody pulls held the whole cache for the lease
# (docs/benchmarks/before-after.md, "What the guards answer").
MAX_HELD_SHARE = 0.5


@dataclass(frozen=True)
class P2pMetadata:
    pulls: tuple[Pull, ...] = ()
    sends: tuple[Send, ...] = ()


class P2pConnector(KVConnectorBase):
    """See the module docstring."""

    params_keys = PROXY_PARAMS | {"remote_handle", "remote_num_tokens", "remote_prompt_hash",
                                  "remote_kv_cache_key", "tp_size", SIGNATURE_KEY}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.config.kv_connector_extra_config
        self.timeouts = {k: float(extra.get(k, v)) for k, v in TIMEOUTS.items()}
        self.secret = resolve_secret(extra)
        self.producers = parse_producers(extra.get("producers"))
        self.engine_id = self.config.engine_id or uuid.uuid4().hex
        # scheduler side
        self._pulled: set[str] = set()  # loaded once: a preempted request recomputes
        self._pulls: list[Pull] = []
        self._sends: list[Send] = []
        # worker side
        self.sender: Sender | None = None
        self.puller: Puller | None = None
        self._failed: set[str] = set()

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config has keys {unknown} that P2pConnector "
                             f"does not know; known: {', '.join(EXTRA_KEYS)}.")
        for key in set(extra) & set(TIMEOUTS):
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number "
                                 f"of seconds, got {value!r}.")
        share = extra.get("max_held_share", MAX_HELD_SHARE)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(f"kv_connector_extra_config.max_held_share must be in (0, 1], "
                             f"got {share!r}.")
        if not isinstance(extra.get("secret", ""), str):
            raise ValueError("kv_connector_extra_config.secret must be a string.")
        resolve_secret(extra)
        parse_producers(extra.get("producers"))

    @classmethod
    def max_held_blocks(cls, config: KVTransferConfig, num_kv_blocks: int) -> int | None:
        share = config.kv_connector_extra_config.get("max_held_share", MAX_HELD_SHARE)
        return int(share * num_kv_blocks) if config.is_producer else None

    @classmethod
    def check_params(cls, params: Mapping[str, Any], config: KVTransferConfig) -> None:
        """Params that make a consumer pull must carry a producer's signature (checked first),
        and name a producer of the allow-list when there is one."""
        extra = config.kv_connector_extra_config
        if params.get("do_remote_prefill") and not has_valid_signature(
                params, resolve_secret(extra)):
            raise ValueError("kv_transfer_params are not signed by a producer this instance "
                             f"trusts ({SIGNATURE_KEY} missing or wrong): send the "
                             "kv_transfer_params a P2pConnector producer returned, unchanged.")
        super().check_params(params, config)
        producers = parse_producers(extra.get("producers"))
        if params.get("do_remote_prefill") and not is_allowed(
                producers, params.get("remote_host"), params.get("remote_port")):
            raise ValueError("kv_transfer_params name a producer that is not in this "
                             "instance's kv_connector_extra_config.producers.")

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if (not (self.config.is_consumer and params.get("do_remote_prefill"))
                or request.request_id in self._pulled):
            return 0, True
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        last = -(-request.num_prompt_tokens // self.block_size)
        error = self._check_remote(request, params)
        remote_ids, local_ids = [], []
        for group, local in enumerate(block_ids):
            remote = params["remote_block_ids"][group][first:last] if error is None else []
            pairs = [(r, lo) for r, lo in zip(remote, local[first:last]) if r != 0]
            remote_ids.append(tuple(r for r, _ in pairs))
            local_ids.append(tuple(lo for _, lo in pairs))
        self._pulls.append(Pull(request.request_id, str(params.get("remote_host")),
                                params.get("remote_port") or 0,
                                str(params.get("remote_handle")), tuple(remote_ids),
                                tuple(local_ids), error))
        self._pulled.add(request.request_id)

    def _check_remote(self, request: Request, params: dict) -> str | None:
        """Why the producer's blocks cannot serve this request (None: they can). The
        signature first: nothing else of unsigned params is believed."""
        if not has_valid_signature(params, self.secret):
            return f"the params are not signed with the shared secret ({SIGNATURE_KEY})"
        if not is_allowed(self.producers, params.get("remote_host"), params.get("remote_port")):
            return "the params name a producer outside kv_connector_extra_config.producers"
        checks = (
            (params.get("remote_kv_cache_key") == self.kv_cache_key,
             "the producer's model, dtype, block size or TP layout differ"),
            (params.get("tp_size") == self.tp_size, "the producer's TP size differs"),
            (params.get("remote_num_tokens") == request.num_prompt_tokens
             and params.get("remote_prompt_hash") == prompt_digest(request.prompt_token_ids),
             "the producer computed another prompt"),
            (isinstance(params.get("remote_host"), str)
             and isinstance(params.get("remote_port"), int)
             and isinstance(params.get("remote_handle"), str), "no producer address"),
        )
        for ok, reason in checks:
            if not ok:
                return reason
        ids = params.get("remote_block_ids")
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if not (isinstance(ids, list) and len(ids) == len(self.kv_cache_groups)
                and all(isinstance(g, list) and len(g) == num_blocks for g in ids)):
            return "remote_block_ids do not cover the prompt in every KV cache group"
        for group, spec in enumerate(self.kv_cache_groups):
            # what the last prompt token's window reads must still be on the producer
            window = spec.sliding_window or request.num_prompt_tokens + 1
            first_read = max(0, request.num_prompt_tokens - window) // self.block_size
            if any(b == 0 for b in ids[group][first_read:]):
                return f"the producer no longer holds group {group}'s window"
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pMetadata:
        meta = P2pMetadata(tuple(self._pulls), tuple(self._sends))
        self._pulls, self._sends = [], []
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._pulled.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if (not self.config.is_producer or not params.get("do_remote_decode")
                or request.status == RequestStatus.FINISHED_ABORTED
                or request.num_computed_tokens < request.num_prompt_tokens):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        ids = [list(g[:num_blocks]) for g in block_ids]
        handle = uuid.uuid4().hex
        self._sends.append(Send(handle, request.request_id, tuple(tuple(g) for g in ids)))
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_block_ids": ids,
            "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port,
            "remote_handle": handle, "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": prompt_digest(request.prompt_token_ids),
            "remote_kv_cache_key": self.kv_cache_key, "tp_size": self.tp_size}
        return True, {**params, SIGNATURE_KEY: sign_params(params, self.secret)}

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        if self.config.is_producer:
            self.sender = Sender(self.paged, self.kv_cache_key, self.tp_rank, self.secret,
                                 self.timeouts)
            self.sender.listen(self.config.kv_ip, self.config.kv_port + self.tp_rank)
        if self.config.is_consumer:
            self.puller = Puller(self.paged, self.kv_cache_key, self.tp_rank, self.secret,
                                 self.timeouts, self.producers)

    def bind_connector_metadata(self, metadata: P2pMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if metadata is not None and metadata.sends:
            self.sender.hold(metadata.sends)

    def start_load_kv(self) -> None:
        for pull in self._metadata.pulls if self._metadata is not None else ():
            self.puller.submit(pull)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sent = self.sender.take_finished() if self.sender is not None else set()
        recving = set()
        if self.puller is not None:
            recving, failed = self.puller.take_finished()
            self._failed |= failed
        return sent, recving

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def take_transfer_stats(self) -> tuple[int, float]:
        stats = [side.take_stats() for side in (self.sender, self.puller) if side is not None]
        return sum(b for b, _ in stats), sum(s for _, s in stats)

    def shutdown(self) -> None:
        for side in (self.sender, self.puller):
            if side is not None:
                side.shutdown()
