"""What every page test uses: Debian's Chromium, driven by Playwright, and a fresh tab
per test that fails it on a script error or a request beyond loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright

CHROMIUM = Path("/usr/bin/chromium")

# Playwright's own browser download does not work here: use Debian's Chromium, and keep
# it from reaching anything but the servers under test.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS
        )
        yield launched
        await launched.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    """A fresh tab (own sessionStorage) that fails the test on a script error or on any
    request that leaves 127.0.0.1."""
    context = await browser.new_context(viewport={"width": 1100, "height": 820})
    tab = await context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    tab.on(
        "request",
        lambda request: (
            None
            if request.url.startswith(("http://127.0.0.1:", "data:"))
            else outside.append(request.url)
        ),
    )
    tab.on("pageerror", lambda error: errors.append(str(error)))
    yield tab
    await context.close()
    assert outside == [], f"the page reached beyond loopback: {outside}"
    assert errors == [], f"script errors on the page: {errors}"
