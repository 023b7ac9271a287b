"""A KV connector's part of each step on this rank (docs/design.md, "Disaggregated prefill: KV
connectors"), and `NO_OP_KV_CONNECTOR`, the same part on a rank without one: nothing. The runner
calls either the same way, so its step has no connector branches.

    rank 0, a step with tokens    publish(inputs, meta) ─ before_forward(meta) ─ forward ─
                                  after_forward(finished, gather=True): saves, this rank's
                                  report and every other rank's, combined (`RankReports`)
    rank 0, a step without        step_without_forward(meta, finished): publish(None, meta)
                                  (`KVConnectorStep`: loads start, leases expire), the same
    rank r > 0                    before_forward(meta) ─ forward (if any) ─ after_forward
                                  (gather=False): this rank's report, which it sends rank 0

The connector's per-layer hooks run around the whole forward, not between layers (see
`kv_transfer/base.py`). Without a connector a step's report is None and a step without tokens
tells the other ranks nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from aserve.core.kv_connector import KVConnectorOutput
from aserve.kv_transfer import KVConnectorBase, RankReports


class KVConnectorHooks:
    """`connector`: this rank's worker side, its caches registered. `publish_inputs` and
    `gather_kv_reports`: rank 0's ways to the other ranks (None: one rank, or a rank > 0)."""

    def __init__(self, connector: KVConnectorBase, kv_caches: Mapping[int, torch.Tensor],
                 publish_inputs: Callable[..., None] | None,
                 gather_kv_reports: Callable[[], list[KVConnectorOutput]] | None) -> None:
        self.connector = connector
        self.kv_caches = kv_caches  # model layer → its KV buffer
        self.publish_inputs = publish_inputs
        self.gather_kv_reports = gather_kv_reports
        self._reports: RankReports | None = None

    def before_forward(self, metadata) -> None:
        """The step's loads (every load is asynchronous at the scheduler: nothing waits)."""
        self.connector.bind_connector_metadata(metadata)
        self.connector.start_load_kv()
        for layer in self.kv_caches:
            self.connector.wait_for_layer_load(layer)

    def after_forward(self, finished_req_ids: set[str], gather: bool) -> KVConnectorOutput:
        """This rank's saves and report; on rank 0 (`gather`) every rank's, combined."""
        for layer, kv_layer in self.kv_caches.items():
            self.connector.save_kv_layer(layer, kv_layer)
        self.connector.wait_for_save()
        output = self.connector.step_output(finished_req_ids)
        self.connector.clear_connector_metadata()
        if not gather:
            return output
        others = self.gather_kv_reports() if self.gather_kv_reports is not None else []
        if self._reports is None:
            self._reports = RankReports(1 + len(others))
        return self._reports.combine([output, *others])

    def step_without_forward(self, metadata, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Rank 0, a step that schedules no token: the connector's part alone, on every rank."""
        if self.publish_inputs is not None:
            self.publish_inputs(None, metadata)
        self.before_forward(metadata)
        return self.after_forward(finished_req_ids, gather=True)

    def shutdown(self) -> None:
        self.connector.shutdown()


class NoOpKVConnectorHooks:
    """No connector: every hook does nothing and every report is None."""

    connector = None

    def before_forward(self, metadata) -> None:
        return None

    def after_forward(self, finished_req_ids: set[str], gather: bool) -> None:
        return None

    def step_without_forward(self, metadata, finished_req_ids: set[str]) -> None:
        return None

    def shutdown(self) -> None:
        return None


NO_OP_KV_CONNECTOR = NoOpKVConnectorHooks()
