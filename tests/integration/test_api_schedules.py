"""/schedules against the real app, database and Redis: creation checks the payload as a
submission would and refuses bad rules with 422 naming the field, names are per owner (409 for a
duplicate of your own), a key sees and acts on its own schedules only, an admin on everyone's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tasks_core.duties.scheduler import fire_due
from tasks_core.services import build_services
from tests.conftest import make_settings

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
BOB = {"Authorization": "Bearer bob-secret-01234567"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}
T0 = datetime(2030, 6, 1, 12, tzinfo=UTC)


@pytest.fixture
async def svc(clean_db: None) -> AsyncIterator[Any]:
    services = build_services(make_settings(api_keys=KEYS), pool_size=5)
    services.repo.now = T0
    yield services
    await services.close()



def body(**fields: Any) -> dict[str, Any]:
    """An interval schedule, unless ``fields`` name a cron (or set every_seconds themselves)."""
    every = {} if "cron" in fields else {"every_seconds": 60}
    return {"name": "nightly", "task_type": "diagnostics.noop", "payload": {}, **every, **fields}


async def create(client: httpx.AsyncClient, headers: dict[str, str] = ALICE, **fields: Any) -> httpx.Response:
    return await client.post("/schedules", json=body(**fields), headers=headers)


async def test_create_read_list_pause_resume_delete(client: httpx.AsyncClient, svc: Any) -> None:
    r = await create(client, ROOT, name="nightly", cron="30 2 * * *", timezone="Europe/Paris", priority=5)
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["owner"] == "root" and made["cron"] == "30 2 * * *" and made["timezone"] == "Europe/Paris"
    assert made["next_run_at"] == "2030-06-02T00:30:00Z"  # 02:30 CEST
    assert (
        made["upcoming"][:2] == ["2030-06-02T00:30:00Z", "2030-06-03T00:30:00Z"]
        and len(made["upcoming"]) == 5
    )
    assert made["last_tasks"] == [] and made["paused"] is False and made["priority"] == 5

    svc.repo.now = T0 + timedelta(days=1)
    assert (await fire_due(svc)).created == 1
    got = (await client.get("/schedules/nightly", headers=ROOT)).json()
    [last] = got["last_tasks"]
    assert last["slot_at"] == "2030-06-02T00:30:00Z" and last["status"] == "pending"
    task = (await client.get(f"/tasks/{last['task_id']}", headers=ROOT)).json()
    assert task["priority"] == 5 and task["run_at"] == "2030-06-02T00:30:00Z"

    paused = (await client.post("/schedules/nightly/pause", headers=ROOT)).json()
    assert paused["paused"] is True and paused["next_run_at"] is None and paused["upcoming"] == []
    listed = (await client.get("/schedules", headers=ROOT)).json()["items"]
    assert [(s["name"], s["paused"]) for s in listed] == [("nightly", True)]
    resumed = (await client.post("/schedules/nightly/resume", headers=ROOT)).json()
    assert resumed["paused"] is False and resumed["next_run_at"] == "2030-06-03T00:30:00Z"

    assert (await client.delete("/schedules/nightly", headers=ROOT)).status_code == 204
    assert (await client.get("/schedules/nightly", headers=ROOT)).status_code == 404
    assert (await client.get(f"/tasks/{last['task_id']}", headers=ROOT)).status_code == 200  # its task stays


@pytest.mark.parametrize(
    ("fields", "where", "words"),
    [
        ({"cron": "61 * * * *"}, "cron", "not a valid cron expression"),
        ({"cron": "* * *"}, "cron", "five fields"),
        ({"cron": "0 * * * *", "every_seconds": 60}, "cron", "exactly one of cron and every_seconds"),
        ({"every_seconds": None}, "cron", "exactly one of cron and every_seconds"),
        ({"cron": "0 * * * *", "timezone": "Nowhere/City"}, "timezone", "unknown time zone"),
        ({"every_seconds": 0.2}, "every_seconds", "at least 1"),
        ({"every_seconds": -1}, "every_seconds", "at least 1"),
        ({"every_seconds": 1e300}, "every_seconds", "at most"),
        ({"timezone": "UTC"}, "timezone", "cron schedules only"),
        ({"name": "has space"}, "name", "letters, digits"),
        ({"name": ""}, "name", "letters, digits"),
        ({"name": "x" * 101}, "name", "letters, digits"),
        ({"task_type": "no.such.type"}, "task_type", "unknown task type"),
        ({"task_type": "diagnostics.sleep", "payload": {"seconds": "soon"}}, "seconds", "valid number"),
        ({"priority": 101}, "priority", "-100 to 100"),
    ],
)
async def test_bad_schedules_are_refused_with_422_naming_the_field(
    client: httpx.AsyncClient, svc: Any, fields: dict[str, Any], where: str, words: str
) -> None:
    r = await create(client, ROOT, **fields)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(where in map(str, e["loc"]) and words in e["msg"] for e in detail), detail
    assert (await client.get("/schedules", headers=ROOT)).json()["items"] == []  # nothing stored


async def test_non_finite_intervals_are_refused(client: httpx.AsyncClient) -> None:
    for raw in ("Infinity", "NaN"):
        content = f'{{"name": "n", "task_type": "diagnostics.noop", "every_seconds": {raw}}}'
        r = await client.post(
            "/schedules", content=content, headers={**ROOT, "content-type": "application/json"}
        )
        assert r.status_code == 422 and "finite" in r.text, r.text


async def test_a_duplicate_name_is_409_for_its_owner_only(client: httpx.AsyncClient) -> None:
    assert (await create(client, ROOT, name="report")).status_code == 201
    again = await create(client, ROOT, name="report", every_seconds=300)
    assert again.status_code == 409 and "already have a schedule named 'report'" in again.text
    assert (await client.post("/schedules", json=body(name="other"))).status_code == 401  # no key
    assert [s["name"] for s in (await client.get("/schedules", headers=ROOT)).json()["items"]] == ["report"]


async def test_diagnostics_types_follow_the_creating_keys_policy(client: httpx.AsyncClient) -> None:
    r = await create(client, ALICE, task_type="diagnostics.noop")
    assert r.status_code == 403 and "diagnostics type" in r.text  # DTASK_DIAGNOSTICS=admin


async def test_a_key_sees_and_acts_on_its_own_schedules_and_an_admin_on_all(
    client: httpx.AsyncClient, svc: Any
) -> None:
    svc.settings.diagnostics = "all"
    assert (await create(client, ALICE, name="report")).status_code == 201
    assert (await create(client, BOB, name="report")).status_code == 201  # names are per owner
    assert (await create(client, BOB, name="bobs")).status_code == 201
    alice = (await client.get("/schedules", headers=ALICE)).json()["items"]
    assert [(s["owner"], s["name"]) for s in alice] == [("alice", "report")]
    everyone = (await client.get("/schedules", headers=ROOT)).json()["items"]
    assert [(s["owner"], s["name"]) for s in everyone] == [
        ("alice", "report"),
        ("bob", "bobs"),
        ("bob", "report"),
    ]

    for method, path in (("GET", ""), ("POST", "/pause"), ("POST", "/resume"), ("DELETE", "")):
        r = await client.request(method, f"/schedules/bobs{path}", headers=ALICE)
        assert r.status_code == 404, (method, path, r.text)
        # ?owner= means nothing for a plain key: still only its own
        r = await client.request(method, f"/schedules/bobs{path}?owner=bob", headers=ALICE)
        assert r.status_code == 404, (method, path, r.text)
    assert (await client.post("/schedules/report/pause", headers=ALICE)).json()["owner"] == "alice"
    bob = (await client.get("/schedules/report", headers=BOB)).json()
    assert bob["owner"] == "bob" and bob["paused"] is False  # alice paused her own

    ambiguous = await client.get("/schedules/report", headers=ROOT)
    assert ambiguous.status_code == 409 and "pass ?owner=" in ambiguous.text
    assert (await client.get("/schedules/report?owner=bob", headers=ROOT)).json()["owner"] == "bob"
    assert (await client.post("/schedules/bobs/pause", headers=ROOT)).json()["paused"] is True
    assert (await client.delete("/schedules/report?owner=alice", headers=ROOT)).status_code == 204
    left = (await client.get("/schedules", headers=ROOT)).json()["items"]
    assert [(s["owner"], s["name"]) for s in left] == [("bob", "bobs"), ("bob", "report")]

    # The tasks a schedule creates are its owner's: alice cannot see bob's.
    svc.repo.now = T0 + timedelta(minutes=2)
    assert (await fire_due(svc)).created == 1  # bob's "report" (bobs is paused)
    [last] = (await client.get("/schedules/report", headers=BOB)).json()["last_tasks"]
    assert (await client.get(f"/tasks/{last['task_id']}", headers=ALICE)).status_code == 404
    assert (await client.get(f"/tasks/{last['task_id']}", headers=BOB)).status_code == 200
