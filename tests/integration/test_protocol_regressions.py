"""Regressions found by the protocol's stateful test (docs/protocol/README.md lists them)."""

from __future__ import annotations

import uuid
from typing import Any

from hooks_for_tests import registry_with_test_specs
from repo_helpers import claim, submit

from tasks_core.model import Status
from tasks_core.store.base import runnable_arrays as _runnable_arrays
from tasks_core.store.base import type_caps as _type_caps
from tasks_core.store.outcomes import Claim
from tasks_core.store.statements import CLAIM_SQL


async def test_a_late_message_for_a_finished_task_takes_no_slot_from_a_live_claim(services: Any) -> None:
    """A claim of a task that is no longer pending (a late or duplicate message) used to lock a
    free capacity slot for the length of its statement, so a concurrent claim of a pending task
    found every free slot locked and was refused `capacity_full` (its message dropped). The late
    claim is held open here in its own transaction, which makes that window as long as we like."""
    repo, engine = services.repo, services.engine
    registry = registry_with_test_specs()
    done = await submit(repo)
    got = await claim(repo, registry, done, capacity=1)
    assert await repo.finish(done, got.token, registry, status=Status.SUCCESS, result={}) == Status.SUCCESS
    waiting = await submit(repo)

    params = repo._p(
        id=done,
        tok=uuid.uuid4(),
        lease=30.0,
        worker="late",
        cap=1,
        omax=None,
        **_runnable_arrays(registry),
        **_type_caps(registry),
    )
    async with engine.connect() as late, late.begin():
        assert (await late.execute(CLAIM_SQL.clause, params)).first() is None  # refused, transaction open
        live = await repo.claim(waiting, registry, capacity=1, lease_seconds=30.0, worker="live")
    assert isinstance(live, Claim), f"the live claim was refused: {live}"
