"""The C++ extension's first build says so: a build torch's loader does not have yet is
announced before it starts and timed after (the server's log shows INFO at startup), a cached
one loads silently; a build that fails leaves the torch references, with one warning."""

from __future__ import annotations

import logging

import pytest

from aserve.kernels import cpu_extension


@pytest.fixture
def fresh(monkeypatch):
    """`load()` as if nothing were loaded in this process (the real build stays cached)."""
    monkeypatch.setattr(cpu_extension, "_built", {})
    calls = []
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda **kwargs: calls.append(kwargs) or "module")
    return calls


@pytest.mark.parametrize("cached", [False, True])
def test_a_first_build_is_announced_and_timed(fresh, monkeypatch, caplog, cached):
    monkeypatch.setattr(cpu_extension, "_is_built", lambda name: cached)
    with caplog.at_level(logging.INFO, logger="aserve.kernels.cpu_extension"):
        assert cpu_extension.load() == "module"
    said = [r.getMessage() for r in caplog.records]
    if cached:
        assert said == []
    else:
        assert said[0].startswith("Compiling aserve's C++ CPU kernels")
        assert said[1].startswith("Compiled aserve's C++ CPU kernels in")
    assert len(fresh) == 1 and fresh[0]["name"].startswith(cpu_extension.EXTENSION)


def test_the_build_of_this_process_is_known_as_built():
    if cpu_extension.load() is None:
        pytest.skip("no C++ compiler here")
    assert cpu_extension._is_built(cpu_extension.build_name()[0])
    assert not cpu_extension._is_built(cpu_extension.EXTENSION + "_never_built")


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_extension, "_built", {})
    monkeypatch.setattr(cpu_extension, "_is_built", lambda name: True)

    def fail(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr("torch.utils.cpp_extension.load", fail)
    with caplog.at_level(logging.INFO, logger="aserve.kernels.cpu_extension"):
        assert cpu_extension.load() is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "no compiler" in caplog.records[0].getMessage()
