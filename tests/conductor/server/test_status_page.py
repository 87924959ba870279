"""The status page in a real browser: Debian's headless Chromium (driven by its chromedriver through
selenium; `.ci/run` installs both) opens /status on the gateway's admin port in front of emulated
workers, takes the admin key typed into it, lists every instance, shows a request's decision (with
its candidates) live once the request went through the gateway, and makes no request to any host
but the gateway's admin port: the browser's own network log says so, and its console has no
Content-Security-Policy violation (what a page pulling a CDN script would show, if not the request)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.server.app import create_admin_app, create_app
from tests.support.ci import require, require_import
from tests.support.emulator import start_emulator
from tests.support.servers import free_port, serve, serve_gateway

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ADMIN_KEY = "adm-page"
WAIT_S = 60.0  # a bound a hang alone reaches on a starved box, not a speed check

webdriver = require_import("selenium.webdriver", "selenium (the test extra) drives the browser")
require(os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), "Debian's chromium and chromium-driver (.ci/run)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@contextmanager
def _gateway() -> Iterator[tuple[str, str]]:
    """(public URL, admin URL) of a kvcache_aware gateway with an admin port, before 2 prefills, 1 decode."""
    with ExitStack() as stack:
        emu = {"model": "tiny", "time_scale": 0.01, "log_level": "warning"}
        prefills = [stack.enter_context(start_emulator("prefill", "nixl", **emu)) for _ in range(2)]
        decode = stack.enter_context(start_emulator("decode", "nixl", **emu))
        settings = load_settings(
            environ={},
            overrides={
                "prefill": [{"url": p.url} for p in prefills],
                "decode": [decode.url],
                "policy": "kvcache_aware",
                "admin_port": free_port(),
                "auth": {"admin_api_keys": [ADMIN_KEY]},
                "logs": {"level": "warning"},
            },
        )
        gateway = Gateway(settings)
        public = stack.enter_context(serve_gateway(gateway))
        admin = stack.enter_context(serve(create_admin_app(gateway, create_app(gateway)), settings.admin_port))
        yield public.url, admin.url


@pytest.fixture
def browser(tmp_path: Any) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--user-data-dir={tmp_path}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _requested_urls(driver: Any, page: str) -> list[str]:
    """Every URL asked for from the navigation to `page` on, from Chrome's DevTools network events
    (before it, the fresh browser's own new-tab page loads its chrome:// parts)."""
    urls: list[str] = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if urls or url == page:
                urls.append(url)
    return urls


def _cells(driver: Any, selector: str) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, selector)]


def test_the_status_page_shows_the_fleet_and_decisions_live(browser: Any) -> None:
    assert shutil.which(CHROMEDRIVER)
    with _gateway() as (public, admin):
        browser.get(admin + "/status")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda d: "401" in d.find_element(By.ID, "error").text)  # no key yet: the poll is refused
        browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        browser.find_element(By.ID, "use").click()
        wait.until(lambda d: len(_cells(d, "#instances tr[data-instance]")) == 3)
        assert sorted(e.get_attribute("data-instance") for e in browser.find_elements(By.CSS_SELECTOR, "tr[data-instance]")) == [
            "decode-0",
            "prefill-0",
            "prefill-1",
        ]
        assert not browser.find_elements(By.CSS_SELECTOR, "#decisions tr[data-request-id]")
        r = httpx.post(public + "/v1/completions", json={"model": "tiny", "prompt": "where does this go", "max_tokens": 4})
        assert r.status_code == 200
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#decisions tr[data-request-id]")) == 1)
        row = browser.find_element(By.CSS_SELECTOR, "#decisions tr[data-request-id]")
        assert "routed" in row.text and "decode-0" in row.text
        candidates = {c.get_attribute("textContent") for c in row.find_elements(By.CSS_SELECTOR, ".cands td:first-child")}
        assert {"prefill-0", "prefill-1", "decode-0"} <= candidates  # each candidate's predictions ride along
        key_kept = browser.execute_script("return sessionStorage.getItem('conductor-admin-key')")
        assert key_kept == ADMIN_KEY
        urls = _requested_urls(browser, admin + "/status")
    origin = urlsplit(admin).netloc
    assert any(u.startswith(admin + "/admin/status") for u in urls)  # the log sees the page's polls
    assert [u for u in urls if urlsplit(u).netloc != origin] == []  # and nothing but the gateway's admin port
    console = [e["message"] for e in browser.get_log("browser")]
    assert not [m for m in console if "Content Security Policy" in m], console
