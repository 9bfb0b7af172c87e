"""The dashboard end to end, in Debian's Chromium driven by Playwright, against a real `dtask api`,
a real `celery worker` and beat.

One test walks what an operator does: sign in, watch a submitted `diagnostics.sleep` move and end
`success` without reloading, cancel another from its page and see it end `cancelled`; a second key
sees none of it. Screenshots of every page land under the test's tmp dir; with
``DTASK_UI_SCREENSHOTS=docs/screenshots`` the list, task and knowledge base pages are also written
there (the README's images).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks_core.devkit.embedded import free_port
from tests.system.conftest import Cluster
from tests.system.evaluation_pages import walk_evaluation_pages
from tests.system.knowledge_pages import walk_knowledge_pages
from tests.tools import require

pytestmark = pytest.mark.system

ALICE, BOB = "alice-secret-0123456789", "bob-secret-01234567890"
KEYS = f"alice:{ALICE},bob:{BOB}"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Playwright cannot download its own browser here: it drives the system one.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FLOWER_URL = "http://127.0.0.1:5555"
# Four sleeps against three slots: the list also shows a task waiting for capacity.
CAPACITY = "3"


def _need_chromium() -> None:
    how = "./scripts/bootstrap installs it as root: apt-get install chromium"
    require(Path(CHROMIUM).exists(), "chromium", how)


@pytest.fixture
def api(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = cluster.env(
        DTASK_API_KEYS=KEYS,
        DTASK_DIAGNOSTICS="all",
        DTASK_FLOWER_URL=FLOWER_URL,
        DTASK_CAPACITY=CAPACITY,
        DTASK_METRICS_CACHE_SECONDS="1",  # counts as fresh as the table, for the screenshots
    )
    log = tmp_path / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tasks_core.ops.cli", "api", "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        # The api's own log must never hold a key (uvicorn logs each request line).
        logged = log.read_text(errors="replace")
        assert ALICE not in logged and BOB not in logged


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    _need_chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


class Watch:
    """Everything a page asked for and complained about, to check afterwards."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.problems: list[str] = []

    def attach(self, page: Any) -> None:
        page.on("request", lambda request: self.urls.append(request.url))
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on(
            "console",
            lambda msg: (
                self.problems.append(msg.text)
                if msg.type == "error" and "Failed to load resource" not in msg.text
                else None
            ),
        )


async def sign_in(browser: Any, base: str, key: str, watch: Watch) -> Any:
    context = await browser.new_context(viewport={"width": 1360, "height": 820})
    page = await context.new_page()
    watch.attach(page)
    await page.goto(f"{base}/ui")
    assert "/ui/sign-in" in page.url  # no key: sent to sign in
    await page.fill("#key", key)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{base}/ui")
    return page


async def submit(base: str, key: str, task_type: str, payload: dict[str, Any]) -> str:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}) as client:
        r = await client.post("/tasks", json={"task_type": task_type, "payload": payload})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def no_reload_marker(page: Any) -> None:
    await page.evaluate("window.__sameDocument = true")


async def still_same_document(page: Any) -> bool:
    return bool(await page.evaluate("window.__sameDocument === true"))


async def test_dashboard_in_a_real_browser(
    browser: Any, cluster: Cluster, api: str, tmp_path: Path, record_property: Any
) -> None:  # the browser first: without Chromium, skip before starting any process
    started = time.monotonic()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    worker = cluster.start_worker(concurrency=5, DTASK_CAPACITY=CAPACITY)
    cluster.start_beat()
    await cluster.wait_worker_ready(worker)
    await cluster.wait_readiness_fact()
    watch = Watch()

    # ---- alice signs in; the key lives in an HTTP-only, Secure, SameSite=Strict cookie
    context = await browser.new_context(viewport={"width": 1360, "height": 820})
    page = await context.new_page()
    watch.attach(page)
    await page.goto(f"{api}/ui")
    await page.wait_for_url("**/ui/sign-in?next=%2Fui")
    await page.screenshot(path=shots / "sign-in.png")
    await page.fill("#key", ALICE)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{api}/ui")
    (cookie,) = [c for c in await context.cookies() if c["name"] == "dtask_ui"]
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"

    # ---- a submitted sleep moves on the list and ends success, without a reload
    await no_reload_marker(page)
    await submit(api, ALICE, "diagnostics.noop", {"hello": "world"})
    await submit(api, ALICE, "diagnostics.fail", {})
    sleeper = await submit(api, ALICE, "diagnostics.sleep", {"seconds": 8, "steps": 8})
    victim = await submit(api, ALICE, "diagnostics.sleep", {"seconds": 120, "steps": 120})
    for _ in range(2):
        await submit(api, ALICE, "diagnostics.sleep", {"seconds": 5, "steps": 5})
    row = page.locator(f'tr[data-task="{sleeper}"]')
    seen: list[float] = []
    listed = False
    deadline = time.monotonic() + 40
    while (status := await row.get_attribute("data-status", timeout=10_000)) != "success":
        value = float(await row.locator("progress").get_attribute("value") or 0)
        if 0 < value < 100 and value not in seen:
            seen.append(value)
        if len(seen) >= 2 and not listed:  # mid-flight: the README's picture of the list
            await page.screenshot(path=shots / "tasks.png", full_page=True)
            listed = True
        assert time.monotonic() < deadline, f"sleep still {status} at {seen}"
        await page.wait_for_timeout(200)
    print(f"progress values seen on the list: {seen}")
    assert len(seen) >= 2, f"the progress bar did not move: {seen}"
    assert await row.locator("progress").get_attribute("value") == "100.0"
    assert await still_same_document(page), "the list reloaded instead of refreshing in place"

    # ---- a running task is cancelled from its page and ends cancelled, live
    await page.goto(f"{api}/ui/tasks/{victim}")
    live = page.locator("#live")
    await live.locator('span.status:text("running")').wait_for(timeout=20_000)
    await page.wait_for_function("document.querySelector('#live progress').value > 0", timeout=10_000)
    await page.screenshot(path=shots / "task.png", full_page=True)
    await page.click("#live button:text('Cancel')")
    await page.wait_for_url(f"**/ui/tasks/{victim}?notice=cancel_requested")
    await no_reload_marker(page)
    await page.locator('#live[data-status="cancelled"]').wait_for(timeout=20_000)
    assert await still_same_document(page), "the task page reloaded instead of refreshing in place"
    assert await page.locator("#live button:text('Delete')").count() == 1
    assert await page.locator("#live button:text('Cancel')").count() == 0
    await page.screenshot(path=shots / "task-cancelled.png", full_page=True)
    await page.goto(f"{api}/ui/tasks/{sleeper}")
    await page.screenshot(path=shots / "task-success.png", full_page=True)

    # ---- bob, another key, sees none of alice's tasks
    other = await sign_in(browser, api, BOB, watch)
    assert await other.locator("tr[data-task]").count() == 0
    assert await other.locator('[data-count="running"] b').inner_text() == "0"
    await other.screenshot(path=shots / "other-key.png", full_page=True)
    answer = await other.goto(f"{api}/ui/tasks/{sleeper}")
    assert answer is not None and answer.status == 404
    await other.screenshot(path=shots / "other-key-404.png")

    # ---- the knowledge pages: files' states, live, linked to their tasks
    await walk_knowledge_pages(browser, api, ALICE, watch, shots)
    # ---- the evaluation pages: a generating dataset followed to completed, live
    await walk_evaluation_pages(browser, api, ALICE, watch, shots)

    # ---- signing out ends the session; a page open in another tab goes to sign-in by itself
    await page.goto(f"{api}/ui")
    assert await page.locator(f'nav a[href="{FLOWER_URL}"]').count() == 1
    second_tab = await context.new_page()
    watch.attach(second_tab)
    await second_tab.goto(f"{api}/ui")
    await page.click("text=Sign out")
    await page.wait_for_url("**/ui/sign-in")
    await second_tab.wait_for_url("**/ui/sign-in", timeout=10_000)  # its next poll was refused
    await page.goto(f"{api}/ui/tasks/{sleeper}")
    assert "/ui/sign-in" in page.url

    assert not [u for u in watch.urls if ALICE in u or BOB in u], "a key appeared in a URL"
    assert not watch.problems, watch.problems  # no script errors, no Content-Security-Policy refusals
    took = time.monotonic() - started
    print(f"browser test: {took:.1f} s; screenshots in {shots}")
    record_property("browser_test_seconds", round(took, 1))
    _publish(shots)


def _publish(shots: Path) -> None:
    """Copy the list and task pages to DTASK_UI_SCREENSHOTS (docs/screenshots for the README)."""
    target = os.environ.get("DTASK_UI_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for name in ("tasks.png", "task.png", "knowledge.png"):
            shutil.copy(shots / name, Path(target) / name)
