"""The server tests' shared fixture: one tiny-model server per module (see helpers.server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.server import serving, tiny_app


@pytest.fixture(scope="module")
def server_url(model_dir_factory) -> Iterator[str]:
    with serving(tiny_app(model_dir_factory("llama"))) as url:
        yield url
