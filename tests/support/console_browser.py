"""The operator console (/admin/) in a real browser, for the live tests that look at it:
Debian's chromium, headless, driven by selenium through the system chromedriver (no
browser download), and readers of the page's keyed tables."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="chromium is not installed (apt-get install chromium chromium-driver; "
           "`make test` installs them through `make system-deps`)")


@contextlib.contextmanager
def open_browser() -> Iterator:
    """A headless chromium, quit at the end of the block."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1500,1100", "--disable-extensions", "--no-first-run"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def shot(shots: Path, drv, name: str) -> Path:
    p = shots / f"console-{name}.png"
    drv.save_screenshot(str(p))
    return p


def cells(drv, table: str, key: str) -> list[str] | None:
    """The texts of the row keyed `key` in `table` (None: no such row)."""
    return drv.execute_script(
        "const tr = Array.from(document.querySelectorAll(arguments[0] + ' tbody tr'))"
        ".find((r) => r.dataset.key === arguments[1]);"
        "return tr ? Array.from(tr.cells).map((c) => c.textContent) : null;", table, key)


def kinds(drv) -> list[str]:
    return drv.execute_script("return Array.from(document.querySelectorAll('#incidents tbody tr'))"
                              ".map((r) => r.dataset.kind);")


def ranks_serving(drv, dep_id: str, world: int) -> bool:
    rows = [cells(drv, "#ranks", f"{dep_id}/{r}") for r in range(world)]
    return all(row is not None and row[4] == "serving" for row in rows)
