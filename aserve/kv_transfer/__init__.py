"""Disaggregated prefill: KV connectors (vLLM V1's contract) that move KV blocks between
instances. `create_connector` builds one side of the connector a `KVTransferConfig` names;
`check_config` and `check_params` are the startup and per-request checks (a ValueError naming
what is wrong). The core sees only `aserve.core.kv_connector`'s protocol."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aserve.config import KVCacheGroupSpec, KVTransferConfig
from aserve.kv_transfer.base import (
    PROXY_PARAMS,
    KVConnectorBase,
    KVConnectorRole,
    PagedKV,
    RankReports,
)
from aserve.kv_transfer.identity import kv_cache_key, model_identity
from aserve.kv_transfer.p2p import P2pConnector
from aserve.kv_transfer.shared_storage import SharedStorageConnector

CONNECTORS: dict[str, type[KVConnectorBase]] = {
    "SharedStorageConnector": SharedStorageConnector,
    "P2pConnector": P2pConnector,
}


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    cls = CONNECTORS.get(config.kv_connector)
    if cls is None:
        raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} is not a "
                         f"connector aserve has; known: {', '.join(CONNECTORS)}.")
    return cls


def check_config(config: KVTransferConfig) -> None:
    """Startup: an unknown connector, or its configuration wrong (a ValueError)."""
    connector_class(config).check_config(config)


def check_params(params: Mapping[str, Any], config: KVTransferConfig | None) -> None:
    """A request's kv_transfer_params against this engine's connector (None: there is none)."""
    if config is None:
        raise ValueError("kv_transfer_params needs a KV connector, and this server has none "
                         "(start it with --kv-transfer-config).")
    connector_class(config).check_params(params, config)


def create_connector(config: KVTransferConfig, role: KVConnectorRole, kv_cache_key: str,
                     kv_cache_groups: Sequence[KVCacheGroupSpec], block_size: int,
                     tp_rank: int = 0, tp_size: int = 1) -> KVConnectorBase:
    return connector_class(config)(config, role, kv_cache_key, kv_cache_groups, block_size,
                                   tp_rank, tp_size)


__all__ = ["CONNECTORS", "PROXY_PARAMS", "KVConnectorBase", "KVConnectorRole", "P2pConnector",
           "PagedKV", "RankReports", "SharedStorageConnector", "check_config", "check_params",
           "create_connector", "kv_cache_key", "model_identity"]
