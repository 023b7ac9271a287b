"""The web pages without a browser: `/`, `/dashboard`, their static files and headers, the
dashboard's JSON figures (and that they hold no prompt), a mount under `/llm`, `--api-key`
(pages free, figures guarded) and `--disable-frontend` (all of it a 404).

Most tests build the app and never start its engine (Starlette's TestClient outside a `with`
runs no lifespan): pages and files need none. The figures' tests run the engine in-process.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin

import pytest
from helpers.server import tiny_app
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from aserve.assets import DEMO_MODEL_DIR
from aserve.engine.arg_utils import EngineArgs
from aserve.server import ServerConfig, build_app
from aserve.server.dashboard import DashboardStats, percentiles
from aserve.server.frontend import STATIC_DIR

KEY = {"Authorization": "Bearer secret"}
ASSET_TYPES = {"index.html": "text/html", "dashboard.html": "text/html", "style.css": "text/css",
               "api.js": "javascript", "markdown.js": "javascript", "chart.js": "javascript",
               "playground.js": "javascript", "dashboard.js": "javascript"}


def app_of(**config) -> Starlette:
    """aserve's app on the demo model, engine not started."""
    return build_app(EngineArgs(model=str(DEMO_MODEL_DIR)), ServerConfig(**config))


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(app_of())


class Links(HTMLParser):
    """Every src and href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and not v.startswith("data:")]


def links_of(html: str) -> list[str]:
    parser = Links()
    parser.feed(html)
    return parser.urls


def test_the_static_directory_holds_exactly_the_files_the_tests_know():
    assert sorted(p.name for p in STATIC_DIR.iterdir()) == sorted(ASSET_TYPES)


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_pages_are_html_with_caching_and_a_strict_content_security_policy(client, path):
    response = client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["etag"] and response.headers["last-modified"]
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "unsafe-inline" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"


def test_playground_has_the_labelled_message_box_and_send_button(client):
    html = client.get("/").text
    assert re.search(r'<label for="message"[^>]*>Message</label>', html)
    assert '<textarea id="message"' in html
    assert re.search(r'<button id="send">Send</button>', html)


@pytest.mark.parametrize("name", sorted(ASSET_TYPES))
def test_static_files_have_their_content_type_and_revalidate_with_a_304(client, name):
    response = client.get(f"/static/{name}")
    assert response.status_code == 200
    assert ASSET_TYPES[name] in response.headers["content-type"]
    assert response.headers["cache-control"] == "no-cache"
    again = client.get(f"/static/{name}", headers={"If-None-Match": response.headers["etag"]})
    assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"


def test_static_files_outside_the_directory_are_not_served(client):
    # `..%2f` reaches StaticFiles as `../frontend.py`, a file that exists one level up
    assert client.get("/static/..%2ffrontend.py").status_code == 404


def test_assets_use_only_relative_urls_no_cdn_and_log_nothing():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert "console." not in text, path.name  # nothing typed or answered reaches a log
        assert "://" not in text.replace("http://www.w3.org/2000/svg", ""), path.name
        assert not re.search(r"""(src|href)=["']/|fetch\(["'`]/|from ["']/""", text), path.name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path.name


@pytest.mark.parametrize("prefix", ["", "/llm"])
@pytest.mark.parametrize("page", ["/", "/dashboard"])
def test_every_url_of_a_page_resolves_to_a_served_file_mounted_or_not(prefix, page):
    """The pages link their files relatively: under /llm/ they resolve under /llm/."""
    app = app_of()
    client = TestClient(Starlette(routes=[Mount(prefix, app)]) if prefix else app)
    response = client.get(prefix + page)
    assert response.status_code == 200
    base = f"http://testserver{prefix}{page}"
    urls = [urljoin(base, u) for u in links_of(response.text)]
    assert len(urls) == 4  # the stylesheet, the script, the two pages
    for url in urls:
        assert url.startswith(f"http://testserver{prefix}/"), url
        assert client.get(url).status_code == 200, url


def test_a_mount_without_the_trailing_slash_redirects_to_the_playground():
    client = TestClient(Starlette(routes=[Mount("/llm", app_of())]))
    response = client.get("/llm", follow_redirects=False)
    assert response.status_code in (307, 308) and response.headers["location"].endswith("/llm/")


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_api_key_leaves_pages_and_files_free_and_guards_the_figures(prefix):
    app = app_of(api_key="secret")
    client = TestClient(Starlette(routes=[Mount(prefix, app)]) if prefix else app)
    for path in ("/", "/dashboard", "/static/playground.js"):
        assert client.get(prefix + path).status_code == 200, path
    refused = client.get(f"{prefix}/dashboard/stats")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == 401
    assert client.get(f"{prefix}/dashboard/stats",
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    allowed = client.get(f"{prefix}/dashboard/stats", headers=KEY)  # past the key: no engine
    assert allowed.status_code == 503 and "not started" in allowed.json()["error"]["message"]
    assert client.get(f"{prefix}/v1/models").status_code == 401  # as before


def test_disable_frontend_serves_none_of_it():
    client = TestClient(app_of(disable_frontend=True))
    for path in ("/", "/dashboard", "/dashboard/stats", "/static/style.css",
                 "/static/index.html"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == 404
    assert client.get("/version").status_code == 200  # the API stays


def test_openapi_lists_the_pages_and_marks_only_the_figures_as_secured():
    doc = TestClient(app_of(api_key="secret")).get("/openapi.json").json()
    paths = doc["paths"]
    assert {"/", "/dashboard", "/dashboard/stats", "/static/{path}"} <= set(paths)
    assert paths["/dashboard/stats"]["get"]["security"] == [{"bearerAuth": []}]
    for free in ("/", "/dashboard", "/static/{path}"):
        assert "security" not in paths[free]["get"], free
    assert "/" not in TestClient(app_of(disable_frontend=True)).get("/openapi.json").json()[
        "paths"]


def test_percentiles_are_nearest_rank_and_none_before_any_sample():
    assert percentiles([]).model_dump() == {"p50": None, "p90": None, "p99": None}
    got = percentiles([float(v) for v in range(100, 0, -1)])  # 1..100, unsorted
    assert (got.p50, got.p90, got.p99) == (50.0, 90.0, 99.0)
    assert percentiles([0.25]).p99 == 0.25


# --- the figures, from a running engine ----------------------------------------------------------

SECRET_PROMPT = "zebra-platypus-7431 is my password"


@pytest.fixture(scope="module")
def live(model_dir_factory):
    """A running app (engine in-process) that has answered one streamed chat request."""
    with TestClient(tiny_app(model_dir_factory("llama"))) as client:
        body = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 6,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        yield client, events


def test_figures_count_the_request_and_its_steps(live):
    client, _ = live
    stats = client.get("/dashboard/stats").json()
    assert set(stats) == set(DashboardStats.model_fields)
    assert stats["engine_running"] is True and stats["model"] == "tiny"
    assert stats["generation_tokens_total"] == 6 and stats["requests_finished_total"] == 1
    assert stats["prompt_tokens_total"] > 0 and stats["requests_running"] == 0
    assert stats["ttft_seconds"]["p50"] > 0 and stats["itl_seconds"]["p99"] > 0
    steps = stats["steps"]
    assert len({len(v) for v in steps.values()}) == 1  # one entry per step in each list
    assert sum(steps["prefill_tokens"]) == stats["prompt_tokens_total"]
    assert sum(steps["decode_tokens"]) == 5  # the first token came with the prefill
    assert all(age >= 0 for age in steps["age_seconds"])


def test_figures_match_what_metrics_reports(live):
    client, _ = live
    stats = client.get("/dashboard/stats").json()
    metrics = client.get("/metrics").text
    assert (f'aserve:generation_tokens_total{{model_name="tiny"}} '
            f'{float(stats["generation_tokens_total"])}') in metrics
    assert 'aserve:num_requests_running{model_name="tiny"} 0.0' in metrics


def strings_in(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return [value] if isinstance(value, str) else []


def test_figures_hold_no_prompt_reply_or_request_id(live):
    client, events = live
    response = client.get("/dashboard/stats")
    assert strings_in(response.json()) == ["tiny"]  # the model's name; all else is numbers
    request_id = re.search(r'"id":"(chatcmpl-[^"]+)"', events[0]).group(1)
    for secret in ("zebra", "password", request_id):
        assert secret not in response.text
