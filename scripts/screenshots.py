#!/usr/bin/env python3
"""Take the README's screenshots of the web pages: `docs/images/playground.png` and
`docs/images/dashboard.png`.

    python scripts/screenshots.py            # from the repository root; needs chromium,
                                             # chromium-driver and selenium (the test extra)

It serves the built-in demo model in this process, holds a short conversation in the
playground, then opens the dashboard while a few clients stream completions (some sharing a
prompt prefix, so the prefix cache hits) and shoots it once its charts have some history.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.browser import chromium_missing, headless_chromium  # noqa: E402
from helpers.server import serving  # noqa: E402

from aserve.assets import DEMO_MODEL_DIR, DEMO_MODEL_NAME  # noqa: E402
from aserve.engine.arg_utils import EngineArgs  # noqa: E402
from aserve.server import ServerConfig, build_app  # noqa: E402

GREETINGS = ["Hello", "How are you?", "What is your name?"]
LOAD_CLIENTS = 4
LOAD_SECONDS = 12.0


def converse(driver, url: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{url}/")
    driver.execute_script("localStorage.clear()")
    driver.get(f"{url}/")
    driver.find_element(By.ID, "temperature").send_keys("0")
    for k, text in enumerate(GREETINGS, start=1):
        driver.find_element(By.ID, "message").send_keys(text)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 60).until(lambda d, k=k: len(d.find_elements(
            By.CSS_SELECTOR, '[data-role="assistant"][data-state="done"]')) == k)


def load(url: str, stop: threading.Event, client: int) -> None:
    """Stream completions until `stop`: half share a long prompt prefix."""
    import httpx

    shared = "You are a helpful assistant. Answer briefly and kindly. " * 8
    with httpx.Client(timeout=60) as http:
        for round_ in itertools.count():
            if stop.is_set():
                return
            prompt = (shared if client % 2 else f"Request {round_} of client {client}: ") + "Hi"
            body = {"prompt": prompt, "max_tokens": 48, "ignore_eos": True, "stream": True}
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    ns = parser.parse_args()
    if (why := chromium_missing()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    ns.out.mkdir(parents=True, exist_ok=True)
    app = build_app(EngineArgs(model=str(DEMO_MODEL_DIR), dtype="float32", seed=0),
                    ServerConfig(served_model_name=DEMO_MODEL_NAME))
    with serving(app) as url:
        driver = headless_chromium(width=1100, height=820)
        try:
            converse(driver, url)
            driver.save_screenshot(str(ns.out / "playground.png"))
            driver.set_window_size(1100, 900)  # the figures and the steps' chart
            driver.get(f"{url}/dashboard")
            stop = threading.Event()
            clients = [threading.Thread(target=load, args=(url, stop, k))
                       for k in range(LOAD_CLIENTS)]
            for thread in clients:
                thread.start()
            time.sleep(LOAD_SECONDS)
            driver.save_screenshot(str(ns.out / "dashboard.png"))
            stop.set()
            for thread in clients:
                thread.join()
        finally:
            driver.quit()
    for name in ("playground.png", "dashboard.png"):
        print(f"{ns.out / name}: {(ns.out / name).stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
