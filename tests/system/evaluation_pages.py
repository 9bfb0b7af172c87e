"""The evaluation pages in the dashboard's browser test (tests/system/test_ui_browser.py), which
calls ``walk_evaluation_pages`` with its browser and api: the datasets list, a generating dataset
whose page follows it to ``completed`` in place (htmx under the page's CSP), its link to its task.

Datasets are put in their states the way a worker moves them (tests/evaluation_states.py), claimed
at once, so none is left pending for the test's worker to take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from domains.evaluation import store
from tasks_core.model import Status
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.evaluation_states import finish, generate, new_dataset
from tests.knowledge_states import new_base


async def walk_evaluation_pages(browser: Any, api: str, key: str, watch: Any, shots: Path) -> None:
    from tests.system import test_ui_browser as ui

    svc = build_services(make_settings(), pool_size=2)
    try:
        base = await new_base(svc, "alice", "handbook")
        dataset_id, task_id = await new_dataset(svc, base, "alice", 8)
        token = await generate(svc, dataset_id, task_id, 5)

        page = await ui.sign_in(browser, api, key, watch)
        await page.click("header nav >> text=Evaluation")
        await page.wait_for_url(f"{api}/ui/evaluation")
        row = page.locator(f'tr[data-dataset="{dataset_id}"]')
        assert await row.get_attribute("data-status") == "generating"
        await row.locator("a").first.click()
        await page.wait_for_url(f"{api}/ui/evaluation/datasets/{dataset_id}")
        assert await page.locator("#live").get_attribute("data-status") == "generating"

        # Its worker stores the last items and the task succeeds: the page follows, no reload.
        await ui.no_reload_marker(page)
        async with svc.engine.begin() as conn:
            items = [
                {"chunk_id": f"chunk-{i}", "ordinal": 0, "question": f"q{i}?", "answer": "a",
                 "relevant_chunk_ids": [f"chunk-{i}"]}
                for i in range(5, 8)
            ]  # fmt: skip
            assert await store.add_items(conn, dataset_id, task_id, token, items) == 8
        await finish(svc, task_id, token, Status.SUCCESS)
        await page.locator('#live[data-status="completed"]').wait_for(timeout=10_000)
        assert await page.locator("#live [data-items]").get_attribute("data-items") == "8"
        assert await ui.still_same_document(page), "the dataset page reloaded instead of refreshing"
        await page.screenshot(path=shots / "evaluation-dataset.png", full_page=True)

        # The dataset links to the task that generated it.
        await page.click("#live a[data-task]")
        await page.wait_for_url(f"{api}/ui/tasks/{task_id}")
        assert await page.locator("#live").get_attribute("data-status") == "success"
        await page.context.close()
    finally:
        await svc.close()
