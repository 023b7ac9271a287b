"""Every test here sets the P2P secret itself (in kv_connector_extra_config, or in the
environment with monkeypatch): one a developer has exported must not change what they see."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_exported_kv_secret(monkeypatch):
    monkeypatch.delenv("ASERVE_KV_SECRET", raising=False)
