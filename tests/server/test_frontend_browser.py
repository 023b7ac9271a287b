"""The web pages in a real headless Chromium, against servers of the built-in demo model: a
greeting typed into "Message" and sent streams a reply; a reply carrying HTML and script, forced
through the page's own JSON-schema box, shows as text and runs nothing; Stop aborts a long reply
in the engine; the dashboard's figures move as requests are served; under `/llm/` with
`--api-key` the page asks for the key and both pages work with it, and the key bar leaves the
Send row on screen on a laptop and a phone. What the playground sends: tools with the default
tool_choice (none: the server's default), never the question of a failed turn (shown failed;
Regenerate retries it); a bad schema's error names `response_format`; tokens/s only from enough
tokens over enough time.

Skipped only where Chromium, its driver or selenium is missing (`.ci/run` installs them).
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.browser import chromium_missing, headless_chromium
from helpers.server import serving

from aserve.assets import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from aserve.engine.arg_utils import EngineArgs
from aserve.server import ServerConfig, build_app

pytestmark = [
    pytest.mark.spawns,  # uvicorn servers and a Chromium
    pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing())),
]

WAIT_S = 60
ASSISTANT_DONE = '[data-role="assistant"][data-state="done"]'
PAYLOAD = "<img src=x onerror=window.__pwned=1><script>window.__pwned=2</script>"
NOT_A_SCHEMA = {"type": "nope"}  # valid JSON, refused by the server's schema check
LONG_LIST = {"type": "array", "items": {"type": "integer"}, "minItems": 400}


def demo_app(**config):
    return build_app(EngineArgs(model=str(DEMO_MODEL_DIR), dtype="float32"),
                     ServerConfig(served_model_name=DEMO_MODEL_NAME, **config))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving(demo_app()) as url:
        yield url


@pytest.fixture(scope="module")
def reasoning_server() -> Iterator[str]:
    """deepseek_r1's parser: the demo model never writes `</think>`, so all it says is reasoning."""
    with serving(demo_app(reasoning_parser="deepseek_r1")) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_llm_server() -> Iterator[str]:
    """examples/mount_in_fastapi.py: the app under /llm of a FastAPI parent, here with an API
    key; yields the parent's URL."""
    pytest.importorskip("fastapi")
    path = Path(__file__).parents[2] / "examples" / "mount_in_fastapi.py"
    spec = importlib.util.spec_from_file_location("mount_in_fastapi", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with serving(example.make_app(DEMO_MODEL_DIR, api_key="secret", dtype="float32")) as url:
        yield url


@pytest.fixture(scope="module")
def driver():
    browser = headless_chromium()
    yield browser
    browser.quit()


def wait(driver, condition, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def text_of(driver, selector: str) -> str:
    """The first match's text, "" while the page has not made it yet (a wait polls this)."""
    found = css(driver, selector)
    return found[0].text if found else ""


def open_fresh(driver, url: str) -> None:
    """Open `url` with this origin's storage (conversation, key) emptied."""
    driver.get(url)
    driver.execute_script("localStorage.clear()")
    driver.get(url)


def send(driver, text: str) -> None:
    """Type into the textbox named "Message" and press the button named "Send"."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.XPATH, "//label[normalize-space()='Message']")
    box = driver.find_element(By.ID, box.get_attribute("for"))
    assert box.accessible_name == "Message" and box.aria_role == "textbox"
    box.send_keys(text)
    button = driver.find_element(By.XPATH, "//button[normalize-space()='Send']")
    assert button.accessible_name == "Send"
    button.click()


def record_requests(driver) -> None:
    """From now on the open page keeps the JSON body of each fetch it makes (`sent_bodies`)."""
    driver.execute_script("""
        window.__sent = [];
        const fetchNow = window.fetch.bind(window);
        window.fetch = (url, init) => {
          if (init?.body) window.__sent.push(JSON.parse(init.body));
          return fetchNow(url, init);
        };""")


def sent_bodies(driver) -> list[dict]:
    return driver.execute_script("return window.__sent")


def sent_messages(driver) -> list[tuple[str, str]]:
    """(role, content) of each message the last request sent."""
    return [(m["role"], m["content"]) for m in sent_bodies(driver)[-1]["messages"]]


def last_reply(driver):
    wait(driver, lambda d: len(css(d, ASSISTANT_DONE)) == len(css(d, '[data-role="assistant"]'))
         and css(d, ASSISTANT_DONE))
    return css(driver, '[data-role="assistant"]')[-1]


def test_a_greeting_streams_a_reply_kept_across_a_reload(server, driver):
    open_fresh(driver, f"{server}/")
    send(driver, "Hello")
    reply = last_reply(driver)
    text = reply.find_element("css selector", ".content").text
    assert text.strip()
    meta = reply.find_element("css selector", ".meta").text
    assert "completion tokens" in meta  # the usage chunk of the stream (include_usage)
    assert "error" not in reply.find_element("css selector", ".meta").get_attribute("class")
    assert [t.text for t in css(driver, '[data-role="user"] .content')] == ["Hello"]
    driver.refresh()  # the conversation lives in localStorage
    wait(driver, lambda d: len(css(d, "[data-role]")) == 2)
    assert css(driver, '[data-role="assistant"] .content')[0].text == text
    assert_same_origin(driver, server)


def test_regenerate_replaces_the_last_reply(server, driver):
    open_fresh(driver, f"{server}/")
    send(driver, "Hi")
    last_reply(driver)
    css(driver, "#regenerate")[0].click()
    wait(driver, lambda d: css(d, '[data-role="assistant"][data-state="streaming"]')
         or css(d, ASSISTANT_DONE))
    last_reply(driver)
    assert [t.get_attribute("data-role") for t in css(driver, "[data-role]")] == [
        "user", "assistant"]


def test_a_reply_of_html_and_script_shows_as_text_and_runs_nothing(server, driver):
    open_fresh(driver, f"{server}/")
    schema = {"type": "object", "properties": {"html": {"const": PAYLOAD}},
              "required": ["html"], "additionalProperties": False}
    css(driver, "#schema")[0].send_keys(json.dumps(schema))
    send(driver, "Hello")
    reply = last_reply(driver)
    assert PAYLOAD in reply.find_element("css selector", ".content").text
    assert not css(driver, "#messages img, #messages script, #messages [onerror]")
    assert driver.execute_script("return window.__pwned") is None


def test_the_markdown_renderer_escapes_html_and_links_only_http(server, driver):
    open_fresh(driver, f"{server}/")
    payloads = [
        "<script>window.__pwned=1</script>",
        "<img src=x onerror=\"window.__pwned=2\">",
        "**<svg onload=window.__pwned=3>**",
        "[click](javascript:window.__pwned=4) [data](data:text/html,<b>x</b>)",
        "| a |\n|---|\n| <img src=y onerror=window.__pwned=5> |",
        "```\n</code></pre><img src=z onerror=window.__pwned=6>\n```",
        "[fine](https://example.com/a?b=<c>)",
    ]
    html = driver.execute_async_script("""
        const [texts, done] = arguments;
        import(new URL("static/markdown.js", document.baseURI)).then((markdown) => {
          const box = document.createElement("div");
          box.id = "rendered";
          for (const text of texts) box.append(markdown.renderMarkdown(text));
          document.body.append(box);  // in the document: an <img> would load, and fail
          setTimeout(() => done(box.innerHTML), 200);
        });""", payloads)
    assert driver.execute_script("return window.__pwned") is None
    assert not css(driver, "#rendered img, #rendered script, #rendered svg")
    links = [a.get_attribute("href") for a in css(driver, "#rendered a")]
    assert links == ["https://example.com/a?b=%3Cc%3E"]
    assert "&lt;script&gt;" in html and "onerror=" in html  # shown, as text


def test_a_required_tool_call_is_shown_with_its_arguments(server, driver):
    from selenium.webdriver.support.select import Select

    open_fresh(driver, f"{server}/")
    city = {"type": "string", "maxLength": 12}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": city}, "required": ["city"],
        "additionalProperties": False}}}
    css(driver, "#tools")[0].send_keys(json.dumps([tool]))
    Select(css(driver, "#tool_choice")[0]).select_by_visible_text("required")
    send(driver, "Weather in Paris?")
    reply = last_reply(driver)
    call = reply.find_element("css selector", ".tool-calls").text
    assert call.startswith("get_weather(") and '"city"' in call
    assert "finish: tool_calls" in reply.find_element("css selector", ".meta").text


def test_tools_with_the_default_tool_choice_are_answered_by_a_default_server(server, driver):
    """The menu's default sends no tool_choice: the server's own default ("auto" with tools),
    which a server started without any tool flags answers."""
    open_fresh(driver, f"{server}/")
    record_requests(driver)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    css(driver, "#tools")[0].send_keys(json.dumps([tool]))
    assert css(driver, "#tool_choice")[0].get_attribute("value") == ""  # the default
    send(driver, "Weather in Paris?")
    reply = last_reply(driver)
    body = sent_bodies(driver)[-1]
    assert body["tools"] == [tool] and "tool_choice" not in body
    meta = reply.find_element("css selector", ".meta")
    assert "error" not in meta.get_attribute("class"), meta.text
    assert "completion tokens" in meta.text


def test_reasoning_deltas_are_shown_apart_from_the_answer(reasoning_server, driver):
    open_fresh(driver, f"{reasoning_server}/")
    send(driver, "Hello")
    reply = last_reply(driver)
    reasoning = reply.find_element("css selector", ".reasoning")
    assert reasoning.is_displayed()
    reasoning.find_element("css selector", "summary").click()  # open it
    assert reply.find_element("css selector", ".thought").text.strip()
    assert reply.find_element("css selector", ".content").text == ""


def test_a_failed_turn_is_shown_failed_never_sent_again_and_regenerate_retries_it(
        server, driver):
    open_fresh(driver, f"{server}/")
    record_requests(driver)
    schema = css(driver, "#schema")[0]
    schema.send_keys(json.dumps(NOT_A_SCHEMA))
    send(driver, "First")
    failed = last_reply(driver)
    assert "error" in failed.find_element("css selector", ".meta").get_attribute("class")
    question = css(driver, '[data-role="user"]')[0]
    assert question.get_attribute("data-failed") is not None
    assert "Not answered" in question.find_element("css selector", ".meta").text

    schema.clear()
    css(driver, "#regenerate")[0].click()  # retries the failed turn: its question, once
    wait(driver, lambda d: len(sent_bodies(d)) == 2)
    last_reply(driver)
    assert sent_messages(driver) == [("user", "First")]
    assert not css(driver, "[data-failed]")
    assert css(driver, '[data-role="user"] .meta')[0].text == ""
    answer = driver.execute_script(  # as kept, before markdown
        'return JSON.parse(localStorage.getItem("aserve:/:chat")).messages[1].content')
    assert answer.strip()

    schema.send_keys(json.dumps(NOT_A_SCHEMA))
    send(driver, "Second")
    wait(driver, lambda d: len(sent_bodies(d)) == 3)
    last_reply(driver)
    schema.clear()
    send(driver, "Third")  # after the failed "Second": sent without it
    wait(driver, lambda d: len(sent_bodies(d)) == 4)
    assert last_reply(driver).find_element("css selector", ".content").text.strip()
    assert sent_messages(driver) == [("user", "First"), ("assistant", answer), ("user", "Third")]
    driver.refresh()  # kept failed across a reload
    wait(driver, lambda d: len(css(d, "[data-role]")) == 6)
    assert [t.text for t in css(driver, "[data-failed] .content")][:1] == ["Second"]
    assert len(css(driver, "[data-failed]")) == 2  # "Second" and its error


def test_a_bad_schema_error_names_response_format_the_field_the_page_filled(server, driver):
    open_fresh(driver, f"{server}/")
    css(driver, "#schema")[0].send_keys(json.dumps(NOT_A_SCHEMA))
    send(driver, "Hello")
    meta = last_reply(driver).find_element("css selector", ".meta").text
    assert "not a valid JSON schema" in meta and "response_format" in meta, meta
    assert "structured_outputs" not in meta, meta


def test_tokens_per_second_are_shown_only_from_enough_tokens_over_enough_time(server, driver):
    open_fresh(driver, f"{server}/")
    css(driver, "#schema")[0].send_keys(json.dumps(LONG_LIST))  # never done within 3 tokens
    css(driver, "#max_tokens")[0].send_keys("3")
    send(driver, "Count")
    meta = last_reply(driver).find_element("css selector", ".meta").text
    assert "3 completion tokens" in meta and "finish: length" in meta, meta
    assert "tok/s" not in meta, meta
    stats = driver.execute_async_script("""
        const done = arguments[0];
        import(new URL("static/playground.js", document.baseURI)).then(({ replyStats }) => {
          const usage = (n) => ({ prompt_tokens: 5, completion_tokens: n });
          const times = (ms) => ({ started: 0, first: 100, last: 100 + ms });
          done([
            replyStats({ usage: usage(50), ...times(1000), finish: "length" }),
            replyStats({ usage: usage(1), ...times(0), finish: "stop" }),
            replyStats({ usage: usage(9), ...times(1000), finish: "stop" }),
            replyStats({ usage: usage(50), ...times(20), finish: "stop" }),
            replyStats({ usage: usage(50), ...times(1000), error: "gone" }),
          ]);
        });""")
    assert stats[0] == ("5 prompt + 50 completion tokens · 49.0 tok/s · first token 0.10 s · "
                        "finish: length")
    assert not any("tok/s" in line for line in stats[1:]), stats  # 1 or 9 tokens, one burst,
    assert all("completion tokens" in line for line in stats[1:])  # an error


@pytest.mark.parametrize("width, height, phone", [(1280, 720, False), (390, 844, True)])
def test_with_an_api_key_the_key_bar_leaves_the_send_row_on_screen(
        keyed_llm_server, driver, width, height, phone):
    """The key form widens the header (on a phone, by lines); the conversation, long here,
    scrolls inside the page instead of pushing the message box and Send below it."""
    url = f"{keyed_llm_server}/llm/"
    turns = [{"role": role, "content": f"Message {i}\n" * 4}
             for i in range(20) for role in ("user", "assistant")]
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": phone})
    try:
        open_fresh(driver, url)
        driver.execute_script("localStorage.setItem(arguments[0], JSON.stringify(arguments[1]))",
                              "aserve:/llm/:chat", {"messages": turns, "settings": {}})
        driver.get(url)
        wait(driver, lambda d: [f for f in css(d, "form.api-key") if f.is_displayed()])
        assert len(css(driver, "[data-role]")) == len(turns)
        for selector in ("#send", "#message", "form.api-key button"):
            box = driver.execute_script("""
                const r = document.querySelector(arguments[0]).getBoundingClientRect();
                const hit = document.elementFromPoint((r.left + r.right) / 2,
                                                      (r.top + r.bottom) / 2);
                return {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                        width: innerWidth, height: innerHeight,
                        shown: hit === document.querySelector(arguments[0])};""", selector)
            assert (box["width"], box["height"]) == (width, height)
            assert 0 <= box["top"] and box["bottom"] <= height, (selector, box)
            assert 0 <= box["left"] and box["right"] <= width, (selector, box)
            assert box["shown"], (selector, box)  # nothing on top of it
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def streaming_text(driver) -> str:
    """The text of the reply streaming now ("" when none is)."""
    return "".join(e.text for e in css(driver, '[data-state="streaming"] .content'))


def test_stop_aborts_a_long_reply_in_the_engine(server, driver):
    open_fresh(driver, f"{server}/")
    long_list = {"type": "array", "items": {"type": "integer"}, "minItems": 400}
    css(driver, "#schema")[0].send_keys(json.dumps(long_list))
    send(driver, "Count")
    wait(driver, lambda d: len(streaming_text(d)) > 10)  # shown while it streams
    css(driver, "#stop")[0].click()
    reply = last_reply(driver)
    assert "finish: stopped" in reply.find_element("css selector", ".meta").text
    deadline = time.monotonic() + 10
    while httpx.get(f"{server}/dashboard/stats").json()["requests_running"]:
        assert time.monotonic() < deadline, "the engine kept running the stopped reply"
        time.sleep(0.1)


def test_the_dashboard_counts_generated_tokens_live(server, driver):
    open_fresh(driver, f"{server}/dashboard")
    metrics = ("requests_running", "requests_waiting", "kv_cache_usage",
               "generation_tokens_total", "step_composition")
    # dashboard.js builds the figures from its first poll: wait for them, then check each
    wait(driver, lambda d: css(d, '[data-metric="requests_running"]'))
    for metric in metrics:
        assert css(driver, f'[data-metric="{metric}"]'), metric

    def generated(d) -> int | None:
        text = text_of(d, '[data-metric="generation_tokens_total"] .value')
        return int(text.replace(",", "")) if text[:1].isdigit() else None

    before = wait(driver, lambda d: generated(d) is not None and (generated(d),))[0]
    body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200
    wait(driver, lambda d: generated(d) >= before + 16)
    assert css(driver, "#step-bars rect")  # the steps that made them
    assert_same_origin(driver, server)


def test_under_llm_with_an_api_key_the_pages_ask_for_it_and_use_it(keyed_llm_server, driver):
    open_fresh(driver, f"{keyed_llm_server}/llm/")
    form = wait(driver, lambda d: [f for f in css(d, "form.api-key") if f.is_displayed()])[0]
    form.find_element("css selector", "input").send_keys("secret")
    form.find_element("css selector", "button").click()
    wait(driver, lambda d: "llm" in text_of(d, "#model"))  # (the example's name)
    send(driver, "Hello")
    reply = last_reply(driver)
    assert reply.find_element("css selector", ".content").text.strip()
    driver.get(f"{keyed_llm_server}/llm/dashboard")  # the key is kept for this app's pages
    wait(driver, lambda d: text_of(d, '[data-metric="generation_tokens_total"] .value')
         not in ("", "0", "–"))
    assert not [f for f in css(driver, "form.api-key") if f.is_displayed()]
    assert_same_origin(driver, keyed_llm_server)


def assert_same_origin(driver, origin: str) -> None:
    """Every request the open page made (documents, modules, styles, fetches) went to `origin`."""
    urls = driver.execute_script(
        "return performance.getEntriesByType('navigation')"
        ".concat(performance.getEntriesByType('resource')).map(e => e.name)")
    assert urls and all(url.startswith(origin + "/") for url in urls), urls
