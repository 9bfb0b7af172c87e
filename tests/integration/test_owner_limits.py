"""Per-owner limits and the diagnostics policy on the real database.

Running is enforced at claim, under the same lock as the capacity, and the relay/publisher skip an
owner at its limit; pending is enforced at submit under a per-owner lock.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from app.main import create_app
from tasks_core.model import Status
from tasks_core.services import build_services
from tasks_core.submission import Forbidden, OverQuota, Submitter, TaskIntent
from tests.conftest import make_settings
from tests.integration.repo_helpers import submit

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}


async def test_an_owner_at_its_running_limit_is_refused_at_claim_and_skipped_by_the_relay(
    services: Any,
) -> None:
    repo, registry = services.repo, services.registry
    a1, a2 = [await submit(repo, owner="alice") for _ in range(2)]
    b1 = await submit(repo, owner="bob")
    first = await repo.claim(a1, registry, capacity=4, lease_seconds=30, owner_max_running=1)
    assert not isinstance(first, str)
    assert await repo.claim(a2, registry, capacity=4, lease_seconds=30, owner_max_running=1) == "owner_limit"
    assert not isinstance(
        await repo.claim(b1, registry, capacity=4, lease_seconds=30, owner_max_running=1), str
    )
    # a2's message was dropped; the relay must not re-send it while alice is at her limit.
    assert await repo.claim_for_publish(registry, limit=10, republish_after=None, owner_max_running=1) == []
    reason = await repo.waiting_reason(await repo.get(a2), 4, owner_max_running=1)
    assert reason == "your running limit is reached (1 of 1)"
    await repo.finish(a1, first.token, registry, status=Status.SUCCESS)
    assert await repo.claim_for_publish(registry, limit=10, republish_after=None, owner_max_running=1) == [a2]
    assert not isinstance(
        await repo.claim(a2, registry, capacity=4, lease_seconds=30, owner_max_running=1), str
    )


@pytest.mark.parametrize(("capacity", "explicit", "limit"), [(4, None, 2), (8, None, 4), (3, None, 2),
                                                           (1, None, None), (2, None, 1), (4, 4, None),
                                                           (4, 3, 3)])  # fmt: skip
def test_by_default_an_owner_may_hold_half_the_capacity(
    capacity: int, explicit: int | None, limit: int | None
) -> None:
    assert make_settings(capacity=capacity, owner_max_running=explicit).owner_running_limit == limit


async def test_with_the_default_limit_one_owner_leaves_a_slot_for_another(services: Any) -> None:
    """Four long tasks of one owner arrive first: two run, and the other two slots are the other
    owner's, claimed as a worker claims (the settings' own limit), not left to the first."""
    repo, registry, s = services.repo, services.registry, services.settings
    alice = [await submit(repo, owner="alice") for _ in range(4)]
    bob = await submit(repo, owner="bob")
    limit = s.owner_running_limit
    outcomes = [
        await repo.claim(i, registry, capacity=s.capacity, lease_seconds=30, owner_max_running=limit)
        for i in alice
    ]
    assert [isinstance(o, str) for o in outcomes] == [False, False, True, True]
    assert outcomes[2:] == ["owner_limit", "owner_limit"]
    assert not isinstance(
        await repo.claim(bob, registry, capacity=s.capacity, lease_seconds=30, owner_max_running=limit), str
    )


async def test_a_task_without_owner_claims_in_one_statement_under_an_owner_limit(services: Any) -> None:
    repo, registry = services.repo, services.registry
    ids = [await submit(repo) for _ in range(5)]  # the Python API's own tasks: exempt
    outcomes = [
        await repo.claim(i, registry, capacity=4, lease_seconds=30, owner_max_running=1) for i in ids
    ]
    assert [isinstance(o, str) for o in outcomes] == [False] * 4 + [True]
    assert outcomes[4] == "capacity_full"


async def test_concurrent_claims_never_exceed_an_owners_running_limit(services: Any) -> None:
    repo, registry = services.repo, services.registry
    ids = [await submit(repo, owner="alice") for _ in range(12)]
    outcomes = await asyncio.gather(
        *(repo.claim(i, registry, capacity=10, lease_seconds=30, owner_max_running=2) for i in ids)
    )
    assert sum(not isinstance(o, str) for o in outcomes) == 2
    assert {o for o in outcomes if isinstance(o, str)} <= {"owner_limit", "capacity_busy"}


async def test_pending_quota_is_exact_under_concurrent_submissions(clean_db: None) -> None:
    svc = build_services(make_settings(owner_max_pending=5), pool_size=10)
    try:
        outcomes = await asyncio.gather(
            *(Submitter(svc).submit(TaskIntent("diagnostics.noop"), owner="alice") for _ in range(12)),
            return_exceptions=True,
        )
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 5
        assert all(isinstance(o, OverQuota) for o in outcomes if isinstance(o, BaseException))
        # Another owner's quota is its own; ownerless (Python API) submissions have none.
        await Submitter(svc).submit(TaskIntent("diagnostics.noop"), owner="bob")
        await Submitter(svc).submit(TaskIntent("diagnostics.noop"))
    finally:
        await svc.close()


@pytest.fixture
async def quota_client(clean_db: None) -> Any:
    svc = build_services(make_settings(api_keys=KEYS, owner_max_pending=2, diagnostics="all"), pool_size=5)
    app = create_app(services=svc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c
    await svc.close()


async def test_http_answers_429_with_the_reason_over_the_pending_quota(
    quota_client: httpx.AsyncClient,
) -> None:
    for _ in range(2):
        assert (
            await quota_client.post("/tasks", json={"task_type": "diagnostics.noop"}, headers=ALICE)
        ).status_code == 202
    r = await quota_client.post("/tasks", json={"task_type": "diagnostics.noop"}, headers=ALICE)
    assert r.status_code == 429 and "DTASK_OWNER_MAX_PENDING" in r.text
    batch = await quota_client.post(
        "/tasks/batch", json={"tasks": [{"task_type": "diagnostics.noop"}]}, headers=ALICE
    )
    assert batch.json()["results"][0]["error"]["code"] == "quota"


@pytest.mark.parametrize(
    ("policy", "alice", "root"), [("admin", 403, 202), ("all", 202, 202), ("off", 403, 403)]
)
async def test_diagnostics_policy(clean_db: None, policy: str, alice: int, root: int) -> None:
    svc = build_services(make_settings(api_keys=KEYS, diagnostics=policy), pool_size=2)
    app = create_app(services=svc)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"task_type": "diagnostics.sleep", "payload": {"seconds": 0}}
            assert (await c.post("/tasks", json=body, headers=ALICE)).status_code == alice
            assert (await c.post("/tasks", json=body, headers=ROOT)).status_code == root
            listed = {t["task_type"] for t in (await c.get("/task-types", headers=ALICE)).json()}
            assert ("diagnostics.sleep" in listed) == (alice == 202)
    finally:
        await svc.close()
    if policy == "off":
        with pytest.raises(Forbidden):
            await Submitter(svc).submit(TaskIntent("diagnostics.noop"))


@pytest.mark.parametrize(
    "payload",
    [
        {"seconds": 0, "steps": 10**15, "effects": True},
        {"seconds": 1e9},
        {"seconds": -1},
        {"seconds": "abc"},
        {"secs": 1},
        {"steps": 0},
        {"effects": "yes"},
    ],
)
async def test_every_diagnostics_parameter_is_bounded(services: Any, payload: dict[str, Any]) -> None:
    from tasks_core.submission import InvalidTask

    with pytest.raises(InvalidTask) as refused:
        await Submitter(services).submit(TaskIntent("diagnostics.sleep", payload))
    assert refused.value.field == "payload" and refused.value.errors
    assert (await services.repo.summary())["total"] == 0


async def test_a_claim_of_an_unknown_id_changes_nothing(services: Any) -> None:
    assert await services.repo.claim(uuid.uuid4(), services.registry, capacity=4, lease_seconds=30) == (
        "unknown_task"
    )


async def test_an_owners_finishing_task_hands_its_slot_to_that_owners_next_task(services: Any) -> None:
    """The terminal write picks what the freed slot takes next in the same statement, whose snapshot
    still sees the finishing task running: counted, it would put its owner at the limit, and the
    owner's next task would wait for the periodic publisher."""
    from tasks_core.store.outcomes import RelayOptions

    repo, registry = services.repo, services.registry
    first, second = [await submit(repo, owner="alice") for _ in range(2)]
    running = await repo.claim(first, registry, capacity=4, lease_seconds=30, owner_max_running=1)
    assert not isinstance(running, str)
    hand_on = RelayOptions(registry, capacity=4, ahead=0, window=60.0, limit=100, owner_max_running=1)
    finished = await repo.finish_and_relay(
        first, running.token, registry, status=Status.SUCCESS, relay=hand_on
    )
    assert [task_id for task_id, _ in finished.relay] == [second]
