"""What every Chromium test of the dashboard shares: Debian's Chromium driven by Playwright, the two
viewports, signing in as the admin `kiln up` created, screenshots and the no-sideways-scroll check."""

import os
import re
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from controlplane.services import REDIS_URL, ROOT, Stack

CHROMIUM = Path(os.environ.get("KILN_TEST_CHROMIUM", "/usr/bin/chromium"))
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run"]
SHOTS = ROOT / "test-output" / "dashboard"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def require_chromium() -> None:
    """Skip, with the command that fixes it, when Chromium or Playwright is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing; install it with: apt-get install chromium chromium-driver")
    pytest.importorskip("playwright.sync_api", reason="playwright is missing; pip install -e '.[test]'")


@contextmanager
def served(tmp_path_factory, name: str, redis_db: int | None = None, **env):
    """Kiln as deployed for a browser test: `kiln up` in a fresh KILN_HOME. With REDIS_DB, a separate Celery worker
    on that database of the test Redis (a database of its own: another Kiln stack on the same server, another
    checkout's CI run, would otherwise consume this stack's tasks); else the embedded worker. Skips, saying why,
    without Chromium, Playwright or (for REDIS_DB) Redis; stops everything it started."""
    if redis_db is not None and REDIS_URL is None:
        pytest.skip("KILN_TEST_REDIS_URL is unset (./dev test sets it when Redis answers)")
    require_chromium()
    redis_url = None if redis_db is None else urlunsplit(urlsplit(REDIS_URL)._replace(path=f"/{redis_db}"))
    running = Stack(tmp_path_factory.mktemp(name), redis_url=redis_url, **env)
    try:
        yield running
    finally:
        running.stop()


@contextmanager
def chromium_browser():
    """A headless Chromium (Debian's), closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, viewport: dict, timeout_ms: int = 30_000, **context_options):
    """A page in a context of its own at VIEWPORT, waiting at most TIMEOUT_MS for anything; the page's script
    errors collect in page.errors (a test asserts there are none)."""
    context = browser.new_context(viewport=viewport, **context_options)
    context.set_default_timeout(timeout_ms)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    return page


def admin_password(stack: Stack) -> str:
    return re.search(r"Created the admin user 'admin' with password: (\S+)", stack.web.output).group(1)


def sign_in(page, stack: Stack, path: str = "/") -> None:
    """Open PATH, which sends a signed-out person to the sign-in form, and sign in as the admin."""
    page.goto(stack.url + path)
    page.fill("#id_username", "admin")
    page.fill("#id_password", admin_password(stack))
    page.click("button[type=submit]")


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def no_horizontal_scroll(page) -> None:
    width, inner = page.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
    assert width <= inner, f"{page.url} scrolls sideways at {inner}px: content is {width}px wide"
