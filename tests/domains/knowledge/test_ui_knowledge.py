"""The knowledge domain's dashboard pages (domains/knowledge/routes_ui.py) against the real app, database
and Redis, with test_ui.py's signed-in clients: bases and files with their states, links to the
files' tasks, owner rules, paging, escaping and the CSRF-guarded reindex form.

Files reach their states the way workers move them (the catalog's owned transitions under a real
claim, the task's terminal hook); Milvus and S3 are needed only to reindex.
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from typing import Any

import httpx
import pytest
import test_ui
from sqlalchemy import text

from app.main import create_app
from domains.knowledge import catalog
from domains.knowledge.tasks import REINDEX
from tasks_core.services import build_services
from tests.conftest import make_settings
from tests.knowledge_states import add_file, break_, index, new_base, parse

# The dashboard tests' fixtures: ``browser`` and ``app`` run on this module's ``svc``.
app, browser = test_ui.app, test_ui.browser
SECRETS, sign_in = test_ui.SECRETS, test_ui.sign_in
FILE_ROW = re.compile(r'<tr data-file="([0-9a-f]{32})" data-status="(\w+)">(.*?)</tr>', re.S)
OLDER = re.compile(r'href="/ui/knowledge/bases/[0-9a-f]{32}\?([^"]*)" rel="next"')
NO_STORES = {"milvus_uri": None, "minio_endpoint": None, "minio_access_key": None, "minio_secret_key": None}


@pytest.fixture
async def svc(clean_db: None) -> Any:
    # Stores explicitly unset: the pages must work without them (the env may name the test stores).
    services = build_services(make_settings(api_keys=test_ui.KEYS, **NO_STORES), pool_size=5)
    yield services
    await services.close()


async def file_rows(svc: Any, base_id: str) -> dict[str, dict[str, Any]]:
    async with svc.engine.connect() as conn:
        found = await conn.execute(text("SELECT * FROM knowledge_files WHERE kb_id = :id"), {"id": base_id})
        return {r["file_id"]: dict(r) for r in found.mappings()}


def shown(page: httpx.Response) -> dict[str, tuple[str, str]]:
    """file_id -> (status, the row's HTML) as the page shows them."""
    return {fid: (status, html) for fid, status, html in FILE_ROW.findall(page.text)}


async def csrf_on(client: httpx.AsyncClient, path: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', (await client.get(path)).text)
    assert found
    return found[1]


async def seeded(svc: Any) -> dict[str, Any]:
    """Alice's base with a file in each kind of state; bob's base with one file."""
    base = await new_base(svc, "alice", "manuals")
    ids = {}
    for name in ("waiting.txt", "reading.txt", "done.txt", "broken.txt"):
        ids[name] = await add_file(svc, base, "alice", name)
    await parse(svc, *ids["reading.txt"])
    await index(svc, *ids["done.txt"], chunks=7)
    await break_(svc, *ids["broken.txt"], "ValueError: no text in it")
    bobs = await new_base(svc, "bob", "bob-notes")
    await add_file(svc, bobs, "bob", "bob-only.txt")
    return {"base": base, "files": ids, "bobs": bobs}


# ------------------------------------------------------------------ tests


async def test_every_knowledge_page_needs_a_session(browser: Any) -> None:
    client = await browser()
    base = uuid.uuid4().hex
    for path in ("/ui/knowledge", f"/ui/knowledge/bases/{base}", f"/ui/knowledge/bases/{base}/files"):
        r = await client.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/sign-in?next=%2Fui%2Fknowledge")
        r = await client.get(path, headers={"HX-Request": "true"})
        assert (r.status_code, r.headers["hx-redirect"]) == (401, "/ui/sign-in")
    assert (await client.post(f"/ui/knowledge/bases/{base}/reindex", data={"csrf": "x"})).status_code == 401


async def test_files_show_their_states_and_link_to_their_tasks(svc: Any, browser: Any) -> None:
    s = await seeded(svc)
    alice = await browser("alice")
    listing = await alice.get("/ui/knowledge")
    assert '<a href="/ui/knowledge" aria-current="page">Knowledge</a>' in listing.text  # the nav entry
    assert f'href="/ui/knowledge/bases/{s["base"]}">manuals</a>' in listing.text
    assert f'href="/ui/knowledge/bases/{s["base"]}?status=error_parsing"' in listing.text
    assert "bob-notes" not in listing.text and "<th>Owner</th>" not in listing.text

    page = await alice.get(f"/ui/knowledge/bases/{s['base']}")
    assert page.status_code == 200
    assert 'hx-trigger="every 2s"' in page.text  # the table refreshes itself
    assert '<a href="/ui/knowledge" aria-current="page">Knowledge</a>' in page.text  # where you are
    rows, truth = shown(page), await file_rows(svc, s["base"])
    assert set(rows) == set(truth)
    expected = {"waiting.txt": "uploaded", "reading.txt": "parsing", "done.txt": "indexed"}
    expected["broken.txt"] = "error_parsing"
    for name, (file_id, task_id) in s["files"].items():
        status, html = rows[file_id]
        assert status == truth[file_id]["status"] == expected[name], name
        assert f'<a href="/ui/tasks/{task_id}"' in html and name in html
        task_status = (await svc.repo.get(task_id))["status"]
        assert f'class="status s-{task_status}">{task_status}<' in html  # the task's own state
    done, broken = rows[s["files"]["done.txt"][0]][1], rows[s["files"]["broken.txt"][0]][1]
    assert "<td>7</td>" in done  # chunk_count
    assert "not parsed: task" in broken and "ValueError: no text in it" in broken  # error_message
    assert re.search(r'<td title="\d{4}-\d\d-\d\d [\d:]+ UTC">\d+ s ago</td>', done)  # updated
    # The link leads to the task's page, which this key may see.
    task_page = await alice.get(f"/ui/tasks/{s['files']['done.txt'][1]}")
    assert task_page.status_code == 200 and "knowledge.ingest" in task_page.text
    # The polled fragment shows what PostgreSQL says now.
    await index(svc, *s["files"]["waiting.txt"], chunks=2)
    fragment = await alice.get(f"/ui/knowledge/bases/{s['base']}/files")
    assert shown(fragment)[s["files"]["waiting.txt"][0]][0] == "indexed"


async def test_another_key_sees_none_of_it_and_admin_sees_all(svc: Any, browser: Any) -> None:
    s = await seeded(svc)
    bob = await browser("bob")
    listing = (await bob.get("/ui/knowledge")).text
    assert "bob-notes" in listing and "manuals" not in listing and s["base"] not in listing
    for path in (f"/ui/knowledge/bases/{s['base']}", f"/ui/knowledge/bases/{s['base']}/files"):
        r = await bob.get(path)
        assert r.status_code == 404 and "waiting.txt" not in r.text, path
    csrf = await csrf_on(bob, "/ui/knowledge")
    before = await file_rows(svc, s["base"])
    r = await bob.post(f"/ui/knowledge/bases/{s['base']}/reindex", data={"csrf": csrf})
    assert r.status_code == 404 and await file_rows(svc, s["base"]) == before
    for task_id in (t for _, t in s["files"].values()):
        assert (await bob.get(f"/ui/tasks/{task_id}")).status_code == 404
    assert (await bob.get("/ui/knowledge/bases/not-an-id")).status_code == 404

    root = await browser("root")
    everything = (await root.get("/ui/knowledge")).text
    assert "manuals" in everything and "bob-notes" in everything and "<th>Owner</th>" in everything
    page = await root.get(f"/ui/knowledge/bases/{s['base']}")
    assert page.status_code == 200 and len(shown(page)) == 4 and "<dt>Owner</dt><dd>alice</dd>" in page.text


async def test_hostile_names_and_errors_are_escaped(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "<script>alert('base')</script>")
    file_id, task_id = await add_file(svc, base, "alice", '"><img src=x onerror=alert(1)>.txt')
    await break_(svc, file_id, task_id, "<iframe src=javascript:alert(2)>")
    alice = await browser("alice")
    for path in ("/ui/knowledge", f"/ui/knowledge/bases/{base}"):
        page = (await alice.get(path)).text
        assert "<script>alert" not in page and "&lt;script&gt;alert(&#39;base&#39;)&lt;/script&gt;" in page
    page = (await alice.get(f"/ui/knowledge/bases/{base}")).text
    assert "<img src=x" not in page and "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;.txt" in page
    assert "<iframe" not in page and "&lt;iframe src=javascript:alert(2)&gt;" in page


async def test_a_base_with_many_files_is_paged(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "big")
    rows = [
        {"file_id": catalog.new_id(), "kb_id": base, "filename": f"f{i:03}.txt", "file_type": "txt",
         "size_bytes": i, "task_id": None}
        for i in range(120)
    ]  # fmt: skip
    async with svc.engine.begin() as conn:
        await catalog.insert_files(conn, rows)
    alice = await browser("alice")
    seen: list[str] = []
    query, pages = "", 0
    while True:
        page = await alice.get(f"/ui/knowledge/bases/{base}?{query}")
        assert page.status_code == 200
        seen += list(shown(page))
        pages += 1
        older = OLDER.search(page.text)
        if older is None:
            break
        query = older[1].replace("&amp;", "&")
    assert pages == 3 and len(seen) == len(set(seen)) == 120
    async with svc.engine.connect() as conn:
        newest_first = await conn.execute(
            text("SELECT file_id FROM knowledge_files ORDER BY created_at DESC, file_id DESC")
        )
        assert seen == [r[0] for r in newest_first]
    assert len(shown(await alice.get(f"/ui/knowledge/bases/{base}?limit=200"))) == 120
    assert len(shown(await alice.get(f"/ui/knowledge/bases/{base}?limit=7"))) == 50  # offered sizes only
    assert (
        'hx-get="/ui/knowledge/bases/' + base + '/files?limit=25"'
        in (await alice.get(f"/ui/knowledge/bases/{base}?limit=25")).text
    )  # the poll keeps the page's query
    assert not shown(await alice.get(f"/ui/knowledge/bases/{base}?status=indexed"))
    assert "pruned" in (await alice.get(f"/ui/knowledge/bases/{base}?limit=25")).text  # no task to link
    for bad in ("status=exploded", "cursor=not-a-cursor", "cursor=%3Cx%3E"):
        assert (await alice.get(f"/ui/knowledge/bases/{base}?{bad}")).status_code == 400, bad


async def test_reindex_form_needs_its_token_and_the_stores(svc: Any, browser: Any) -> None:
    base = await new_base(svc, "alice", "manuals")
    file_id, task_id = await add_file(svc, base, "alice", "broken.txt")
    await break_(svc, file_id, task_id, "ValueError: boom")
    alice, bob = await browser("alice"), await browser("bob")
    page = await alice.get(f"/ui/knowledge/bases/{base}")
    assert ">Reindex failed files</button>" in page.text
    right, bobs = await csrf_on(alice, f"/ui/knowledge/bases/{base}"), await csrf_on(bob, "/ui/knowledge")
    before = await file_rows(svc, base)
    for data, headers in (
        ({}, {}),
        ({"csrf": "0" * 64}, {}),
        ({"csrf": bobs}, {}),  # another session's token
        ({"csrf": right}, {"Sec-Fetch-Site": "cross-site"}),
    ):
        r = await alice.post(f"/ui/knowledge/bases/{base}/reindex", data=data, headers=headers)
        assert r.status_code == 403 and "expired" in r.text, (data, headers)
    # With a valid token but no Milvus/S3 configured: refused like the API's 503, nothing changes.
    r = await alice.post(f"/ui/knowledge/bases/{base}/reindex", data={"csrf": right})
    assert r.status_code == 503 and "DTASK_MILVUS_URI" in r.text
    assert await file_rows(svc, base) == before
    async with svc.engine.connect() as conn:
        count = "SELECT count(*) FROM tasks WHERE task_type = :t"
        assert (await conn.execute(text(count), {"t": REINDEX})).scalar() == 0


async def test_reindex_form_hands_the_failed_files_to_one_task(
    clean_db: None, knowledge_stores: dict[str, str]
) -> None:
    # The test stores are exported in the environment: this deployment has them configured.
    services = build_services(make_settings(api_keys=test_ui.KEYS), pool_size=3)
    try:
        base = await new_base(services, "alice", "manuals")
        broken = [await add_file(services, base, "alice", f"broken-{i}.txt") for i in range(2)]
        for file_id, task_id in broken:
            await break_(services, file_id, task_id, "ValueError: boom")
        fine = await add_file(services, base, "alice", "fine.txt")
        await index(services, *fine, chunks=1)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(services=services)), base_url="https://test"
        ) as alice:
            await sign_in(alice, SECRETS["alice"])
            path = f"/ui/knowledge/bases/{base}"
            r = await alice.post(f"{path}/reindex", data={"csrf": await csrf_on(alice, path)})
            assert (r.status_code, r.headers["location"]) == (303, f"{path}?notice=reindexing")
            rows = await file_rows(services, base)
            reindex = rows[broken[0][0]]["task_id"]
            task = await services.repo.get(reindex)
            assert task["task_type"] == REINDEX and task["payload"] == {"base_id": base}
            assert all(rows[f]["task_id"] == reindex and rows[f]["status"] == "uploaded" for f, _ in broken)
            assert rows[fine[0]]["task_id"] == fine[1] and rows[fine[0]]["status"] == "indexed"
            page = await alice.get(r.headers["location"])
            assert "Reindex submitted" in page.text and page.text.count(f'href="/ui/tasks/{reindex}"') == 2
            # Once more while that task is pending: the API's one-at-a-time rule, no second task.
            r = await alice.post(f"{path}/reindex", data={"csrf": await csrf_on(alice, path)})
            assert r.headers["location"] == f"{path}?notice=active"
            async with services.engine.connect() as conn:
                count = "SELECT count(*) FROM tasks WHERE task_type = :t"
                assert (await conn.execute(text(count), {"t": REINDEX})).scalar() == 1
    finally:
        await services.close()


async def test_a_base_of_ten_thousand_files_renders_a_page_at_a_time(
    svc: Any, browser: Any, record_property: Any
) -> None:
    base = await new_base(svc, "alice", "big")
    async with svc.engine.begin() as conn:  # in one statement; every state, errors on the failed
        await conn.execute(
            text(
                """INSERT INTO knowledge_files (file_id, kb_id, filename, file_type, size_bytes, status,
                     error_message, chunk_count, created_at)
                SELECT md5(i::text), :kb, 'doc-' || i || '.txt', 'txt', i, st,
                     CASE WHEN st LIKE 'error%' THEN 'not parsed: ' || i END,
                     CASE WHEN st = 'indexed' THEN i % 40 ELSE 0 END,
                     clock_timestamp() - make_interval(secs => i)
                FROM generate_series(1, 10000) AS i,
                     LATERAL (SELECT (ARRAY['indexed', 'indexed', 'error_parsing', 'error_indexing',
                                            'uploaded'])[1 + i % 5] AS st) s"""
            ),
            {"kb": base},
        )
    alice = await browser("alice")

    async def timed(path: str, n: int = 5) -> tuple[float, httpx.Response]:
        took = []
        for _ in range(n):
            started = time.perf_counter()
            r = await alice.get(path)
            took.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
        return statistics.median(took) * 1000, r

    path = f"/ui/knowledge/bases/{base}"
    figures = {}
    figures["bases page (counts by status)"], listing = await timed("/ui/knowledge")
    assert ">10,000</td>" in listing.text
    figures["base page, first 50 files"], first = await timed(path)
    assert len(shown(first)) == 50 and "<b>10,000</b> files" in first.text
    figures["files fragment (the 2 s poll)"], _ = await timed(f"{path}/files")
    figures["200 error_parsing files"], errors = await timed(f"{path}/files?status=error_parsing&limit=200")
    assert len(shown(errors)) == 200 and {s for s, _ in shown(errors).values()} == {"error_parsing"}
    query = ""
    for _ in range(20):  # 20 pages deep: file 1,001
        older = OLDER.search((await alice.get(f"{path}?{query}")).text)
        assert older
        query = older[1].replace("&amp;", "&")
    figures["page 21 (keyset: no offset)"], deep = await timed(f"{path}/files?{query}")
    assert len(shown(deep)) == 50
    print("\na base of 10,000 files; median render times (ms):")
    for name, ms in figures.items():
        print(f"  {name:35s} {ms:7.1f}")
        record_property(name, round(ms, 1))


async def test_files_in_progress_show_their_attempt_and_refused_files_say_so(svc: Any, browser: Any) -> None:
    from domains.knowledge.tasks import MAX_ATTEMPTS

    s = await seeded(svc)
    refused = catalog.new_id()
    async with svc.engine.begin() as conn:
        await catalog.insert_files(
            conn,
            [
                {"file_id": refused, "kb_id": s["base"], "filename": "tool.exe", "file_type": "other",
                 "size_bytes": 4, "status": "error_parsing", "task_id": None, "refused_at_upload": True,
                 "error_message": "not a supported file type: .exe files are not read"}
            ],
        )  # fmt: skip
    alice = await browser("alice")
    rows = shown(await alice.get(f"/ui/knowledge/bases/{s['base']}"))
    attempt = re.compile(r'data-attempt="(\d+)"[^>]*>attempt (\d+) of (\d+)<')

    def attempt_shown(name: str) -> tuple[int, ...] | None:
        found = attempt.search(rows[s["files"][name][0]][1])
        return tuple(int(n) for n in found.groups()) if found else None

    # Waiting for its first claim, and running it: attempt 1 of the type's max.
    assert attempt_shown("waiting.txt") == (1, 1, MAX_ATTEMPTS)
    assert attempt_shown("reading.txt") == (1, 1, MAX_ATTEMPTS)
    assert attempt_shown("done.txt") is None and attempt_shown("broken.txt") is None
    # The reading file's attempt lapses; the reconciler sends its task back: it waits for attempt 2.
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
            {"id": s["files"]["reading.txt"][1]},
        )
    report = await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 60.0)
    assert report.retried == 1
    rows = shown(await alice.get(f"/ui/knowledge/bases/{s['base']}/files"))
    assert attempt_shown("reading.txt") == (2, 2, MAX_ATTEMPTS)
    status, html = rows[refused]
    assert status == "error_parsing" and "refused at upload" in html and ".exe files are not read" in html
    assert "pruned" not in html
