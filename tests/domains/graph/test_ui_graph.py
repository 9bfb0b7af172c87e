"""The graph domain's dashboard pages (domains/graph/routes_ui.py) against the real app, database and
Redis, with test_ui.py's signed-in clients: each base's latest build with its state and task link,
the built graph's top entities, owner rules and escaping.

Builds are made as the API makes them (POST /graph/{id}/build), run in this process as a worker
runs them (claim, handler, terminal hooks) or cancelled through POST /tasks/{id}/cancel; the bases'
chunks are written straight into the knowledge tables (the graph reads nothing else).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import test_ui
from sqlalchemy import text

from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.domains.knowledge.test_ui_knowledge import NO_STORES
from tests.graph_helpers import make_base
from tests.knowledge_helpers import ALICE, BOB, run_pending

app, browser = test_ui.app, test_ui.browser
BASE_ROW = re.compile(r'<tr data-base="([0-9a-f]{32})" data-status="(\w+)">(.*?)</tr>', re.S)
ENTITY = re.compile(r'<tr data-entity="\d+"><td>(.*?)</td><td>(\d+)</td><td>(\d+)</td></tr>')
SMALL = [
    ["Then Ada met Bob and Ada again, near Cyd.", "Then Bob met Ada."],  # Ada x3, Bob x2, Cyd
    ["Then Dee sat alone."],
]


@pytest.fixture
async def svc(clean_db: None) -> Any:
    services = build_services(make_settings(api_keys=test_ui.KEYS, **NO_STORES), pool_size=5)
    yield services
    await services.close()


async def build(client: httpx.AsyncClient, base: str, headers: dict[str, str] = ALICE) -> dict[str, Any]:
    r = await client.post(f"/graph/{base}/build", headers=headers)
    assert r.status_code == 202, r.text
    body: dict[str, Any] = r.json()
    return body


async def latest_builds(svc: Any) -> dict[str, dict[str, Any]]:
    async with svc.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT DISTINCT ON (base_id) * FROM graph_builds ORDER BY base_id, created_at DESC, id DESC"
            )
        )
        return {r["base_id"]: dict(r) for r in rows.mappings()}


async def seeded(svc: Any, client: httpx.AsyncClient) -> dict[str, Any]:
    """Alice: a base built once and being rebuilt, one whose build was cancelled, one never built.
    Bob: a base whose build is pending."""
    rebuilding, _ = await make_base(svc, SMALL)
    first = await build(client, rebuilding)
    assert await run_pending(svc) == ["success"]
    second = await build(client, rebuilding)
    cancelled, _ = await make_base(svc, SMALL)
    stopped = await build(client, cancelled)
    r = await client.post(f"/tasks/{stopped['task_id']}/cancel", headers=ALICE)
    assert r.status_code in (200, 202), r.text
    never, _ = await make_base(svc, SMALL)
    bobs, _ = await make_base(svc, SMALL, owner="bob")
    await build(client, bobs, headers=BOB)
    return {
        "rebuilding": (rebuilding, first, second),
        "cancelled": (cancelled, stopped),
        "never": never,
        "bob": bobs,
    }


async def test_every_graph_page_needs_a_session(browser: Any) -> None:
    client = await browser()
    for path in ("/ui/graph", f"/ui/graph/{'0' * 32}", f"/ui/graph/{'0' * 32}/live"):
        r = await client.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/sign-in?next=%2Fui%2Fgraph")
        r = await client.get(path, headers={"HX-Request": "true"})
        assert (r.status_code, r.headers["hx-redirect"]) == (401, "/ui/sign-in")


async def test_latest_builds_link_to_their_tasks_and_the_graph_shows_its_top_entities(
    svc: Any, browser: Any
) -> None:
    alice = await browser("alice")
    s = await seeded(svc, alice)
    listing = await alice.get("/ui/graph")
    assert '<a href="/ui/graph" aria-current="page">Graph</a>' in listing.text  # the nav entry
    rows, truth = {b: (st, h) for b, st, h in BASE_ROW.findall(listing.text)}, await latest_builds(svc)
    rebuilding, first, second = s["rebuilding"]
    cancelled, stopped = s["cancelled"]
    assert set(rows) == {rebuilding, cancelled, s["never"]}  # not bob's
    for base, task_id, status in (
        (rebuilding, second["task_id"], "building"),
        (cancelled, stopped["task_id"], "cancelled"),
    ):
        shown_status, html = rows[base]
        assert shown_status == truth[base]["status"] == status
        assert str(truth[base]["task_id"]) == task_id and f'<a href="/ui/tasks/{task_id}"' in html
        task_status = (await svc.repo.get(truth[base]["task_id"]))["status"]
        assert f'class="status s-{task_status}">{task_status}<' in html  # the task's own state
    assert rows[s["never"]][0] == "none" and "never built" in rows[s["never"]][1]

    # The rebuilding base: its pending build (polled), and the graph readers still see, top first.
    page = await alice.get(f"/ui/graph/{rebuilding}")
    assert page.status_code == 200 and f'hx-get="/ui/graph/{rebuilding}/live"' in page.text
    assert (
        f'<a href="/ui/tasks/{second["task_id"]}"' in page.text
        and f'data-build="{first["build_id"]}"' in page.text
    )
    assert ENTITY.findall(page.text) == [
        ("Ada", "3", "2"),
        ("Bob", "2", "2"),
        ("Cyd", "1", "1"),
        ("Dee", "1", "1"),
    ]
    assert "<b>4</b> entities" in page.text and "readers see this graph until one succeeds" in page.text
    assert len(ENTITY.findall((await alice.get(f"/ui/graph/{rebuilding}?top=25")).text)) == 4
    # The rebuild succeeds: the polled fragment shows the new graph and stops polling.
    assert await run_pending(svc) == ["success", "success"]  # bob's too
    live = await alice.get(f"/ui/graph/{rebuilding}/live")
    assert 'data-status="built"' in live.text and "hx-get" not in live.text
    assert f'data-build="{second["build_id"]}"' in live.text and len(ENTITY.findall(live.text)) == 4

    gone = await alice.get(f"/ui/graph/{cancelled}")
    assert 'data-status="cancelled"' in gone.text and "hx-get" not in gone.text
    assert truth[cancelled]["error_message"] in gone.text and "No graph built yet." in gone.text
    assert "Never built" in (await alice.get(f"/ui/graph/{s['never']}")).text


async def test_another_key_sees_none_of_it_and_admin_sees_all(svc: Any, browser: Any) -> None:
    alice = await browser("alice")
    s = await seeded(svc, alice)
    bob = await browser("bob")
    listing = await bob.get("/ui/graph")
    assert [b for b, _, _ in BASE_ROW.findall(listing.text)] == [
        s["bob"]
    ] and "<th>Owner</th>" not in listing.text
    for base in (s["rebuilding"][0], s["cancelled"][0], "not-an-id"):
        for path in (f"/ui/graph/{base}", f"/ui/graph/{base}/live"):
            r = await bob.get(path)
            assert r.status_code == 404 and "Ada" not in r.text, path
    root = await browser("root")
    everything = await root.get("/ui/graph")
    assert len(BASE_ROW.findall(everything.text)) == 4 and "<td>bob</td>" in everything.text
    page = await root.get(f"/ui/graph/{s['rebuilding'][0]}")
    assert page.status_code == 200 and "<dt>Owner</dt><dd>alice</dd>" in page.text


async def test_hostile_base_names_are_escaped(svc: Any, browser: Any) -> None:
    base, _ = await make_base(svc, SMALL)
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE knowledge_bases SET name = :n WHERE id = :id"),
            {"n": "<script>alert('g')</script>", "id": base},
        )
    alice = await browser("alice")
    for path in ("/ui/graph", f"/ui/graph/{base}"):
        page = (await alice.get(path)).text
        assert "<script>alert" not in page and "&lt;script&gt;alert(&#39;g&#39;)&lt;/script&gt;" in page
