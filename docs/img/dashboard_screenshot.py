"""Remake docs/img/dashboard.png, the README's screenshot, from what the simulator produces.

    .venv/bin/python docs/img/dashboard_screenshot.py

Starts `lockledger serve --dev` on an embedded PostgreSQL of its own (a temporary directory), sets
`lockledger simulate` loose on it (20 AGVs, fixed seed), and once the fleet is busy shows the zones'
timeline and takes the page at 1440x900 in Debian's Chromium (never a downloaded browser). Everything
it started is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.async_api import async_playwright

HERE = Path(__file__).resolve().parent
LOCKLEDGER = Path(sys.executable).with_name("lockledger")
CHROMIUM = "/usr/bin/chromium"
BUSY_AFTER_S = 25.0  # the charts have filled, sagas are in flight


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


async def _screenshot(base_url: str, path: Path) -> None:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": 1440, "height": 900})
        await page.goto(f"{base_url}/ui")
        await page.locator("#feed-status[data-state=live]").wait_for()
        await asyncio.sleep(BUSY_AFTER_S)
        # The timeline of the zones over the last minute.
        await page.locator("#tl-prefix").fill("sim:zone:")
        await page.locator("#tl-window").select_option("60000")
        await page.get_by_role("button", name="Show").click()
        await page.locator("#tl-chart rect.lease").first.wait_for()
        await page.evaluate("window.scrollTo(0, 0)")
        await page.screenshot(path=path)
        await browser.close()


def main() -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="lockledger-screenshot-") as scratch:
        serve = subprocess.Popen(
            [str(LOCKLEDGER), "serve", "--dev", "--port", str(port), "--data-dir", f"{scratch}/pgdata"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        simulate = None
        try:
            deadline = time.monotonic() + 120
            while not _ready(base_url):
                if serve.poll() is not None or time.monotonic() > deadline:
                    sys.exit("lockledger serve did not become ready")
                time.sleep(0.2)
            simulate = subprocess.Popen(
                [str(LOCKLEDGER), "simulate", "--url", base_url, "--agents", "20", "--duration",
                 str(BUSY_AFTER_S + 30), "--seed", "7"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            asyncio.run(_screenshot(base_url, HERE / "dashboard.png"))
            print(f"wrote {HERE / 'dashboard.png'}")
        finally:
            if simulate is not None:
                _stop(simulate)
            _stop(serve)


def _ready(base_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200
    return False


if __name__ == "__main__":
    main()
