"""The durable protocol end to end, with real worker and beat processes, PostgreSQL and Redis.

Every bound asserted here is a protocol bound (lease, reconcile interval, heartbeat interval,
shutdown grace, plus a small margin for scheduling), never a performance figure. Durations are
measured with PostgreSQL's clock where the row carries the timestamps, else with time.monotonic.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import uuid
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import text

from tasks_core.submission import Submitter, TaskIntent
from tests.integration.repo_helpers import attempt_rows
from tests.system.conftest import (
    LEASE_SECONDS,
    PUBLISH_SECONDS,
    READINESS_KEY,
    RECONCILE_SECONDS,
    SHUTDOWN_GRACE_SECONDS,
    STARTUP_TIMEOUT,
    Cluster,
    wait_for,
)

pytestmark = pytest.mark.system

TERMINAL = ("success", "failed", "cancelled")
HEARTBEAT_SECONDS = LEASE_SECONDS / 3
# Slack for a busy two-core machine: process wake-ups, one beat tick, a few SQL round trips.
MARGIN = 2.0
# Nothing listens on port 1 of the loopback: a publish there fails at once with "connection refused".
CLOSED_BROKER = "redis://127.0.0.1:1/0"
LONG_SLEEP = {"seconds": 60, "steps": 120}
# What matters for ownership runs on both pools — a process per task, and the dense mode (many
# tasks on one process's event loop) — and on both brokers: Redis, and RabbitMQ (a vhost of this
# run's own).
POOLS = pytest.mark.parametrize(
    ("pool", "broker"), [("prefork", "redis"), ("threads", "redis"), ("prefork", "rabbitmq")],
    indirect=["broker"],
)
BROKERS = pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)


# ---------------------------------------------------------------------------- helpers


async def submit(services: Any, task_type: str, payload: dict[str, Any]) -> uuid.UUID:
    result = await Submitter(services).submit(TaskIntent(task_type, payload), owner="system-test")
    assert result.published, result.publish_error
    return result.task_id


async def get(services: Any, task_id: uuid.UUID) -> dict[str, Any]:
    row = await services.repo.get(task_id)
    assert row is not None, f"task {task_id} vanished"
    return row


async def attempts(services: Any, task_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
    return await attempt_rows(services.engine, task_id)


async def diagnostics_run(services: Any, task_id: uuid.UUID) -> dict[str, Any] | None:
    async with services.engine.connect() as conn:
        row = (
            await conn.execute(text("SELECT * FROM diagnostics_runs WHERE task_id = :id"), {"id": task_id})
        ).mappings().first()
    return None if row is None else dict(row)


async def pg_now(services: Any) -> datetime:
    async with services.engine.connect() as conn:
        now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    return now


async def wait_terminal(services: Any, task_id: uuid.UUID, within: float) -> dict[str, Any]:
    async def terminal() -> dict[str, Any] | None:
        row = await get(services, task_id)
        return row if row["status"] in TERMINAL else None

    return await wait_for(terminal, within=within, interval=0.05, what=f"task {task_id} to end")


async def wait_handler_running(services: Any, task_id: uuid.UUID, within: float = 30.0) -> dict[str, Any]:
    """Running, and the handler itself has started (its domain row is marked in progress)."""

    async def started() -> dict[str, Any] | None:
        row = await get(services, task_id)
        assert row["status"] in ("pending", "running"), row
        run = await diagnostics_run(services, task_id)
        return row if row["status"] == "running" and run is not None and run["status"] == "running" else None

    return await wait_for(started, within=within, what=f"task {task_id}'s handler to start")


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most intervals open at one instant; an interval ending when another starts does not overlap it."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, delta in events:  # at equal times -1 sorts before +1: end before start
        open_now += delta
        peak = max(peak, open_now)
    return peak


def handled_deliveries(log: str) -> list[str]:
    """The return value of every dtask.run message the worker finished (its RunOutcome status)."""
    return re.findall(r"Task dtask\.run\[[^\]]+\] succeeded in [^:]+: '([^']*)'", log)


def assert_one_attempt(rows: list[dict[str, Any]], *outcomes: str) -> dict[str, Any]:
    assert len(rows) == 1, rows
    attempt = rows[0]
    assert attempt["outcome"] in outcomes, attempt
    assert attempt["ended_at"] is not None and attempt["ended_at"] >= attempt["claimed_at"], attempt
    return attempt


# ---------------------------------------------------------------------------- tests


@BROKERS
async def test_failed_first_publish_is_sent_by_the_publisher_once_workers_run(
    cluster: Cluster, services: Any
) -> None:
    """Submit commits the intent even when the broker is unreachable; beat's publisher sends it later."""
    done = cluster.run_cli(
        "submit", "diagnostics.sleep", "--payload", '{"seconds": 0}', DTASK_BROKER_URL=CLOSED_BROKER
    )
    assert done.returncode == 0, done.stderr
    assert "publish" in done.stderr.lower(), done.stderr  # the failure is reported, not raised
    task_id = uuid.UUID(done.stdout.strip().splitlines()[-1])

    row = await get(services, task_id)
    assert row["status"] == "pending", row
    assert row["publish_error"], row
    assert row["attempt_count"] == 0 and row["attempt_token"] is None, row

    worker = cluster.start_worker()
    cluster.start_beat(cli=True)  # `dtask beat`, the documented command
    await cluster.wait_worker_ready(worker)
    # No one republishes it but beat's publisher: bound = start-up + one publish interval + margin.
    row = await wait_terminal(services, task_id, within=STARTUP_TIMEOUT + PUBLISH_SECONDS + MARGIN)

    assert row["status"] == "success", row
    assert row["result"] == {"slept": 0.0, "steps": 1}, row
    assert row["attempt_count"] == 1, row
    assert row["attempt_token"] is None and row["lease_expires_at"] is None, row
    assert row["publish_error"] is None, row
    assert_one_attempt(await attempts(services, task_id), "success")
    run = await diagnostics_run(services, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("done", "success:success"), run


@POOLS
async def test_sigkilled_worker_task_fails_lease_expired_within_lease_plus_reconcile(
    cluster: Cluster, services: Any, pool: str, redis_client: Any
) -> None:
    """A worker killed with its whole process group: another worker's reconcile converges its task."""
    workers = [cluster.start_worker("worker-a", pool=pool), cluster.start_worker("worker-b", pool=pool)]
    beat = cluster.start_beat()
    await asyncio.gather(*(cluster.wait_worker_ready(w) for w in workers))
    await cluster.wait_readiness_fact()

    task_id = await submit(services, "diagnostics.sleep", LONG_SLEEP)
    await wait_handler_running(services, task_id)
    owner = (await attempts(services, task_id))[0]["worker"]
    victim = next(w for w in workers if owner.startswith(f"{w.node}:"))
    survivor = next(w for w in workers if w is not victim)

    if pool == "prefork":
        assert len(victim.group_members()) > 1  # main process and its pool children
    victim.killpg(signal.SIGKILL)
    killed_at = await pg_now(services)
    started = time.monotonic()
    bound = LEASE_SECONDS + RECONCILE_SECONDS + MARGIN
    row = await wait_terminal(services, task_id, within=bound + 5)
    elapsed = time.monotonic() - started
    print(f"lease_expired {(row['finished_at'] - killed_at).total_seconds():.2f} s after SIGKILL "
          f"(PostgreSQL clock), {elapsed:.2f} s monotonic; bound {bound:g} s")

    assert victim.wait_exit(10) == -signal.SIGKILL
    assert victim.group_members() == [], "a pool child outlived the SIGKILL of its group"
    assert row["status"] == "failed", row
    assert row["error"]["code"] == "lease_expired", row
    assert row["attempt_token"] is None, row
    assert (row["finished_at"] - killed_at).total_seconds() <= bound, (row["finished_at"], killed_at)
    assert elapsed <= bound + 0.5, elapsed
    # The failure hook ran in the reconciler's transaction and converged the domain row (I6).
    run = await diagnostics_run(services, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("failed", "failure:failed"), run
    attempt = assert_one_attempt(await attempts(services, task_id), "lease_expired")
    assert attempt["ended_at"] <= row["finished_at"], attempt
    # Recovery came from the other worker while beat kept scheduling.
    assert survivor.alive() and beat.alive()
    await cluster.wait_readiness_fact(within=10)
    fact = json.loads(redis_client.get(READINESS_KEY))
    assert fact["worker"].startswith(f"{survivor.node}:"), fact


@POOLS
async def test_one_task_id_published_five_times_runs_once(cluster: Cluster, services: Any, pool: str) -> None:
    from tasks_core.store.outcomes import NewTask

    worker = cluster.start_worker(concurrency=4, pool=pool)
    await cluster.wait_worker_ready(worker)
    # The intent without the submitter's own publish: the five copies below are the only messages.
    async with services.engine.begin() as conn:
        inserted = await services.repo.insert(
            conn, NewTask("diagnostics.sleep", 1, {"seconds": 1, "steps": 2}, timeout_seconds=60)
        )
    task_id = inserted.id

    await asyncio.to_thread(services.transport.publish_sync, [str(task_id)] * 5)
    row = await wait_terminal(services, task_id, within=30)

    async def all_handled() -> list[str] | None:
        outcomes = handled_deliveries(worker.log_text())
        return outcomes if len(outcomes) >= 5 else None

    outcomes = await wait_for(all_handled, within=15, what="the worker to handle all five messages")
    assert row["status"] == "success", row
    assert row["attempt_count"] == 1, row
    assert_one_attempt(await attempts(services, task_id), "success")
    assert len(outcomes) == 5 and outcomes.count("success") == 1, outcomes
    assert all(o == "success" or o.startswith("not_pending:") for o in outcomes), outcomes


@POOLS
async def test_capacity_is_never_exceeded_and_the_relay_hands_on_without_beat(
    cluster: Cluster, services: Any, pool: str
) -> None:
    """12 two-second tasks, capacity 4, 8 pool children, no beat: the submission puts what capacity
    can take on the broker (4 slots + 4 ahead), the messages refused for capacity are gone, so only
    the relay (after each terminal write; its pick run by the same process, DTASK_WORKER_RUN_NEXT)
    can start the rest."""
    # 4 messages queued ahead (not the default while run-next is on), so claims are refused. One
    # owner submits them all: its running limit is the capacity here (by default it keeps half
    # back for other owners, and capacity is what this test fills).
    services.settings.publish_ahead, services.settings.owner_max_running = 4, 4
    worker = cluster.start_worker(concurrency=8, pool=pool, DTASK_CAPACITY="4", DTASK_PUBLISH_SECONDS="3600",
                                  DTASK_PUBLISH_AHEAD="4", DTASK_OWNER_MAX_RUNNING="4")
    await cluster.wait_worker_ready(worker)

    intents = [TaskIntent("diagnostics.sleep", {"seconds": 2, "steps": 2}) for _ in range(12)]
    results = await Submitter(services).submit_many(intents, owner="system-test")
    ids = [r.task_id for r in results if not isinstance(r, Exception)]
    assert len(ids) == 12, results
    assert sum(r.published for r in results if not isinstance(r, Exception)) == 8, results  # the rest wait

    async def all_done() -> list[dict[str, Any]] | None:
        rows = [await get(services, i) for i in ids]
        return rows if all(r["status"] in TERMINAL for r in rows) else None

    # Liveness only (a generous bound): without the relay this never happens.
    rows = await wait_for(all_done, within=45, interval=0.2, what="all 12 tasks to end")
    assert [r["status"] for r in rows] == ["success"] * 12, [(r["id"], r["status"], r["error"]) for r in rows]
    assert all(r["attempt_count"] == 1 for r in rows), rows

    trail = await attempts(services)
    assert sorted(a["task_id"] for a in trail) == sorted(ids), trail
    assert all(a["outcome"] == "success" and a["ended_at"] is not None for a in trail), trail
    peak = max_overlap([(a["claimed_at"], a["ended_at"]) for a in trail])
    span = (max(a["ended_at"] for a in trail) - min(a["claimed_at"] for a in trail)).total_seconds()
    print(f"12 tasks in {span:.2f} s, peak overlap {peak}")
    assert peak <= 4, f"{peak} attempts overlapped with capacity 4"
    assert peak == 4, f"capacity was never filled (peak {peak}): the test proved nothing"
    log = worker.log_text()
    assert "capacity_full" in log, "no message was ever refused for capacity: the relay was not exercised"


@POOLS
async def test_cancel_of_a_running_task_ends_it_within_one_heartbeat(
    cluster: Cluster, services: Any, pool: str
) -> None:
    worker = cluster.start_worker(pool=pool)
    await cluster.wait_worker_ready(worker)
    task_id = await submit(services, "diagnostics.sleep", LONG_SLEEP)
    await wait_handler_running(services, task_id)

    done = cluster.run_cli("cancel", str(task_id))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cancel requested", done.stdout
    row = await wait_terminal(services, task_id, within=HEARTBEAT_SECONDS + MARGIN + 5)

    assert row["status"] == "cancelled", row
    assert row["error"]["code"] == "cancelled", row
    waited = (row["finished_at"] - row["cancel_requested_at"]).total_seconds()
    print(f"cancelled {waited:.2f} s after the request; bound {HEARTBEAT_SECONDS + MARGIN:g} s")
    assert 0 <= waited <= HEARTBEAT_SECONDS + MARGIN, waited
    run = await diagnostics_run(services, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("cancelled", "failure:cancelled"), run
    assert_one_attempt(await attempts(services, task_id), "cancelled")
    assert worker.alive()


@POOLS
async def test_sigterm_fails_a_running_task_with_worker_shutdown_before_the_worker_exits(
    cluster: Cluster, services: Any, pool: str
) -> None:
    """Warm shutdown of `dtask worker`: the handler gets its grace, then the task ends failed
    (worker_shutdown) with its hook, and the worker exits on its own."""
    worker = cluster.start_worker(cli=True, pool=pool)
    await cluster.wait_worker_ready(worker)
    task_id = await submit(services, "diagnostics.sleep", LONG_SLEEP)
    await wait_handler_running(services, task_id)

    worker.send(signal.SIGTERM)  # the main process only, as a supervisor would
    signalled_at = await pg_now(services)
    started = time.monotonic()
    exit_code = worker.wait_exit(timeout=SHUTDOWN_GRACE_SECONDS + 20)
    elapsed = time.monotonic() - started
    row = await get(services, task_id)  # read only once the process is gone
    print(f"worker exited {elapsed:.2f} s after SIGTERM; task ended "
          f"{(row['finished_at'] - signalled_at).total_seconds():.2f} s after it")

    assert exit_code == 0, exit_code
    # Celery's own warm shutdown (closing the consumer, joining the pool) takes a few seconds.
    assert elapsed <= SHUTDOWN_GRACE_SECONDS + 8, elapsed
    assert row["status"] == "failed", row
    assert row["error"]["code"] == "worker_shutdown", row
    assert row["attempt_token"] is None, row
    # The handler had its grace period before it was stopped.
    assert (row["finished_at"] - signalled_at).total_seconds() >= SHUTDOWN_GRACE_SECONDS - 0.2, row
    run = await diagnostics_run(services, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("failed", "failure:failed"), run
    # The repository records an owner's terminal write by status ("failed") and a convergence by
    # error code; either names this attempt's end.
    assert_one_attempt(await attempts(services, task_id), "failed", "worker_shutdown")


async def test_sigterm_hands_a_retry_safe_task_back_and_another_worker_finishes_it(
    cluster: Cluster, services: Any
) -> None:
    """Warm shutdown of a retry-safe task: pending again (attempt kept in the trail), and the id the
    stopping worker relayed on release is run by the next worker, with no beat to republish it."""
    from tasks_core.store.outcomes import NewTask

    extra = {"DTASK_EXTRA_TASK_MODULES": "tests.system.specs"}
    first = cluster.start_worker("worker-a", **extra)
    await cluster.wait_worker_ready(first)
    async with services.engine.begin() as conn:
        inserted = await services.repo.insert(
            conn, NewTask("system.retry_safe_sleep", 1, {"seconds": 3, "steps": 6}, timeout_seconds=60)
        )
    task_id = inserted.id
    await asyncio.to_thread(services.transport.publish_sync, [str(task_id)])
    await wait_handler_running(services, task_id)

    first.send(signal.SIGTERM)
    assert first.wait_exit(timeout=SHUTDOWN_GRACE_SECONDS + 20) == 0
    row = await get(services, task_id)
    assert row["status"] == "pending", row
    assert row["attempt_count"] == 1 and row["attempt_token"] is None and row["error"] is None, row
    assert_one_attempt(await attempts(services, task_id), "worker_shutdown")

    second = cluster.start_worker("worker-b", **extra)
    row = await wait_terminal(services, task_id, within=STARTUP_TIMEOUT + 3 + MARGIN)
    assert row["status"] == "success", row
    assert row["attempt_count"] == 2, row
    trail = await attempts(services, task_id)
    assert [a["outcome"] for a in trail] == ["worker_shutdown", "success"], trail
    assert trail[0]["worker"].startswith(f"{first.node}:"), trail
    assert trail[1]["worker"].startswith(f"{second.node}:"), trail
    assert trail[0]["ended_at"] <= trail[1]["claimed_at"], trail  # never two owners at once (I1)
    run = await diagnostics_run(services, task_id)
    assert run is not None and (run["status"], run["hook"]) == ("done", "success:success"), run


async def test_worker_and_beat_refuse_a_database_whose_schema_is_not_current(cluster: Cluster) -> None:
    import os

    from tasks_core.devkit.embedded import create_database, drop_database

    admin = os.environ["DTASK_TEST_ADMIN_URL"]
    name = f"dtask_empty_{uuid.uuid4().hex[:10]}"
    empty = create_database(admin, name)
    try:
        env = {"DTASK_DATABASE_URL": empty}
        procs = [
            cluster.start_worker("celery-worker", **env),
            cluster.start_worker("dtask-worker", cli=True, **env),
            cluster.start_beat("celery-beat", **env),
            cluster.start_beat("dtask-beat", cli=True, **env),
        ]
        for proc in procs:
            code = proc.wait_exit(timeout=60)
            log = proc.log_text()
            assert code != 0, f"{proc.name} started against an unmigrated database:\n{log}"
            assert "no version" in log and "dtask migrate" in log, f"{proc.name}:\n{log}"
            assert "ready." not in log and "Sending due task" not in log, f"{proc.name}:\n{log}"
    finally:
        drop_database(admin, name)


async def test_a_handler_that_ignores_cancel_ends_unresponsive_and_its_pool_process_is_recycled(
    cluster: Cluster, services: Any
) -> None:
    extra = {"DTASK_EXTRA_TASK_MODULES": "tests.system.specs", "DTASK_CLEANUP_GRACE_SECONDS": "1"}
    worker = cluster.start_worker(concurrency=2, **extra)
    await cluster.wait_worker_ready(worker)
    before = set(worker.group_members())
    from tasks_core.store.outcomes import NewTask

    async with services.engine.begin() as conn:
        stuck = (
            await services.repo.insert(conn, NewTask("system.swallow_cancel", 1, {}, timeout_seconds=60))
        ).id
    await asyncio.to_thread(services.transport.publish_sync, [str(stuck)])

    async def running() -> bool:
        return (await get(services, stuck))["status"] == "running"

    await wait_for(running, within=30, what="the swallowing handler to start")
    assert await services.repo.request_cancel(stuck, services.registry) == "requested"
    row = await wait_terminal(services, stuck, within=HEARTBEAT_SECONDS + 1 + MARGIN * 2)
    assert row["status"] == "failed" and row["error"]["code"] == "handler_unresponsive", row

    async def recycled() -> bool:
        return "recycling this pool process" in worker.log_text() and set(worker.group_members()) != before

    await wait_for(recycled, within=15, what="the pool process to be replaced")
    # The worker goes on: both children take work again.
    done = [await submit(services, "diagnostics.noop", {"n": i}) for i in range(4)]
    for task_id in done:
        assert (await wait_terminal(services, task_id, within=30))["status"] == "success"


async def test_a_dense_worker_restarted_under_its_node_name_expires_its_dead_attempts_at_start_up(
    cluster: Cluster, services: Any
) -> None:
    """A threads-pool worker runs its tasks in its one process: SIGKILLed and started again under the
    same node name, the new process ends the dead one's attempts before it takes work, by their
    tokens, long before their 60 s lease; the retry-safe task then runs again and succeeds."""
    env = {"DTASK_LEASE_SECONDS": "60", "DTASK_RETRY_BACKOFF_SECONDS": "0.5"}
    node = f"dense-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
    first = cluster.harness.start_worker(
        "worker-1", cluster.env(**env), node=node, concurrency=4, pool="threads"
    )
    cluster.start_beat(**env)
    await cluster.wait_worker_ready(first)
    task_id = await submit(services, "diagnostics.sleep_retry_safe", {"seconds": 4, "steps": 4})
    await wait_handler_running(services, task_id)
    lease = (await get(services, task_id))["lease_expires_at"]

    first.killpg(signal.SIGKILL)
    assert first.wait_exit(10) == -signal.SIGKILL
    second = cluster.harness.start_worker(
        "worker-2", cluster.env(**env), node=node, concurrency=4, pool="threads"
    )
    row = await wait_terminal(services, task_id, within=STARTUP_TIMEOUT + 4 + MARGIN * 4)

    assert row["status"] == "success" and row["attempt_count"] == 2, row
    trail = await attempts(services, task_id)
    assert [a["outcome"] for a in trail] == ["lease_expired", "success"], trail
    assert trail[0]["worker"] == f"{node}:{first.pid}", trail
    assert trail[1]["worker"] == f"{node}:{second.pid}", trail
    early = (lease - trail[0]["ended_at"]).total_seconds()
    print(f"the dead process's attempt ended {early:.1f} s before its lease ran out")
    assert early > 30, (lease, trail[0])
    assert "worker start-up: expired 1 attempt(s) at once" in second.log_text()
