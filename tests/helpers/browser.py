"""Headless Chromium for the browser tests and `scripts/screenshots.py`: Debian's `chromium`
and `chromium-driver` (`apt-get install -y chromium chromium-driver`; `.ci/run` installs them)
driven by selenium, found on PATH so selenium never downloads a browser."""

from __future__ import annotations

import shutil

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",  # CI and containers run as root, where Chromium's sandbox cannot start
    "--disable-dev-shm-usage",  # a container's /dev/shm is often 64 MB
    "--disable-gpu",
]


def chromium_missing() -> str | None:
    """Why the browser cannot start here (None: it can)."""
    try:
        import selenium  # noqa: F401 - in the test extra
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (apt-get install -y chromium chromium-driver)"
    return None


def headless_chromium(width: int = 1200, height: int = 800):
    """A selenium WebDriver of a fresh headless Chromium; `quit()` it when done."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in [*CHROMIUM_FLAGS, f"--window-size={width},{height}"]:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
