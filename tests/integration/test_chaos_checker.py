"""The fault campaign's checker against hand-built histories in the real test database.

Each test writes rows into tasks, task_attempts, diagnostics_effects and diagnostics_runs (exactly
what a campaign leaves behind), loads them with the checker's own loader, and asserts the verdict.
A clean history must pass; every violating history must be reported under its invariant, so each
of these tests fails if the check it covers is weakened.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.db import make_engine
from tasks_core.devkit.chaos.checker import (
    Bounds,
    ExpiredLease,
    Observations,
    PostgresOutage,
    Report,
    RunningLease,
    check,
    load_snapshot,
    recovery_deadline,
)

# Recovery bound after a lease's end: heartbeat 1 + reconcile 1 + margin 1 = 3 s; stall bound 6 s.
BOUNDS = Bounds(capacity=2, lease_seconds=3, reconcile_seconds=1, publish_seconds=2, margin_seconds=1)
FENCED = {"heartbeat": 1.0}


class History:
    """Rows of a made-up campaign; times are seconds after ``base`` (PostgreSQL's clock)."""

    def __init__(self, engine: AsyncEngine, base: datetime) -> None:
        self.engine = engine
        self.base = base

    def at(self, seconds: float) -> datetime:
        return self.base + timedelta(seconds=seconds)

    async def task(
        self,
        created: float,
        finished: float | None,
        *,
        status: str = "success",
        key: str | None = None,
        attempts: int = 1,
        error: str | None = None,
        task_type: str = "diagnostics.sleep",
    ) -> uuid.UUID:
        task_id = uuid.uuid4()
        running = status == "running"
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    """INSERT INTO tasks (id, task_type, handler_version, payload, status, dedupe_key,
                           attempt_token, attempt_count, lease_expires_at, timeout_seconds, error,
                           created_at, started_at, finished_at)
                    VALUES (:id, :tt, 1, '{}', :status, :key, :tok, :n, :lease, 60,
                            CAST(:error AS jsonb), :created, :created, :finished)"""
                ),
                {"id": task_id, "tt": task_type, "status": status, "key": key,
                 "tok": uuid.uuid4() if running else None, "n": attempts,
                 "lease": self.at(created + 4) if running else None,
                 "error": json.dumps({"code": error, "message": "x"}) if error else None,
                 "created": self.at(created), "finished": None if finished is None else self.at(finished)},
            )
        return task_id

    async def attempt(
        self, task_id: uuid.UUID, n: int, claimed: float, ended: float | None, *,
        outcome: str = "success", worker: str = "chaos-w1.1@host:100",
    ) -> uuid.UUID:
        token = uuid.uuid4()
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    """INSERT INTO task_attempts
                           (task_id, attempt, token, worker, claimed_at, ended_at, outcome)
                    VALUES (:task, :n, :tok, :worker, :claimed, :ended, :outcome)"""
                ),
                {"task": task_id, "n": n, "tok": token, "worker": worker, "claimed": self.at(claimed),
                 "ended": None if ended is None else self.at(ended), "outcome": outcome},
            )
        return token

    async def effect(self, task_id: uuid.UUID, token: uuid.UUID, at: float, step: int = 1) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    """INSERT INTO diagnostics_effects (task_id, attempt_token, step, created_at)
                    VALUES (:task, :tok, :step, :at)"""
                ),
                {"task": task_id, "tok": token, "step": step, "at": self.at(at)},
            )

    async def run(self, task_id: uuid.UUID, token: uuid.UUID | None, status: str, at: float) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    """INSERT INTO diagnostics_runs
                           (task_id, attempt_token, status, steps_done, hook, updated_at)
                    VALUES (:task, :tok, :status, 1, NULL, :at)"""
                ),
                {"task": task_id, "tok": token, "status": status, "at": self.at(at)},
            )

    async def done(
        self, created: float, claimed: float, ended: float, *, key: str | None = None,
        worker: str = "chaos-w1.1@host:100",
    ) -> uuid.UUID:
        """A clean one-attempt success: claimed, one effect midway, domain row converged."""
        task_id = await self.task(created, ended, key=key)
        token = await self.attempt(task_id, 1, claimed, ended, worker=worker)
        await self.effect(task_id, token, (claimed + ended) / 2)
        await self.run(task_id, token, "done", ended)
        return task_id

    def observations(self, **kw: Any) -> Observations:
        base: dict[str, Any] = {
            "window_start": self.at(-1), "window_end": self.at(100), "rejected_writes": dict(FENCED),
        }
        base.update(kw)
        return Observations(**base)

    async def verdict(self, **kw: Any) -> Report:
        return check(await load_snapshot(self.engine), self.observations(**kw), BOUNDS)


@pytest.fixture
async def history(clean_db: None, database_url: str) -> AsyncIterator[History]:
    engine = make_engine(database_url, pool_size=2)
    async with engine.connect() as conn:
        now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    yield History(engine, now - timedelta(seconds=200))
    await engine.dispose()


def counts(report: Report) -> dict[str, int]:
    return report.counts()


async def test_a_clean_history_with_a_retry_and_a_reused_key_passes(history: History) -> None:
    await history.done(0, 1, 5, key="k")
    await history.done(5.5, 6, 9, key="k")  # the key was free again: no overlap
    retried = await history.task(0, 12, attempts=2)
    first = await history.attempt(retried, 1, 1, 5, outcome="lease_expired")
    second = await history.attempt(retried, 2, 7, 12)
    await history.effect(retried, first, 2)
    await history.effect(retried, second, 8)
    await history.run(retried, second, "done", 12)
    await history.done(4, 5, 7)  # never more than two attempts live at once: capacity 2 is reached

    report = await history.verdict()

    clean = {**{f"I{i}": 0 for i in range(1, 8)}, "schedule": 0, "restart": 0}
    assert counts(report) == clean, report.table()
    assert report.fencing_exercised and report.ok, report.table()
    assert report.summary["retried_tasks"] == 1 and report.summary["effects"] == 5
    assert "PASS" in report.table()


async def test_an_attempt_claimed_before_its_run_at_is_found(history: History) -> None:
    early, on_time = await history.done(0, 1, 5), await history.done(0, 3, 6)
    schedule_at = text("UPDATE tasks SET run_at = :at WHERE id = :id")
    async with history.engine.begin() as conn:
        await conn.execute(schedule_at, {"at": history.at(2), "id": early})  # claimed at 1: too early
        await conn.execute(schedule_at, {"at": history.at(3), "id": on_time})
    report = await history.verdict()
    [schedule] = [f for f in report.findings if f.invariant == "schedule"]
    assert schedule.count == 1 and schedule.examples[0]["task_id"] == early, schedule
    assert not report.ok


async def test_overlapping_attempts_of_one_task_violate_i1(history: History) -> None:
    task_id = await history.task(0, 10, attempts=2)
    await history.attempt(task_id, 1, 1, 6, outcome="lease_expired")
    await history.attempt(task_id, 2, 5, 10)  # claimed while the first lease still held
    report = await history.verdict()
    i1 = report.findings[0]
    assert i1.invariant == "I1" and i1.count == 1 and i1.details["overlapping_pairs"] == 1, i1
    assert not report.ok and "FAIL" in report.table()


async def test_an_incomplete_trail_violates_i1(history: History) -> None:
    open_one = await history.task(0, 10)  # finished, yet its attempt never ended
    await history.attempt(open_one, 1, 1, None)
    await history.task(0, 10, attempts=2)  # two claims counted, no attempt rows
    i1 = (await history.verdict()).findings[0]
    assert i1.details["open_attempts_of_finished_tasks"] == 1, i1
    assert i1.details["trail_mismatches"] == 1, i1
    assert i1.count == 2, i1


async def test_writes_from_a_non_owner_violate_i2(history: History) -> None:
    a = await history.done(0, 1, 5)
    b = await history.task(0, 9)
    b_token = await history.attempt(b, 1, 2, 6, outcome="lease_expired")
    await history.effect(b, b_token, 7)  # committed after its lease ended: a late write
    a_token = (await load_snapshot(history.engine)).attempts[0]["token"]
    await history.effect(b, a_token, 3)  # stamped with another task's attempt
    await history.effect(b, uuid.uuid4(), 4)  # stamped with no attempt at all
    await history.run(b, a_token, "failed", 9)  # domain row owned by another task's attempt
    i2 = (await history.verdict()).findings[1]
    assert i2.invariant == "I2", i2
    assert i2.details["effects_outside_their_attempt"] == 1, i2
    assert i2.details["effects_with_foreign_token"] == 2, i2
    assert i2.details["domain_rows_with_foreign_token"] == 1, i2
    assert i2.count == 4, i2
    assert a  # the clean task is not reported


async def test_an_effect_before_the_claim_violates_i2(history: History) -> None:
    task_id = await history.task(0, 9)
    token = await history.attempt(task_id, 1, 3, 9)
    await history.effect(task_id, token, 2)
    assert (await history.verdict()).findings[1].count == 1


async def test_unfinished_and_late_converged_tasks_violate_i3(history: History) -> None:
    await history.task(0, None, status="pending", attempts=0)
    late = await history.task(0, 20, status="failed", error="lease_expired")
    await history.attempt(late, 1, 1, 10, outcome="lease_expired")  # lease ended at 10, failed at 20
    on_time = await history.task(0, 13, status="failed", error="lease_expired")
    await history.attempt(on_time, 1, 1, 10, outcome="lease_expired")
    i3 = (await history.verdict()).findings[2]
    assert i3.invariant == "I3", i3
    assert i3.details["not_terminal"] == 1, i3
    assert i3.details["converged_late"] == 1, i3
    assert i3.count == 2, i3
    assert i3.details["longest_unconverged_lease_seconds"] == 10.0, i3


async def test_a_transport_outage_moves_the_recovery_deadline(history: History) -> None:
    late = await history.task(0, 20, status="failed", error="lease_expired")
    await history.attempt(late, 1, 1, 10, outcome="lease_expired")
    # Redis was down from 9 s until the chain worked again at 18 s: 18 + 3 s bound >= 20.
    excused = await history.verdict(outages=[(history.at(9), history.at(18))])
    assert excused.findings[2].count == 0, excused.findings[2]
    # An outage after the deadline had passed excuses nothing.
    not_excused = await history.verdict(outages=[(history.at(15), history.at(18))])
    assert not_excused.findings[2].count == 1, not_excused.findings[2]


async def test_a_lapsed_lease_seen_running_too_long_and_a_stall_violate_i3(history: History) -> None:
    task_id = await history.done(0, 1, 30)
    seen = ExpiredLease(task_id, history.at(10), history.at(14))  # bound 3 s: 1 s too late
    stall = (history.at(40), history.at(52))  # bound 2*2 + 1 + 1 = 6 s
    i3 = (await history.verdict(expired_leases=[seen], stalls=[stall])).findings[2]
    assert i3.details["converged_late"] == 1 and i3.details["pending_stalls"] == 1, i3
    assert i3.count == 2, i3
    # The same stall during an outage is the outage's, not the publisher's.
    during = await history.verdict(stalls=[stall], outages=[(history.at(39), history.at(50))])
    assert during.findings[2].count == 0, during.findings[2]


async def test_two_active_tasks_on_one_dedupe_key_violate_i4(history: History) -> None:
    await history.done(0, 1, 8, key="same")
    await history.done(5, 9, 12, key="same")  # created while the first still held the key
    await history.done(0, 1, 4, key="other")
    await history.done(4, 5, 6, key="other")  # created the instant the first ended: fine
    i4 = (await history.verdict()).findings[3]
    assert i4.invariant == "I4" and i4.count == 1, i4
    assert i4.examples[0]["dedupe_key"] == "same", i4


async def test_an_unfinished_task_holds_its_key_for_ever(history: History) -> None:
    await history.task(0, None, status="pending", key="k", attempts=0)
    await history.done(50, 51, 52, key="k")
    assert (await history.verdict()).findings[3].count == 1


async def test_more_live_attempts_than_the_capacity_violate_i5(history: History) -> None:
    for start in (1, 2, 3):  # capacity 2: the third claim makes three live attempts
        await history.done(0, start, 10)
    i5 = (await history.verdict()).findings[4]
    assert i5.invariant == "I5" and i5.count == 1 and i5.details["peak_live_attempts"] == 3, i5
    seen = (await history.verdict(max_running_seen=3)).findings[4]
    assert seen.count == 2, seen


async def test_back_to_back_attempts_do_not_overlap_for_i5(history: History) -> None:
    for start in (1, 4, 7, 10):  # each starts the instant another ends; two chains side by side
        await history.done(0, start, start + 3)
        await history.done(0, start, start + 3, worker="chaos-w2.1@host:200")
    assert (await history.verdict()).findings[4].count == 0


async def test_a_domain_row_in_progress_after_its_task_ended_violates_i6(history: History) -> None:
    task_id = await history.task(0, 5, status="failed", error="lease_expired")
    token = await history.attempt(task_id, 1, 1, 4, outcome="lease_expired")
    await history.run(task_id, token, "running", 2)
    still_running = await history.task(0, None, status="running")
    await history.run(still_running, None, "running", 2)  # its task is not finished: fine
    i6 = (await history.verdict()).findings[5]
    assert i6.invariant == "I6" and i6.count == 1, i6


async def test_a_timestamp_off_postgresqls_clock_violates_i7(history: History) -> None:
    await history.done(0, 1, 5, worker="chaos-w0.1@host:300")
    skewed = await history.task(0, 9)
    await history.attempt(skewed, 1, -3600, 9, worker="chaos-w0.1@host:300")  # a worker's clock, 1 h off
    report = await history.verdict(skewed_workers=["chaos-w0.1@host"], skew_seconds=-3600.0)
    i7 = report.findings[6]
    assert i7.invariant == "I7" and i7.count == 1, i7
    assert i7.details["skewed_attempts"] == 2 and i7.details["skew_exercised"], i7
    assert report.findings[1].count == 0  # only I7 names it


async def test_no_rejected_late_write_means_fencing_was_not_tested(history: History) -> None:
    await history.done(0, 1, 5)
    report = await history.verdict(rejected_writes={})
    assert report.violations == 0 and not report.fencing_exercised and not report.ok
    assert "fencing was not exercised" in report.table()
    assert report.to_json()["fencing"]["exercised"] is False


def test_recovery_deadline_skips_outages_that_begin_before_it() -> None:
    t0 = datetime(2026, 1, 1, 12, 0, 0).astimezone()
    obs = Observations(window_start=t0, window_end=t0 + timedelta(seconds=100), outages=[
        (t0 + timedelta(seconds=3), t0 + timedelta(seconds=10)),
        (t0 + timedelta(seconds=11), t0 + timedelta(seconds=14)),  # begins before 10 + 2
        (t0 + timedelta(seconds=40), None),  # long after: irrelevant
    ])
    assert recovery_deadline(t0, 2.0, obs) == t0 + timedelta(seconds=2)  # ends before the first
    assert recovery_deadline(t0 + timedelta(seconds=2), 2.0, obs) == t0 + timedelta(seconds=16)


# ------------------------------------------------------------------ PostgreSQL faults (--own-postgres)


def restart(
    h: History, down: float, up: float, *running: tuple[uuid.UUID, uuid.UUID, float]
) -> PostgresOutage:
    """A restart from ``down`` to ``up`` with (task, token, lease end) running just before it."""
    leases = tuple(RunningLease(t, tok, h.at(lease)) for t, tok, lease in running)
    return PostgresOutage("restart", h.at(down), h.at(up), leases)


async def test_tasks_running_at_a_short_restart_must_end_success_on_their_attempt(history: History) -> None:
    survivor = await history.task(0, 12)
    survivor_tok = await history.attempt(survivor, 1, 1, 12)
    # Its lease outlived the downtime by more than the retry gap (1 s), yet it failed on attempt 1.
    killed = await history.task(0, 16, status="failed", error="lease_expired")
    killed_tok = await history.attempt(killed, 1, 1, 13, outcome="lease_expired")
    # Retried on a second attempt: not the promise either (the running attempt had to finish it).
    rerun = await history.task(0, 20, attempts=2)
    rerun_tok = await history.attempt(rerun, 1, 1, 13, outcome="lease_expired")
    await history.attempt(rerun, 2, 15, 20)
    short = await history.task(0, 14, status="failed", error="lease_expired")
    short_tok = await history.attempt(short, 1, 1, 10.5, outcome="lease_expired")  # lease ended at 10.5
    near = await history.task(0, 14, status="failed", error="lease_expired")
    near_tok = await history.attempt(near, 1, 1, 11.5, outcome="lease_expired")  # only 0.5 s left after
    outage = restart(history, 9, 11, (survivor, survivor_tok, 13), (killed, killed_tok, 13),
                     (rerun, rerun_tok, 13), (short, short_tok, 10.5), (near, near_tok, 11.5))

    report = await history.verdict(postgres_outages=[outage])

    finding = report.findings[7]
    assert finding.invariant == "restart" and finding.count == 2, finding
    assert finding.details["eligible"] == 3 and finding.details["survived"] == 1, finding
    assert finding.details["not_counted"] == {
        "lease_shorter_than_the_downtime": 1, "lease_within_the_retry_gap": 1
    }, finding
    assert finding.details["near_misses"] == {"survived": 0, "ended": 1}, finding
    assert {e["task_id"] for e in finding.examples} == {killed, rerun}, finding.examples
    assert not report.ok and "ended by a short PostgreSQL restart" in report.table()
    assert "1 of 3 tasks" in report.table()
    # The same restart, but only the survivor: the promise held.
    kept = await history.verdict(postgres_outages=[restart(history, 9, 11, (survivor, survivor_tok, 13))])
    assert kept.findings[7].count == 0 and kept.findings[7].details["survived"] == 1


async def test_tasks_another_fault_hit_are_not_held_to_the_restart_promise(history: History) -> None:
    def lost_task() -> Any:
        return history.task(0, 30, status="failed", error="lease_expired")

    owner_killed = await lost_task()
    killed_tok = await history.attempt(owner_killed, 1, 1, 16, outcome="lease_expired",
                                       worker="chaos-w1.1@host:100")
    cancelled = await history.task(0, 14, status="cancelled", error="cancelled")
    cancelled_tok = await history.attempt(cancelled, 1, 1, 14, outcome="cancelled")
    async with history.engine.begin() as conn:
        await conn.execute(text("UPDATE tasks SET cancel_requested_at = finished_at WHERE id = :id"),
                           {"id": cancelled})
    failing = await history.task(0, 12, status="failed", error="handler_error", task_type="diagnostics.fail")
    failing_tok = await history.attempt(failing, 1, 1, 12, outcome="handler_error")
    paused_later = await lost_task()
    paused_tok = await history.attempt(paused_later, 1, 1, 18, outcome="lease_expired",
                                       worker="chaos-w3.1@host:300")
    outages = [
        restart(history, 9, 11, (owner_killed, killed_tok, 14), (cancelled, cancelled_tok, 14),
                (failing, failing_tok, 14), (paused_later, paused_tok, 14)),
        PostgresOutage("pause", history.at(13), history.at(19)),
    ]
    report = await history.verdict(
        postgres_outages=outages,
        worker_faults=[(history.at(12), "chaos-w1.1@host"), (history.at(12), "chaos-w2.1@host")],
    )
    finding = report.findings[7]
    assert finding.count == 0 and finding.details["eligible"] == 0, finding
    assert finding.details["not_counted"] == {
        "owner_killed_or_paused": 1, "cancel_requested": 1, "fails_on_purpose": 1, "database_paused_later": 1,
    }, finding
    # A worker fault before the claim or after the attempt ended says nothing about it.
    task = await history.task(0, 30, status="failed", error="lease_expired")
    tok = await history.attempt(task, 1, 5, 16, outcome="lease_expired", worker="chaos-w1.1@host:100")
    hit_before = await history.verdict(
        postgres_outages=[restart(history, 9, 11, (task, tok, 14))],
        worker_faults=[(history.at(4), "chaos-w1.1@host"), (history.at(17), "chaos-w1.1@host")],
    )
    assert hit_before.findings[7].count == 1, hit_before.findings[7]


async def test_a_task_is_judged_once_across_restarts(history: History) -> None:
    task = await history.task(0, 30)
    tok = await history.attempt(task, 1, 1, 30)
    twice = [restart(history, 9, 10, (task, tok, 13)), restart(history, 20, 21, (task, tok, 23))]
    finding = (await history.verdict(postgres_outages=twice)).findings[7]
    assert finding.details["eligible"] == 1 and finding.details["survived"] == 1, finding
    # It met a second restart it could not survive: the first one is not blamed for its end.
    lost = await history.task(0, 30, status="failed", error="lease_expired")
    lost_tok = await history.attempt(lost, 1, 1, 21, outcome="lease_expired")
    unsurvivable = [
        restart(history, 9, 10, (lost, lost_tok, 13)), restart(history, 20, 23, (lost, lost_tok, 21))
    ]
    finding = (await history.verdict(postgres_outages=unsurvivable)).findings[7]
    assert finding.count == 0, finding
    assert finding.details["not_counted"] == {
        "later_restart_not_survivable": 1, "lease_shorter_than_the_downtime": 1
    }, finding


async def test_no_restart_means_nothing_to_judge(history: History) -> None:
    await history.done(0, 1, 5)
    finding = (await history.verdict()).findings[7]
    assert finding.count == 0 and "no PostgreSQL restart" in finding.checked, finding


async def test_a_postgres_outage_moves_the_recovery_deadline_like_redis_does(history: History) -> None:
    late = await history.task(0, 20, status="failed", error="lease_expired")
    await history.attempt(late, 1, 1, 10, outcome="lease_expired")  # lease lapsed at 10, failed at 20
    pause = PostgresOutage("pause", history.at(9), history.at(18))  # 18 + 3 s bound >= 20
    excused = await history.verdict(postgres_outages=[pause])
    i3 = excused.findings[2]
    assert i3.count == 0 and i3.details["postgres_outages"] == 1, i3
    assert "PostgreSQL outage" in i3.checked, i3.checked
    # Until recovery worked again (a reconcile ran after the database answered), like Redis.
    slow = PostgresOutage("pause", history.at(9), history.at(14), recovered_at=history.at(18))
    assert (await history.verdict(postgres_outages=[slow])).findings[2].count == 0
    quick = PostgresOutage("pause", history.at(9), history.at(14), recovered_at=history.at(14.5))
    assert (await history.verdict(postgres_outages=[quick])).findings[2].count == 1
    # A pause that began after the deadline had passed excuses nothing; neither loosens I1/I2.
    after = await history.verdict(postgres_outages=[PostgresOutage("pause", history.at(15), history.at(18))])
    assert after.findings[2].count == 1, after.findings[2]
    overlapping = await history.task(0, 30, attempts=2)
    first = await history.attempt(overlapping, 1, 1, 12, outcome="lease_expired")
    await history.attempt(overlapping, 2, 11, 30)  # claimed during the pause, before the lease ended
    await history.effect(overlapping, first, 13)  # a late write of the first owner, after the pause
    during = await history.verdict(postgres_outages=[PostgresOutage("pause", history.at(9), history.at(14))])
    assert during.findings[0].count == 1 and during.findings[1].count == 1, during.table()


async def test_a_stall_during_a_postgres_outage_is_the_outage(history: History) -> None:
    await history.done(0, 1, 5)
    stall = (history.at(40), history.at(52))
    down = PostgresOutage("restart", history.at(39), history.at(50))
    report = await history.verdict(stalls=[stall], postgres_outages=[down])
    assert report.findings[2].count == 0, report.findings[2]
