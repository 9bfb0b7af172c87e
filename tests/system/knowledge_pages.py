"""The knowledge pages in the dashboard's browser test (tests/system/test_ui_browser.py), which
calls ``walk_knowledge_pages`` with its browser and api: bases, a base's files changing state in
place, a failed file's link to its task, the reindex form.

Files are put in their states the way a worker moves them (tests/knowledge_states.py), none left
pending for the test's worker to take: showing them needs no Milvus or S3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.knowledge_states import add_file, break_, index, new_base, parse


async def walk_knowledge_pages(browser: Any, api: str, key: str, watch: Any, shots: Path) -> None:
    from tests.system import test_ui_browser as ui

    svc = build_services(make_settings(), pool_size=2)
    try:
        base = await new_base(svc, "alice", "manuals")
        files = {}
        for name, chunks in (("install.md", 14), ("upgrade.txt", 9), ("reference.txt", 31)):
            files[name] = await add_file(svc, base, "alice", name)
            await index(svc, *files[name], chunks=chunks)
        files["scan.txt"] = await add_file(svc, base, "alice", "scan.txt")
        await break_(svc, *files["scan.txt"], "ValueError: the file holds no text")
        files["faq.txt"] = await add_file(svc, base, "alice", "faq.txt")
        reading = await parse(svc, *files["faq.txt"])
        await new_base(svc, "bob", "bob-notes")

        page = await ui.sign_in(browser, api, key, watch)
        await page.click("header nav >> text=Knowledge")
        await page.wait_for_url(f"{api}/ui/knowledge")
        listed = await page.locator("tr[data-base]").all_inner_texts()
        assert len(listed) == 1 and "manuals" in listed[0], listed  # not bob's base
        await page.click("text=manuals")
        await page.wait_for_url(f"{api}/ui/knowledge/bases/{base}")
        faq = f'tr[data-file="{files["faq.txt"][0]}"]'
        assert await page.locator(faq).get_attribute("data-status") == "parsing"

        # Its worker finishes the file: the row changes in place, without a reload.
        await ui.no_reload_marker(page)
        await index(svc, *files["faq.txt"], chunks=4, token=reading)
        await page.locator(f'{faq}[data-status="indexed"]').wait_for(timeout=10_000)
        assert await ui.still_same_document(page), "the files table reloaded the page"
        await page.screenshot(path=shots / "knowledge.png", full_page=True)

        # The failed file links to the task that failed it.
        await page.click(f'tr[data-file="{files["scan.txt"][0]}"] a[data-task]')
        await page.wait_for_url(f"{api}/ui/tasks/{files['scan.txt'][1]}")
        assert await page.locator("#live").get_attribute("data-status") == "failed"

        # The reindex form posts with its token; this api has no stores configured, and says so.
        await page.go_back()
        await page.click("text=Reindex failed files")
        await page.wait_for_url(f"{api}/ui/knowledge/bases/{base}/reindex")
        assert "Knowledge stores are not configured" in await page.locator("h1").inner_text()
        await page.context.close()
    finally:
        await svc.close()
