"""The dashboard's routes and templates against the real app, database and Redis (httpx drives the
ASGI app in this event loop): sign-in, owner rules, CSRF, paging and filters, 10,000 rows.

Every response of every test is checked afterwards: no API key in a URL, a Location header or a
body.
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from repo_helpers import claim, submit
from sqlalchemy import text

import app.ui.extensions as ui_extensions
from app.auth import KeyRing
from app.main import create_app
from tasks_core.model import Status
from tasks_core.services import build_services
from tests.conftest import make_settings

SECRETS = {"alice": "alice-secret-0123456", "bob": "bob-secret-01234567", "root": "root-secret-0123456"}
KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"
ROW = re.compile(r'<tr data-task="([0-9a-f-]{36})" data-status="(\w+)">')
OLDER = re.compile(r'href="/ui\?([^"]*)" rel="next"')


@pytest.fixture
async def svc(clean_db: None) -> AsyncIterator[Any]:
    services = build_services(make_settings(api_keys=KEYS, diagnostics="all"), pool_size=5)
    yield services
    await services.close()


@pytest.fixture
def app(svc: Any) -> Any:
    return create_app(services=svc)


@pytest.fixture
async def browser(app: Any) -> AsyncIterator[Callable[..., Awaitable[httpx.AsyncClient]]]:
    """``await browser("alice")``: a client (its own cookie jar) signed in with alice's key;
    ``await browser()`` one that is not signed in."""
    seen: list[httpx.Response] = []

    async def remember(response: httpx.Response) -> None:
        await response.aread()
        seen.append(response)

    clients: list[httpx.AsyncClient] = []

    async def make(name: str | None = None) -> httpx.AsyncClient:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="https://test",  # the session cookie is Secure
            event_hooks={"response": [remember]},
        )
        clients.append(client)
        if name is not None:
            r = await sign_in(client, SECRETS[name])
            assert r.status_code == 303 and r.headers["location"] == "/ui", r.text
        return client

    yield make
    for client in clients:
        await client.aclose()
    for response in seen:
        for secret in SECRETS.values():
            where = f"{response.request.method} {response.request.url}"
            assert secret not in str(response.request.url), where
            assert secret not in response.headers.get("location", ""), where
            assert secret not in response.text, f"{where} answered with a key in its body"


async def sign_in(client: httpx.AsyncClient, key: str, next_path: str = "/ui") -> httpx.Response:
    form = await client.get("/ui/sign-in")
    token = re.search(r'name="token" value="([^"]+)"', form.text)
    assert token, form.text
    return await client.post("/ui/sign-in", data={"key": key, "token": token[1], "next": next_path})


async def csrf_of(client: httpx.AsyncClient) -> str:
    page = await client.get("/ui")
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert found, page.text
    return found[1]


async def seed(
    svc: Any, owner: str, n: int, *, statuses: tuple[str, ...] = ("pending",), types: int = 1
) -> None:
    """``n`` tasks of ``owner`` in one statement, the newest first in generate_series order:
    statuses and types ``demo.0``.. cycle."""
    async with svc.engine.begin() as conn:
        await conn.execute(
            text(
                """INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, timeout_seconds,
                     progress, attempt_token, lease_expires_at, attempt_count, created_at, last_published_at)
                SELECT gen_random_uuid(), 'demo.' || (i % :types), 1, jsonb_build_object('i', i), :owner, st,
                     60, CASE WHEN st = 'running' THEN 40 ELSE 0 END,
                     CASE WHEN st = 'running' THEN gen_random_uuid() END,
                     CASE WHEN st = 'running' THEN clock_timestamp() + interval '30 s' END,
                     CASE WHEN st = 'pending' THEN 0 ELSE 1 END,
                     clock_timestamp() - make_interval(secs => i), clock_timestamp()
                FROM generate_series(1, :n) AS i, CAST(:statuses AS text[]) AS sts,
                     LATERAL (SELECT sts[1 + i % cardinality(sts)] AS st) s"""
            ),
            {"owner": owner, "n": n, "types": types, "statuses": list(statuses)},
        )


def rows(page: httpx.Response) -> list[tuple[str, str]]:
    return ROW.findall(page.text)


# ------------------------------------------------------------------ signing in


async def test_every_page_without_a_session_goes_to_sign_in(browser: Any) -> None:
    client = await browser()
    tid = uuid.uuid4()
    for path in (
        "/ui",
        "/ui/fragments/tasks",
        "/ui/fragments/overview",
        f"/ui/tasks/{tid}",
        f"/ui/tasks/{tid}/live",
    ):
        for headers in ({}, {"Authorization": f"Bearer {SECRETS['root']}"}):  # a bearer header is no session
            r = await client.get(path, headers=headers)
            assert r.status_code == 303, path
            assert r.headers["location"].startswith("/ui/sign-in?next=%2Fui"), r.headers["location"]
        # htmx polls get 401 and a header htmx turns into a navigation to the sign-in page.
        r = await client.get(path, headers={"HX-Request": "true"})
        assert (r.status_code, r.headers["hx-redirect"]) == (401, "/ui/sign-in")
    for path in (f"/ui/tasks/{tid}/cancel", f"/ui/tasks/{tid}/delete", "/ui/sign-out"):
        assert (await client.post(path, data={"csrf": "x"})).status_code == 401, path
    client.cookies.set("dtask_ui", "bm90OmFrZXk=", domain="test.local", path="/ui")  # "not:akey"
    assert (await client.get("/ui")).status_code == 303
    client.cookies.set("dtask_ui", "A" * 43, domain="test.local", path="/ui")  # shaped like one, unknown
    assert (await client.get("/ui")).status_code == 303


async def test_sign_in_keeps_the_key_in_a_strict_http_only_cookie(browser: Any) -> None:
    client = await browser()
    r = await sign_in(client, SECRETS["alice"], next_path="/ui?status=failed")
    assert r.status_code == 303 and r.headers["location"] == "/ui?status=failed"
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("dtask_ui="))
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "secure", "samesite=strict", "path=/ui"} <= flags, cookie
    page = await client.get("/ui")
    assert page.status_code == 200 and ">alice<" in page.text
    assert (await client.get("/ui/sign-in")).headers["location"] == "/ui"  # already signed in


async def test_a_wrong_key_an_old_form_or_a_foreign_next_is_refused(browser: Any) -> None:
    client = await browser()
    wrong = "alice-secret-0123457"
    r = await sign_in(client, wrong)
    assert r.status_code == 401 and "not a valid API key" in r.text and wrong not in r.text
    assert "dtask_ui=" not in r.headers.get("set-cookie", "").replace("dtask_ui_signin", "")
    # Without the form's token (another site posting the form): refused before the key is looked at.
    r = await client.post("/ui/sign-in", data={"key": SECRETS["alice"], "token": "forged"})
    assert r.status_code == 403 and (await client.get("/ui")).status_code == 303
    for foreign in ("https://evil.example/", "//evil.example/ui", "/uiother", "/ui\\@evil", "javascript:x"):
        r = await sign_in(await browser(), SECRETS["alice"], next_path=foreign)
        assert r.headers["location"] == "/ui", foreign


async def test_sign_in_over_plain_http_warns_that_the_cookie_will_be_dropped(app: Any) -> None:
    for base, warned in (
        ("http://tasks.example", True),
        ("https://tasks.example", False),
        ("http://127.0.0.1", False),
    ):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as client:
            assert ("plain HTTP" in (await client.get("/ui/sign-in")).text) is warned, base


async def test_sign_out_needs_its_token_and_ends_the_session(browser: Any) -> None:
    client = await browser("alice")
    assert (await client.post("/ui/sign-out", data={"csrf": "0" * 64})).status_code == 403
    assert (await client.get("/ui")).status_code == 200
    r = await client.post("/ui/sign-out", data={"csrf": await csrf_of(client)})
    assert r.status_code == 303 and r.headers["location"] == "/ui/sign-in"
    assert (await client.get("/ui")).status_code == 303


async def test_a_key_removed_from_the_configuration_signs_its_sessions_out(app: Any, browser: Any) -> None:
    bob, alice = await browser("bob"), await browser("alice")
    assert (await bob.get("/ui")).status_code == 200
    app.state.keys = KeyRing("alice:alice-secret-0123456")  # as after a restart without bob's key
    assert (await bob.get("/ui")).status_code == 303
    # The same name with another secret is another key: its old sessions end too.
    app.state.keys = KeyRing("alice:alice-secret-changed-0123")
    assert (await alice.get("/ui")).status_code == 303
    app.state.keys = KeyRing(KEYS)  # and they stay ended when the old secret comes back
    assert (await alice.get("/ui")).status_code == 303


def _session_cookie(client: httpx.AsyncClient) -> str:
    return next(c.value for c in client.cookies.jar if c.name == "dtask_ui")


async def _with_cookie(browser: Any, value: str) -> httpx.AsyncClient:
    client = await browser()
    # The domain the jar gives cookies of https://test (http.cookiejar's ".local" for dotless hosts).
    client.cookies.set("dtask_ui", value, domain="test.local", path="/ui")
    return client


async def test_after_sign_out_the_old_cookie_and_its_token_are_refused(svc: Any, browser: Any) -> None:
    await seed(svc, "alice", 1)
    tid = (await _task_ids(svc))[0]
    client = await browser("alice")
    cookie, csrf = _session_cookie(client), await csrf_of(client)
    replay = await _with_cookie(browser, cookie)  # someone who copied the cookie and a page's token
    assert (await replay.get("/ui")).status_code == 200
    r = await client.post("/ui/sign-out", data={"csrf": csrf})
    assert r.status_code == 303
    # ...gets nothing from them any more.
    r = await replay.get("/ui")
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/sign-in")
    assert (await replay.post(f"/ui/tasks/{tid}/cancel", data={"csrf": csrf})).status_code == 401
    assert (await replay.post("/ui/sign-out", data={"csrf": csrf})).status_code == 401
    assert (await _task_ids(svc, "pending")) == [tid]
    assert await _session_rows(svc) == 0


async def test_the_cookie_is_a_random_id_and_never_the_key(svc: Any, browser: Any) -> None:
    import base64
    import binascii

    client = await browser("alice")
    value = _session_cookie(client)
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", value), value
    try:
        decoded = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (ValueError, binascii.Error):
        decoded = b""
    for secret in SECRETS.values():
        assert secret not in value and secret.encode() not in decoded
    # Nor is it kept on the server: the row holds a hash of the id and a fingerprint of the key.
    async with svc.engine.connect() as conn:
        row = (await conn.execute(text("SELECT * FROM ui_sessions"))).mappings().one()
    assert row["key_name"] == "alice" and value not in str(dict(row))
    assert not any(secret in str(dict(row)) for secret in SECRETS.values())


async def test_a_session_expires_after_its_lifetime(svc: Any, browser: Any) -> None:
    client = await browser("alice")
    async with svc.engine.connect() as conn:
        lifetime = (
            await conn.execute(text("SELECT extract(epoch FROM expires_at - created_at) FROM ui_sessions"))
        ).scalar_one()
    assert svc.settings.ui_session_seconds == 12 * 3600  # the default
    assert abs(float(lifetime) - 12 * 3600) < 1
    async with svc.engine.begin() as conn:
        await conn.execute(text("UPDATE ui_sessions SET expires_at = clock_timestamp() - interval '1 s'"))
    r = await client.get("/ui")
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/sign-in")
    assert await _session_rows(svc) == 0  # removed when it was used


async def test_expired_sessions_do_not_pile_up(svc: Any, browser: Any) -> None:
    for _ in range(3):
        await browser("bob")
    async with svc.engine.begin() as conn:
        await conn.execute(text("UPDATE ui_sessions SET expires_at = clock_timestamp() - interval '1 s'"))
    await browser("alice")  # never used again, the expired ones go with the next sign-in
    assert await _session_rows(svc) == 1


async def test_every_api_process_serves_the_same_sessions(svc: Any, browser: Any) -> None:
    other = create_app(services=svc)  # a second api process: its own key ring, the same database
    client = await browser("alice")
    cookie, csrf = _session_cookie(client), await csrf_of(client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=other), base_url="https://test") as there:
        there.cookies.set("dtask_ui", cookie, domain="test.local", path="/ui")
        assert (await there.get("/ui")).status_code == 200
        assert (await there.post("/ui/sign-out", data={"csrf": csrf})).status_code == 303
    assert (await client.get("/ui")).status_code == 303  # signed out everywhere


async def _task_ids(svc: Any, status: str | None = None) -> list[str]:
    async with svc.engine.connect() as conn:
        query = "SELECT id FROM tasks WHERE CAST(:status AS text) IS NULL OR status = :status"
        found = await conn.execute(text(query), {"status": status})
        return [str(r[0]) for r in found]


async def _session_rows(svc: Any) -> int:
    async with svc.engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM ui_sessions"))).scalar_one())


async def test_pages_carry_a_strict_content_security_policy_and_no_store(browser: Any) -> None:
    client = await browser("alice")
    for path in ("/ui", "/ui/sign-in", "/ui/fragments/tasks"):
        r = await client.get(path, follow_redirects=True)
        assert "script-src 'self'" in r.headers["content-security-policy"], path
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["cache-control"] == "no-store"
    assert (await client.get("/ui/static/ui.css")).status_code == 200
    assert (await client.get("/ui/static/htmx-2.0.11.min.js")).status_code == 200


# ------------------------------------------------------------------ the list


async def test_keyset_pages_cover_every_row_once_newest_first(svc: Any, browser: Any) -> None:
    await seed(svc, "alice", 120, statuses=("success", "failed", "pending"))
    client = await browser("alice")
    seen: list[str] = []
    query = ""
    pages = 0
    while True:
        page = await client.get(f"/ui?{query}")
        assert page.status_code == 200
        seen += [tid for tid, _ in rows(page)]
        pages += 1
        if pages > 1:
            assert "« newest" in page.text
        older = OLDER.search(page.text)
        if older is None:
            break
        query = older[1].replace("&amp;", "&")
    assert pages == 3 and len(seen) == len(set(seen)) == 120
    async with svc.engine.connect() as conn:
        newest_first = (
            await conn.execute(text("SELECT id FROM tasks ORDER BY created_at DESC, id DESC"))
        ).all()
    assert seen == [str(r[0]) for r in newest_first]
    assert len(rows(await client.get("/ui?limit=25"))) == 25
    assert len(rows(await client.get("/ui?limit=7"))) == 50  # only the offered sizes


async def test_filters_by_status_and_type(svc: Any, browser: Any) -> None:
    await seed(svc, "alice", 60, statuses=("pending", "running", "success", "failed", "cancelled"), types=3)
    client = await browser("alice")
    failed = rows(await client.get("/ui?status=failed"))
    assert len(failed) == 12 and {s for _, s in failed} == {"failed"}
    typed = await client.get("/ui?task_type=demo.1")
    assert len(rows(typed)) == 20 and "demo.0" not in typed.text.split("<tbody>")[1]
    both = rows(await client.get("/ui?status=running&task_type=demo.2"))
    assert both and {s for _, s in both} == {"running"}
    form = await client.get("/ui")
    assert all(f'<option value="demo.{i}">' in form.text for i in range(3))  # the type choices
    # The live table keeps the filters when it refreshes itself.
    assert (
        'hx-get="/ui/fragments/tasks?status=running&amp;task_type=demo.2"'
        in (await client.get("/ui?status=running&task_type=demo.2")).text
    )
    assert rows(await client.get("/ui/fragments/tasks?status=failed")) == failed
    assert (await client.get("/ui?status=exploded")).status_code == 400
    assert (await client.get("/ui?cursor=not-a-cursor")).status_code == 400
    assert (await client.get("/ui?status=&task_type=")).status_code == 200  # "any" from the form


async def test_waiting_reason_error_lease_and_attempts_are_on_the_row(svc: Any, browser: Any) -> None:
    waiting = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    running = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    got = await claim(svc.repo, svc.registry, running)
    failed = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    token = (await claim(svc.repo, svc.registry, failed)).token
    error = {"code": "handler_error", "message": "ValueError: bad input"}
    await svc.repo.finish(failed, token, svc.registry, status=Status.FAILED, error=error, detail="Traceback…")
    await svc.repo.report(running, got.token, 42.0, "halfway there")
    page = (await (await browser("alice")).get("/ui")).text
    row = {
        tid: page.split(f'data-task="{tid}"')[1].split("</tr>")[0]
        for tid in map(str, (waiting, running, failed))
    }
    reason = await svc.repo.waiting_reason(await svc.repo.get(waiting), svc.settings.capacity)
    assert reason and reason in row[str(waiting)]  # the API's waiting_reason
    assert 'value="42.0"' in row[str(running)] and "halfway there" in row[str(running)]
    assert re.search(r"<td>\s*<span class=\"\">\d+ s</span>", row[str(running)])  # lease left
    assert "handler_error: ValueError: bad input" in row[str(failed)]
    assert "Traceback" not in page


async def test_counts_come_from_the_same_cache_as_the_api_summary(svc: Any, browser: Any) -> None:
    client = await browser("alice")
    await submit(svc.repo, "diagnostics.noop", {}, owner="alice")
    assert "<b>1</b> tasks" in (await client.get("/ui/fragments/overview")).text
    await submit(svc.repo, "diagnostics.noop", {}, owner="alice")
    again = (await client.get("/ui/fragments/overview")).text
    assert "<b>1</b> tasks" in again  # counted at most every DTASK_METRICS_CACHE_SECONDS
    api = await client.get("/tasks/summary", headers={"Authorization": f"Bearer {SECRETS['alice']}"})
    assert api.json()["total"] == 1  # one cache for both


# ------------------------------------------------------------------ owners


async def test_a_key_sees_only_its_own_tasks_and_admin_sees_all(svc: Any, browser: Any) -> None:
    await seed(svc, "alice", 5)
    bobs = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="bob")
    alices = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    bob = await browser("bob")
    page = await bob.get("/ui")
    assert [tid for tid, _ in rows(page)] == [str(bobs)]
    assert re.search(r"<b>1</b> tasks", page.text)
    assert [tid for tid, _ in rows(await bob.get("/ui/fragments/tasks"))] == [str(bobs)]
    assert "demo.0" not in page.text  # not even another owner's type names
    assert (await bob.get(f"/ui/tasks/{alices}")).status_code == 404
    gone = await bob.get(f"/ui/tasks/{alices}/live")
    assert "no longer exists" in gone.text and "seconds" not in gone.text
    csrf = await csrf_of(bob)
    assert (await bob.post(f"/ui/tasks/{alices}/cancel", data={"csrf": csrf})).status_code == 404
    assert (await bob.post(f"/ui/tasks/{alices}/delete", data={"csrf": csrf})).status_code == 404
    assert (await bob.post(f"/ui/tasks/{alices}/retry", data={"csrf": csrf})).status_code == 404
    await bob.post("/ui/tasks/retry", data={"csrf": csrf, "ids": [str(alices)]})  # skipped: not bob's
    assert (await svc.repo.get(alices))["status"] == "pending"
    assert (await svc.repo.summary())["total"] == 7
    root = await browser("root")
    everything = await root.get("/ui")
    assert len(rows(everything)) == 7 and "<th>Owner</th>" in everything.text
    assert (await root.get(f"/ui/tasks/{alices}")).status_code == 200


# ------------------------------------------------------------------ acting on a task


async def test_forms_without_the_session_token_are_refused(svc: Any, browser: Any) -> None:
    tid = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    alice, bob = await browser("alice"), await browser("bob")
    right, bobs = await csrf_of(alice), await csrf_of(bob)
    assert right != bobs
    for action in ("cancel", "delete", "retry"):
        for data, headers in (
            ({}, {}),  # no token
            ({"csrf": "0" * 64}, {}),  # a wrong one
            ({"csrf": bobs}, {}),  # another session's
            ({"csrf": right}, {"Sec-Fetch-Site": "cross-site"}),  # the browser says another site sent it
        ):
            r = await alice.post(f"/ui/tasks/{tid}/{action}", data=data, headers=headers)
            assert r.status_code == 403, (action, data, headers)
            assert "expired" in r.text
    assert (await svc.repo.get(tid))["status"] == "pending"
    # A new sign-in starts a new session: the old page's token no longer works.
    await alice.post("/ui/sign-out", data={"csrf": right})
    await sign_in(alice, SECRETS["alice"])
    assert (await alice.post(f"/ui/tasks/{tid}/cancel", data={"csrf": right})).status_code == 403
    r = await alice.post(f"/ui/tasks/{tid}/cancel", data={"csrf": await csrf_of(alice)})
    assert r.status_code == 303 and (await svc.repo.get(tid))["status"] == "cancelled"


async def test_cancel_and_delete_follow_the_api_rules(svc: Any, browser: Any) -> None:
    client = await browser("alice")
    csrf = await csrf_of(client)
    pending = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    running = await submit(svc.repo, "diagnostics.sleep", {"seconds": 1}, owner="alice")
    got = await claim(svc.repo, svc.registry, running)

    page = await client.get(f"/ui/tasks/{running}")
    assert ">Cancel</button>" in page.text and ">Delete</button>" not in page.text
    r = await client.post(f"/ui/tasks/{pending}/cancel", data={"csrf": csrf})
    assert r.headers["location"] == f"/ui/tasks/{pending}?notice=cancelled"
    assert "Cancelled: it had not started." in (await client.get(r.headers["location"])).text
    r = await client.post(f"/ui/tasks/{running}/cancel", data={"csrf": csrf})
    assert r.headers["location"] == f"/ui/tasks/{running}?notice=cancel_requested"
    page = await client.get(r.headers["location"])
    assert "cancel requested" in page.text and ">Cancel</button>" not in page.text
    r = await client.post(f"/ui/tasks/{running}/delete", data={"csrf": csrf})  # still running: 409 in the API
    assert r.headers["location"] == f"/ui/tasks/{running}?notice=active"
    assert (await svc.repo.get(running))["status"] == "running"

    await svc.repo.finish(running, got.token, svc.registry, status=Status.SUCCESS, result={"n": 1})
    assert (await svc.repo.get(running))["status"] == "cancelled"  # cancel intent beats the success
    r = await client.post(f"/ui/tasks/{running}/cancel", data={"csrf": csrf})
    assert r.headers["location"] == f"/ui/tasks/{running}?notice=finished"
    r = await client.post(f"/ui/tasks/{running}/delete", data={"csrf": csrf})
    assert r.headers["location"] == "/ui?notice=deleted" and await svc.repo.get(running) is None
    assert (await client.post(f"/ui/tasks/{running}/delete", data={"csrf": csrf})).status_code == 404
    assert (await client.post("/ui/tasks/not-a-uuid/delete", data={"csrf": csrf})).status_code == 422


async def test_retry_makes_a_new_task_once_and_the_list_retries_the_failed_ones(
    svc: Any, browser: Any
) -> None:
    client = await browser("alice")
    csrf = await csrf_of(client)
    failed = []
    for _ in range(3):
        tid = await submit(svc.repo, "diagnostics.fail", {}, owner="alice")
        got = await claim(svc.repo, svc.registry, tid)
        error = {"code": "handler_error", "message": "RuntimeError: boom"}
        await svc.repo.finish(tid, got.token, svc.registry, status=Status.FAILED, error=error)
        failed.append(tid)
    page = await client.get(f"/ui/tasks/{failed[0]}")
    assert ">Retry</button>" in page.text
    r = await client.post(f"/ui/tasks/{failed[0]}/retry", data={"csrf": csrf})
    new = (await svc.repo.get(failed[0]))["retried_by"]
    assert r.status_code == 303 and r.headers["location"] == f"/ui/tasks/{new}?notice=retried"
    page = await client.get(r.headers["location"])
    assert "Retried: this is the new task." in page.text and f'href="/ui/tasks/{failed[0]}"' in page.text
    again = await client.post(f"/ui/tasks/{failed[0]}/retry", data={"csrf": csrf})
    assert again.headers["location"] == f"/ui/tasks/{failed[0]}?notice=not_retried"
    assert ">Retry</button>" not in (await client.get(f"/ui/tasks/{failed[0]}")).text

    listing = await client.get("/ui?status=failed")
    assert "Retry the 2 failed tasks shown" in listing.text  # the one retried already is not offered
    ids = re.findall(r'name="ids" value="([0-9a-f-]+)"', listing.text)
    assert sorted(ids) == sorted(str(t) for t in failed[1:])
    r = await client.post("/ui/tasks/retry", data={"csrf": csrf, "ids": ids})
    assert r.status_code == 303 and r.headers["location"] == "/ui?status=failed&notice=retried_many"
    assert all([(await svc.repo.get(t))["retried_by"] for t in failed])
    assert (await svc.repo.summary())["by_status"]["pending"] == 3


async def test_an_admin_pauses_and_resumes_a_type_from_its_list(svc: Any, browser: Any) -> None:
    tid = await submit(svc.repo, "diagnostics.noop", {}, owner="alice")
    root, alice = await browser("root"), await browser("alice")
    listing = await root.get("/ui?task_type=diagnostics.noop")
    assert ">Pause diagnostics.noop</button>" in listing.text
    assert ">Pause" not in (await alice.get("/ui?task_type=diagnostics.noop")).text  # admin only
    assert ">Pause" not in (await root.get("/ui?task_type=demo.0")).text  # not a type this runs
    refused = await alice.post("/ui/task-types/diagnostics.noop/pause", data={"csrf": await csrf_of(alice)})
    assert refused.status_code == 403 and await svc.repo.paused_types() == []
    assert (await root.post("/ui/task-types/diagnostics.noop/pause", data={})).status_code == 403  # no token
    csrf = await csrf_of(root)
    r = await root.post("/ui/task-types/diagnostics.noop/pause", data={"csrf": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/ui?task_type=diagnostics.noop&notice=paused"
    page = await root.get(r.headers["location"])
    assert "Paused: its pending tasks wait" in page.text and ">Resume diagnostics.noop</button>" in page.text
    assert 'data-paused="diagnostics.noop"' in (await alice.get("/ui")).text  # everyone sees why they wait
    assert "type paused" in (await alice.get(f"/ui/tasks/{tid}")).text
    r = await root.post("/ui/task-types/diagnostics.noop/resume", data={"csrf": csrf})
    assert r.headers["location"] == "/ui?task_type=diagnostics.noop&notice=resumed"
    assert await svc.repo.paused_types() == []
    assert (await root.post("/ui/task-types/no.such/pause", data={"csrf": csrf})).status_code == 404


async def test_task_page_shows_payload_result_error_and_attempts(svc: Any, browser: Any) -> None:
    tid = await submit(
        svc.repo, "diagnostics.sleep", {"seconds": 3, "note": "<script>alert(1)</script>"}, owner="alice"
    )
    first = await claim(svc.repo, svc.registry, tid, worker="worker-one@host")
    error = {"code": "handler_error", "message": "RuntimeError: disk <b>full</b>"}
    await svc.repo.finish(
        tid,
        first.token,
        svc.registry,
        status=Status.FAILED,
        error=error,
        detail="Traceback: internal-only-detail",
    )
    alice, root = await browser("alice"), await browser("root")
    page = (await alice.get(f"/ui/tasks/{tid}")).text
    assert "worker-one@host" in page and "handler_error" in page and str(first.token)[:8] in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page  # escaped
    assert "disk &lt;b&gt;full&lt;/b&gt;" in page
    assert "internal-only-detail" not in page  # the full error text is for operators
    assert ">Delete</button>" in page and ">Cancel</button>" not in page
    assert 'hx-trigger="every' not in page  # finished: the page stops polling
    assert "internal-only-detail" in (await root.get(f"/ui/tasks/{tid}")).text

    done = await submit(svc.repo, "diagnostics.noop", {}, owner="alice")
    token = (await claim(svc.repo, svc.registry, done)).token
    await svc.repo.finish(done, token, svc.registry, status=Status.SUCCESS, result={"answer": 42})
    page = (await alice.get(f"/ui/tasks/{done}")).text
    assert "Result" in page and "&#34;answer&#34;: 42" in page
    live = (
        await alice.get(f"/ui/tasks/{await submit(svc.repo, 'diagnostics.noop', {}, owner='alice')}/live")
    ).text
    assert 'hx-trigger="every 1s"' in live  # an active task's fragment keeps polling
    assert (await alice.get("/ui/tasks/not-a-uuid")).status_code == 404


# ------------------------------------------------------------------ scale


async def test_ten_thousand_rows_render_a_page_at_a_time(
    svc: Any, browser: Any, record_property: Any
) -> None:
    started = time.perf_counter()
    await seed(
        svc, "alice", 10_000, statuses=("pending", "success", "failed", "pending", "running", "cancelled")
    )
    seeded = time.perf_counter() - started
    client = await browser("alice")

    async def timed(path: str, n: int = 5) -> tuple[float, httpx.Response]:
        took = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = await client.get(path)
            took.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        return statistics.median(took) * 1000, r

    figures = {}
    figures["full page, first 50"], first = await timed("/ui")
    assert len(rows(first)) == 50 and "<b>10,000</b> tasks" in first.text
    figures["table fragment (the 2 s poll)"], _ = await timed("/ui/fragments/tasks")
    figures["overview fragment (counts, readiness)"], _ = await timed("/ui/fragments/overview")
    figures["50 pending rows (a waiting_reason each)"], pend = await timed(
        "/ui/fragments/tasks?status=pending"
    )
    assert {s for _, s in rows(pend)} == {"pending"} and len(rows(pend)) == 50
    figures["200 rows"], big = await timed("/ui/fragments/tasks?limit=200")
    assert len(rows(big)) == 200
    query = ""
    for _ in range(40):  # 40 pages deep: row 2,001
        older = OLDER.search((await client.get(f"/ui/fragments/tasks?{query}")).text)
        assert older
        query = older[1].replace("&amp;", "&")
    figures["page 41 (keyset: no offset)"], deep = await timed(f"/ui/fragments/tasks?{query}")
    assert len(rows(deep)) == 50
    print(f"\n10,000 tasks seeded in {seeded:.1f} s; median render times (ms):")
    for name, ms in figures.items():
        print(f"  {name:45s} {ms:7.1f}")
        record_property(name, round(ms, 1))


# ------------------------------------------------------------------ domain pages


async def test_a_domain_adds_a_page_and_a_nav_entry(
    svc: Any, monkeypatch: pytest.MonkeyPatch, browser: Any
) -> None:
    monkeypatch.setattr(ui_extensions, "EXTENSION_MODULES", ("ui_extension_for_tests:UI",))
    demo_app = create_app(services=svc)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=demo_app), base_url="https://test")
    async with client:
        assert (await client.get("/ui/demo")).headers["location"] == "/ui/sign-in?next=%2Fui%2Fdemo"
        await sign_in(client, SECRETS["alice"])
        page = await client.get("/ui/demo")
        assert (
            "owner filter: alice" in page.text
            and '<a href="/ui/demo" aria-current="page">Demo</a>' in page.text
        )
        assert "Demo admin" not in page.text  # an admin-only entry
        assert (await client.post("/ui/demo/poke", data={"csrf": "x"})).status_code == 403
        assert (await client.post("/ui/demo/poke", data={"csrf": await csrf_of(client)})).status_code == 303
        assert "/ui/demo" not in (await client.get("/openapi.json")).text  # pages are no API


def test_an_extension_outside_ui_is_refused() -> None:
    from fastapi import APIRouter

    router = APIRouter(prefix="/knowledge-ui")
    router.add_api_route("", lambda: None)
    with pytest.raises(ValueError, match="under /ui/"):
        ui_extensions.UiExtension(router)
