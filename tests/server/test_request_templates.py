"""A request's own chat template (issue 39, rows 1 and 11), through the HTTP API.

- Refused with a 400 naming `chat_template` unless the server runs with
  `--trust-request-chat-template` (`chat_template_kwargs` themselves stay allowed, as in vLLM).
- Trusted, the 44-byte memory bomb is refused without the process's peak RSS growing, a
  runaway loop stops at the deadline while `/version` keeps answering, and the compiled-template
  cache stays within its byte bound.
- No rendering of a function, method or class shows an object repr or a memory address.
- With an API key, `/tokenize` and `/detokenize` need it too.
"""

from __future__ import annotations

import pathlib
import threading
import time

import httpx
import pytest
from helpers.server import assert_error, serving, tiny_app

from aserve.engine import template_limits
from aserve.engine.chat_template import (
    MAX_REQUEST_TEMPLATE_BYTES,
    TEMPLATE_CACHE_BYTES,
    TEMPLATES,
)
from aserve.engine.template_limits import RenderLimits
from aserve.engine.tokenizer import Tokenizer
from aserve.server import ServerConfig

pytestmark = pytest.mark.spawns  # uvicorn servers

USER = [{"role": "user", "content": "hi"}]
KEY = {"Authorization": "Bearer secret"}
BOMB = "{{ 'A' * 2000000000 }}{{ 'B' * 2000000000 }}"  # row 1's 44 bytes: 4 GB if folded
ROUTES = ["/tokenize", "/v1/chat/completions"]
LEAKS = ("0x", "<built-in", "<function", "<bound", "<class", "<generator", " object at")


@pytest.fixture(scope="module")
def keyed_url(llama_dir):
    """The default: request templates refused; an API key set."""
    with serving(tiny_app(llama_dir, ServerConfig(served_model_name="tiny",
                                                  api_key="secret"))) as url:
        yield url


@pytest.fixture(scope="module")
def trusted_url(llama_dir):
    config = ServerConfig(served_model_name="tiny", trust_request_chat_template=True)
    with serving(tiny_app(llama_dir, config)) as url:
        yield url


def chat(template: str | None = None, **extra) -> dict:
    body = {"model": "tiny", "messages": USER, "max_tokens": 1, **extra}
    return body if template is None else {**body, "chat_template": template}


def test_the_bomb_is_44_bytes():
    assert len(BOMB.encode()) == 44


@pytest.mark.parametrize("route", ROUTES)
def test_request_templates_are_refused_by_default(keyed_url, route):
    for body in (chat(BOMB), chat("{{ messages[0].content }}"),
                 chat(chat_template_kwargs={"chat_template": BOMB})):
        response = httpx.post(f"{keyed_url}{route}", json=body, headers=KEY)
        assert_error(response, 400, "chat_template", "--trust-request-chat-template")


@pytest.mark.parametrize("route", ROUTES)
def test_chat_template_kwargs_stay_allowed_as_template_variables(keyed_url, route):
    response = httpx.post(f"{keyed_url}{route}", headers=KEY,
                          json=chat(chat_template_kwargs={"enable_thinking": False}))
    assert response.status_code == 200, response.text


def test_tokenize_and_detokenize_need_the_api_key(keyed_url):
    for path, body in (("/tokenize", {"model": "tiny", "prompt": "Hello"}),
                       ("/tokenize", {"model": "tiny", "messages": USER}),
                       ("/detokenize", {"model": "tiny", "tokens": [5, 6]})):
        assert_error(httpx.post(f"{keyed_url}{path}", json=body), 401)
        assert_error(httpx.post(f"{keyed_url}{path}", json=body,
                                headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.post(f"{keyed_url}{path}", json=body, headers=KEY).status_code == 200
    assert httpx.get(f"{keyed_url}/version").status_code == 200  # operational: no key


def _peak_rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("route", ROUTES)
def test_trusted_the_bomb_is_refused_without_memory_growth(trusted_url, route):
    try:  # the server runs in this process: reset its peak RSS (Linux clear_refs 5)
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    start = _peak_rss_bytes()
    response = httpx.post(f"{trusted_url}{route}", json=chat(BOMB), timeout=30)
    assert_error(response, 400, "chat_template", "longer than")
    doubling = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")
    assert_error(httpx.post(f"{trusted_url}{route}", json=chat(doubling), timeout=30), 400,
                 "chat_template", "longer than")
    assert _peak_rss_bytes() - start < 200 << 20


def test_trusted_a_runaway_template_stops_at_the_deadline_and_the_server_keeps_answering(
        trusted_url, monkeypatch):
    monkeypatch.setattr(template_limits, "DEFAULT_LIMITS", RenderLimits(max_seconds=2.0))
    runaway = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    answers: list[tuple[httpx.Response, float]] = []

    def send() -> None:
        start = time.monotonic()
        response = httpx.post(f"{trusted_url}/tokenize", json=chat(runaway), timeout=60)
        answers.append((response, time.monotonic() - start))

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)  # the template is rendering
    start = time.monotonic()
    canary = httpx.get(f"{trusted_url}/version", timeout=30)
    canary_wait = time.monotonic() - start
    sender.join()
    (response, render_time), = answers
    assert canary.status_code == 200 and canary_wait < 1.5, canary_wait
    assert_error(response, 400, "chat_template", "ran for more than 2 s")
    assert 1.9 < render_time < 10, render_time


def test_trusted_templates_past_the_size_cap_are_refused_and_the_cache_stays_bounded(
        trusted_url):
    too_big = "{{ messages[0].content }}" + " " * MAX_REQUEST_TEMPLATE_BYTES
    assert_error(httpx.post(f"{trusted_url}/tokenize", json=chat(too_big)), 400,
                 "chat_template", "bytes")
    filler = " " * (MAX_REQUEST_TEMPLATE_BYTES - 100)
    num_sent = 2 * TEMPLATE_CACHE_BYTES // len(filler)
    for i in range(num_sent):  # distinct templates, each just under the cap
        template = f"{{{{ messages[0].content }}}}{{# {i}{filler} #}}"
        response = httpx.post(f"{trusted_url}/tokenize", json=chat(template), timeout=30)
        assert response.status_code == 200, response.text
    TEMPLATES.check_invariants()
    assert TEMPLATES.num_bytes <= TEMPLATE_CACHE_BYTES
    assert len(TEMPLATES) < num_sent


LEAKY = ["{{ ''.join }}", "{{ raise_exception }}", "{{ namespace }}", "{{ messages.append }}",
         "{{ '%s' % ''.join }}", "{{ '{}'.format(''.join) }}", "{{ [''.join]|join }}",
         "{{ raise_exception(''.join) }}", "{{ messages|map(attribute='role') }}",
         "{{ dict }}", "{{ cycler(1) }}", "{{ ''.join ~ '' }}", "{{ ''.join|string }}"]


@pytest.mark.parametrize("template", LEAKY)
def test_trusted_no_object_repr_or_address_reaches_the_client(trusted_url, template):
    for route in ROUTES:
        response = httpx.post(f"{trusted_url}{route}", json=chat(template))
        assert response.status_code in (200, 400), response.text
        assert not any(leak in response.text for leak in LEAKS), response.text


@pytest.mark.parametrize("template", ["{{ 1 / 0 }}", "{% for i in range(10**9) %}{% endfor %}",
                                      "{{ raise_exception('no') }}", "{% if %}"])
def test_trusted_a_template_that_fails_is_a_400_naming_chat_template(trusted_url, template):
    for route in ROUTES:
        assert_error(httpx.post(f"{trusted_url}{route}", json=chat(template)), 400,
                     "chat_template", "The chat template could not be applied")


def test_trusted_ordinary_templates_work_as_before(trusted_url, llama_dir):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
    tokens = httpx.post(f"{trusted_url}/tokenize", json=chat(template)).json()["tokens"]
    expected = Tokenizer.from_dir(llama_dir).encode("<user>hi", add_special_tokens=False)
    assert tokens == expected
    response = httpx.post(f"{trusted_url}/v1/chat/completions", json=chat(template))
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == \
        len(expected)
    own = httpx.post(f"{trusted_url}/tokenize", json=chat()).json()["tokens"]  # the model's
    assert own == Tokenizer.from_dir(llama_dir).encode(
        Tokenizer.from_dir(llama_dir).apply_chat_template(USER), add_special_tokens=False)


def test_the_flag_fills_the_server_config_and_is_off_by_default():
    from aserve.server.cli import build_parser, server_config_from

    assert server_config_from(build_parser().parse_args([])).trust_request_chat_template is False
    trusted = server_config_from(build_parser().parse_args(["--trust-request-chat-template"]))
    assert trusted.trust_request_chat_template is True


def test_the_name_of_one_of_the_models_own_templates_needs_no_trust():
    from types import SimpleNamespace

    from aserve.server.chat import _check_request_template
    from aserve.server.errors import ServerError

    tokenizer = SimpleNamespace(chat_template={"default": "D", "tool_use": "T"})
    untrusted = ServerConfig()
    _check_request_template("tool_use", untrusted, tokenizer)  # a name: allowed
    with pytest.raises(ServerError, match="--trust-request-chat-template"):
        _check_request_template("{{ 'T' }}", untrusted, tokenizer)
