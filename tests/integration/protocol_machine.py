"""The real TaskStore, on real PostgreSQL, held to the protocol model of docs/protocol.

A Hypothesis ``RuleBasedStateMachine`` plays several workers, a user and the reconciler against
one database: submits (with dedupe keys), claims (one at a time, and racing in real concurrent
sessions), heartbeats, fenced progress reports, owning transactions (whose lease may lapse
during the callback), terminal writes, retry-safe hand-backs, cancels and reconciles, while the
database clock (``TaskStore.now``, which replaces ``clock_timestamp()`` in every
statement) only moves forward. A worker keeps its token after it lost the task, so it keeps
trying late writes. After every step the database must equal the model's state exactly, and
the invariants I1, I2, I4, I5, I6 (README, "Invariants") must hold in what PostgreSQL holds (I7: no worker
clock exists here at all; only the database's decides).

Failures raise ``ModelMismatch`` (an AssertionError), so the mutant tests can tell a caught
mutant from a broken test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from hooks_for_tests import registry_with_test_specs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from tasks_core.db import make_engine
from tasks_core.model import Status
from tasks_core.store.facade import TaskStore
from tasks_core.store.outcomes import Claim, NewTask, OwnershipLost

LEASE = 10  # seconds of the database clock
CAPACITY = 2
WORKERS = 3
MAX_TASKS = 4
OWNER = "alice"
# (task_type, retry-safe max attempts or None)
TYPES = {"diagnostics.sleep": None, "test.retry_safe": 2}
# Children first (foreign keys).
TABLES = ("diagnostics_effects", "diagnostics_runs", "task_attempts", "task_slots", "tasks")


class ModelMismatch(AssertionError):
    """The database disagrees with the model, or an invariant does not hold."""


# Every mismatch raised, in order: the mutant tests read it, since Hypothesis may report a
# failure it could not replay identically (claims_race is decided by PostgreSQL) as flaky.
MISMATCHES: list[str] = []
# Examples started, and the example in which the first mismatch arose (the mutant tests report it).
EXAMPLES = {"started": 0, "first_mismatch": 0}


def expect(ok: bool, what: str) -> None:
    if not ok:
        if not MISMATCHES:
            EXAMPLES["first_mismatch"] = EXAMPLES["started"]
        MISMATCHES.append(what)
        raise ModelMismatch(what)


@dataclass
class ModelTask:
    id: uuid.UUID
    task_type: str
    dedupe_key: str | None
    status: str = "pending"
    token: uuid.UUID | None = None
    attempts: int = 0
    lease: int | None = None  # lease_expires_at, in seconds of the model clock
    cancel: bool = False
    progress: float = 0.0
    run: str | None = None  # diagnostics_runs.status
    effects: int = 0  # committed diagnostics_effects rows

    @property
    def max_attempts(self) -> int | None:
        return TYPES[self.task_type]


@dataclass
class Worker:
    task: ModelTask | None = None
    token: uuid.UUID | None = None
    attempt: int = 0


@dataclass
class Model:
    clock: int = 0
    tasks: list[ModelTask] = field(default_factory=list)

    def owned(self, task: ModelTask, token: uuid.UUID | None) -> bool:
        return (
            task.status == "running"
            and task.token == token
            and task.lease is not None
            and task.lease > self.clock
        )

    def running(self) -> int:
        return sum(t.status == "running" for t in self.tasks)


def _hook_run(task: ModelTask, final: str) -> None:
    """What the diagnostics terminal hooks do: a row in progress (or none yet) takes the verdict;
    a row already converged keeps its first one."""
    if task.run in (None, "running"):
        task.run = "done" if final == "success" else ("cancelled" if final == "cancelled" else "failed")


class ProtocolMachine(RuleBasedStateMachine):
    # One event loop and one engine for every example of a run (see ``machine``).
    loop: asyncio.Runner
    engine: AsyncEngine

    def __init__(self) -> None:
        super().__init__()
        EXAMPLES["started"] += 1
        self.registry = registry_with_test_specs()
        self.base: datetime = self.run(self._fresh_database())
        self.repo = TaskStore(self.engine, now=self.base)
        self.model = Model()
        self.workers = [Worker() for _ in range(WORKERS)]

    async def _fresh_database(self) -> datetime:
        async with self.engine.begin() as conn:
            for table in TABLES:  # DELETE: TRUNCATE per example costs far more on tiny tables
                await conn.execute(text(f"DELETE FROM {table}"))
            return (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()  # type: ignore[no-any-return]

    def run(self, coro: Any) -> Any:
        return self.loop.run(coro)

    def at(self, seconds: int) -> datetime:
        return self.base + timedelta(seconds=seconds)

    def tick(self, seconds: int) -> None:
        """The database clock moves forward (never back)."""
        self.model.clock += seconds
        self.repo.now = self.at(self.model.clock)

    # ------------------------------------------------------------------ the user

    @initialize(key=st.sampled_from([None, "k"]))
    def first_tasks(self, key: str | None) -> None:
        """One task of each type to start with (more come through ``submit``)."""
        for task_type in sorted(TYPES):
            self.submit(task_type, key)

    @precondition(lambda self: len(self.model.tasks) < MAX_TASKS)
    @rule(task_type=st.sampled_from(sorted(TYPES)), key=st.sampled_from([None, "k"]))
    def submit(self, task_type: str, key: str | None) -> None:
        holder = next(
            (
                t
                for t in self.model.tasks
                if key is not None
                and t.task_type == task_type
                and t.dedupe_key == key
                and t.status in ("pending", "running")
            ),
            None,
        )

        async def insert_one() -> Any:
            async with self.engine.begin() as conn:
                return await self.repo.insert(
                    conn,
                    NewTask(task_type, 1, {"seconds": 0}, 60.0, dedupe_key=key, owner=OWNER),
                )

        got = self.run(insert_one())
        if holder is not None:
            expect(got.duplicate_of == holder.id, f"dedupe: expected holder {holder.id}, got {got}")
        else:
            expect(got.duplicate_of is None, f"dedupe: no active holder, yet refused: {got}")
            self.model.tasks.append(ModelTask(got.id, task_type, key))

    @precondition(lambda self: bool(self.model.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        # The user cancels now and then: cancelling as often as everything else would end most
        # tasks before their attempts could race.
        if data.draw(st.integers(0, 3)) != 0:
            return
        task = data.draw(st.sampled_from(self.model.tasks))
        answer = self.run(self.repo.request_cancel(task.id, self.registry))
        if task.status == "pending":
            expect(answer == "cancelled", f"cancel of a pending task answered {answer}")
            task.status, task.cancel = "cancelled", True
            _hook_run(task, "cancelled")
        elif task.status == "running":
            expect(answer == "requested", f"cancel of a running task answered {answer}")
            task.cancel = True
        else:
            expect(answer == "terminal", f"cancel of a terminal task answered {answer}")

    # ------------------------------------------------------------------ the clock and the reconciler

    @precondition(lambda self: self.model.running() > 0)
    @rule(seconds=st.sampled_from([1, LEASE // 2, LEASE + 1, LEASE + 1]))
    def clock_moves(self, seconds: int) -> None:
        self.tick(seconds)

    @precondition(lambda self: self.model.running() > 0)
    @rule()
    def owners_stall(self) -> None:
        """Every owner stops renewing (paused, partitioned): the clock passes their leases, and
        the reconciler's next run converges them."""
        self.tick(LEASE + 1)
        self.reconcile()

    @precondition(lambda self: bool(self.model.tasks))
    @rule()
    def reconcile(self) -> None:
        report = self.run(self.repo.reconcile(self.registry, batch=20, retry_delay=lambda n: 0))
        retried = failed = cancelled = 0
        for task in self.model.tasks:
            if task.status == "running" and task.lease is not None and task.lease <= self.model.clock:
                task.token, task.lease = None, None
                if task.max_attempts and task.attempts < task.max_attempts and not task.cancel:
                    task.status = "pending"
                    retried += 1
                else:
                    task.status = "cancelled" if task.cancel else "failed"
                    _hook_run(task, task.status)
                    failed += 1
            elif task.status == "pending" and task.cancel:
                task.status = "cancelled"
                _hook_run(task, "cancelled")
                cancelled += 1
        got = (report.retried, report.failed, report.cancelled, report.errors)
        expect(got == (retried, failed, cancelled, []), f"reconcile: {got} != {(retried, failed, cancelled)}")

    # ------------------------------------------------------------------ workers

    def _claimable(self, task: ModelTask) -> bool:
        return task.status == "pending" and not task.cancel

    def _took(self, worker: Worker, task: ModelTask, claim: Claim) -> None:
        task.status, task.token, task.lease = "running", claim.token, self.model.clock + LEASE
        task.attempts += 1
        expect(claim.attempt == task.attempts, f"attempt {claim.attempt} != {task.attempts}")
        worker.task, worker.token, worker.attempt = task, claim.token, claim.attempt

    def idle(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.task is None]

    def holders(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.task is not None]

    def message_for(self, data: st.DataObject) -> ModelTask:
        """The task a message names: mostly one still pending, else any (a late or duplicate one)."""
        pending = [t for t in self.model.tasks if t.status == "pending"]
        if pending and data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(pending))
        return data.draw(st.sampled_from(self.model.tasks))

    @precondition(lambda self: bool(self.model.tasks) and bool(self.idle()))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        """A message (fresh, duplicate or late) reaches an idle worker, which claims the task. (A
        worker that holds an attempt, even one it lost without noticing, is busy running it.)"""
        w = data.draw(st.sampled_from(self.idle()))
        task = self.message_for(data)
        got = self.run(self.repo.claim(task.id, self.registry, capacity=CAPACITY, lease_seconds=LEASE))
        if self._claimable(task) and self.model.running() < CAPACITY:
            expect(isinstance(got, Claim), f"claim of a claimable task refused: {got}")
            self._took(self.workers[w], task, got)
        elif task.status != "pending":
            expect(got == f"not_pending:{task.status}", f"claim of a {task.status} task: {got}")
        elif task.cancel:
            expect(got == "cancel_requested", f"claim under cancel intent: {got}")
        else:
            expect(got == "capacity_full", f"claim with no slot free: {got}")

    async def _claim_all(self, targets: list[ModelTask]) -> list[Any]:
        """One claim per target, all at once, each in its own session."""
        return list(
            await asyncio.gather(
                *(
                    self.repo.claim(t.id, self.registry, capacity=CAPACITY, lease_seconds=LEASE)
                    for t in targets
                )
            )
        )

    @precondition(lambda self: bool(self.model.tasks) and bool(self.idle()))
    @rule(data=st.data())
    def duplicate_deliveries_race(self, data: st.DataObject) -> None:
        """One task's message reaches every worker at once (duplicates, redeliveries): exactly one
        claim wins when the task is claimable and a slot is free, none otherwise."""
        task = self.message_for(data)
        free = CAPACITY - self.model.running()
        results = self.run(self._claim_all([task] * WORKERS))
        won = [r for r in results if isinstance(r, Claim)]
        expect(len(won) == (1 if self._claimable(task) and free > 0 else 0), f"duplicate claims: {results}")
        if won:
            # Which session won is PostgreSQL's choice; the model gives the attempt to the first
            # idle worker, so that the history stays the same when Hypothesis replays it.
            self._took(self.workers[self.idle()[0]], task, won[0])

    @precondition(lambda self: len(self.model.tasks) >= 2 and len(self.idle()) >= 2)
    @rule(data=st.data())
    def parallel_claims(self, data: st.DataObject) -> None:
        """Different tasks claimed at once by idle workers (fresh and late messages mixed), no
        more claimable ones than free slots: every claimable one wins, no other does."""
        free = CAPACITY - self.model.running()
        idle = self.idle()
        targets = data.draw(
            st.lists(
                st.sampled_from(self.model.tasks), min_size=2, max_size=len(idle), unique_by=lambda t: t.id
            )
        )
        claimable = [t for t in targets if self._claimable(t)]
        if len(claimable) > free:
            targets = [t for t in targets if not self._claimable(t)] + claimable[:free]
        results = self.run(self._claim_all(targets))
        for w, task, got in zip(idle, targets, results, strict=False):
            expect(isinstance(got, Claim) == self._claimable(task), f"parallel claims {results}")
            if isinstance(got, Claim):
                self._took(self.workers[w], task, got)

    def _holding(self, w: int) -> bool:
        return self.workers[w].task is not None

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.holders()))
        worker = self.workers[w]
        if worker.task is None or worker.token is None:
            return
        task = worker.task
        beat = self.run(self.repo.heartbeat(task.id, worker.token, LEASE))
        owned = self.model.owned(task, worker.token)
        expect(beat.owned == owned, f"heartbeat owned={beat.owned}, model {owned}")
        if owned:
            task.lease = self.model.clock + LEASE
            expect(beat.cancel_requested == task.cancel, "heartbeat's cancel flag")

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data(), progress=st.sampled_from([10.0, 50.0, 90.0]))
    def report(self, data: st.DataObject, progress: float) -> None:
        w = data.draw(st.sampled_from(self.holders()))
        worker = self.workers[w]
        if worker.task is None or worker.token is None:
            return
        task = worker.task
        wrote = self.run(self.repo.report(task.id, worker.token, progress, None))
        owned = self.model.owned(task, worker.token)
        expect(wrote == owned, f"report wrote={wrote}, model owned={owned}")
        if owned:
            task.progress = progress

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data(), lapse=st.booleans())
    def owning_write(self, data: st.DataObject, lapse: bool) -> None:
        """The handler's domain write; with ``lapse`` the clock passes the lease while it runs."""
        w = data.draw(st.sampled_from(self.holders()))
        worker = self.workers[w]
        if worker.task is None or worker.token is None:
            return
        task, token = worker.task, worker.token
        owned = self.model.owned(task, token)
        lease = task.lease

        async def write() -> str:
            try:
                async with self.repo.owning_transaction(task.id, token) as (conn, _row):
                    await _domain_write(conn, task.id, token)
                    if lapse and lease is not None:
                        self.tick(lease - self.model.clock)  # the database clock reaches the lease
                return "committed"
            except OwnershipLost:
                return "lost"

        got = self.run(write())
        if not owned:
            expect(got == "lost", "a non-owner's owning transaction committed")
        elif lapse:
            expect(got == "lost", "an owning transaction committed after its lease lapsed")
        else:
            expect(got == "committed", "the live owner's owning transaction was refused")
            task.run, task.effects = "running", task.effects + 1

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data(), outcome=st.sampled_from(["success", "failed", "cancelled"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        w = data.draw(st.sampled_from(self.holders()))
        worker = self.workers[w]
        if worker.task is None or worker.token is None:
            return
        task, token = worker.task, worker.token
        error = None if outcome == "success" else {"code": outcome, "message": outcome}

        async def end() -> str:
            try:
                final = await self.repo.finish(
                    task.id, token, self.registry, status=Status(outcome), result={"ok": 1}, error=error
                )
            except OwnershipLost:
                return "lost"
            return final.value

        got = self.run(end())
        if not self.model.owned(task, token):
            expect(got == "lost", f"a non-owner's terminal write committed: {got}")
            return
        final = "cancelled" if outcome == "success" and task.cancel else outcome
        expect(got == final, f"terminal write ended {got}, model {final}")
        task.status, task.token, task.lease = final, None, None
        if final == "success":
            task.progress = 100.0
        _hook_run(task, final)
        self.workers[w] = Worker()  # the attempt is over: the worker takes the next message

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data())
    def hand_back(self, data: st.DataObject) -> None:
        """Warm shutdown of a retry-safe handler with attempts left (runtime._shutdown_outcome)."""
        w = data.draw(st.sampled_from(self.holders()))
        worker = self.workers[w]
        task = worker.task
        if task is None or worker.token is None or not task.max_attempts:
            return
        if worker.attempt >= task.max_attempts:
            return
        released = self.run(self.repo.release(task.id, worker.token, outcome="worker_shutdown", delay=0))
        owned = self.model.owned(task, worker.token)
        expect(released == owned, f"hand-back released={released}, model owned={owned}")
        if owned:
            # Under cancel intent too: the row waits, pending, for the reconciler (docs/protocol).
            task.status, task.token, task.lease = "pending", None, None
            self.workers[w] = Worker()

    def stale(self) -> list[int]:
        return [
            i
            for i, w in enumerate(self.workers)
            if w.task is not None and not self.model.owned(w.task, w.token)
        ]

    @precondition(lambda self: bool(self.stale()))
    @rule(data=st.data())
    def late_writes(self, data: st.DataObject) -> None:
        """A worker that lost its attempt without noticing (paused, partitioned) wakes up and tries
        every owner write in turn: each must be refused, and change nothing."""
        w = data.draw(st.sampled_from(self.stale()))
        worker = self.workers[w]
        assert worker.task is not None and worker.token is not None
        task, token = worker.task, worker.token

        async def attempt_all() -> list[Any]:
            refused: list[Any] = [
                not await self.repo.report(task.id, token, 99.0, None),
                not (await self.repo.heartbeat(task.id, token, LEASE)).owned,
            ]
            for write in (
                self.repo.owning_transaction(task.id, token),
                None,
            ):
                try:
                    if write is None:
                        await self.repo.finish(
                            task.id, token, self.registry, status=Status.SUCCESS, result={}
                        )
                    else:
                        async with write as (conn, _row):
                            await _domain_write(conn, task.id, token)
                    refused.append(False)
                except OwnershipLost:
                    refused.append(True)
            refused.append(not await self.repo.release(task.id, token, outcome="worker_shutdown", delay=0))
            return refused

        refused = self.run(attempt_all())
        names = ("report", "heartbeat", "owning transaction", "terminal write", "hand-back")
        committed = [n for n, r in zip(names, refused, strict=True) if not r]
        expect(not committed, f"late writes committed: {committed}")

    @precondition(lambda self: bool(self.holders()))
    @rule(data=st.data())
    def worker_forgets(self, data: st.DataObject) -> None:
        """The worker process dies or moves on: its attempt is abandoned, writes nothing more."""
        w = data.draw(st.sampled_from(self.holders()))
        self.workers[w] = Worker()

    @precondition(lambda self: any(w.token is not None for w in self.workers))
    @rule(data=st.data())
    def worker_dies_and_is_expired(self, data: st.DataObject) -> None:
        """The worker process dies and its worker's main process ends its attempt's lease at once,
        by the token (TaskStore.expire_attempts): only a live attempt under that token is touched,
        and its lease now ends at the database's now, as if the clock had passed it."""
        w = data.draw(st.sampled_from([i for i, w in enumerate(self.workers) if w.token is not None]))
        worker = self.workers[w]
        assert worker.task is not None and worker.token is not None
        task = worker.task
        owned = self.model.owned(task, worker.token)
        expired = self.run(self.repo.expire_attempts([worker.token]))
        expect(expired == ([task.id] if owned else []), f"expiry ended {expired}, model owned={owned}")
        if owned:
            task.lease = self.model.clock
        self.workers[w] = Worker()

    # ------------------------------------------------------------------ after every step

    @invariant()
    def database_equals_model(self) -> None:
        self.run(self._compare())

    async def _compare(self) -> None:
        async with self.engine.connect() as conn:
            rows = {r["id"]: dict(r) for r in (await conn.execute(text("SELECT * FROM tasks"))).mappings()}
            attempts = [dict(r) for r in (await conn.execute(text("SELECT * FROM task_attempts"))).mappings()]
            held = text("SELECT task_id, token FROM task_slots WHERE task_id IS NOT NULL")
            slots = [tuple(r) for r in await conn.execute(held)]
            runs = {r["task_id"]: dict(r) for r in (await conn.execute(diagnostics_runs.select())).mappings()}
            effects = [dict(r) for r in (await conn.execute(diagnostics_effects.select())).mappings()]
        expect(set(rows) == {t.id for t in self.model.tasks}, "the set of tasks differs")
        for task in self.model.tasks:
            row = rows[task.id]
            lease = None if task.lease is None else self.at(task.lease)
            mine = (
                row["status"],
                row["attempt_token"],
                row["attempt_count"],
                row["lease_expires_at"],
                row["cancel_requested_at"] is not None,
                float(row["progress"] or 0),
                (runs.get(task.id) or {}).get("status"),
                sum(e["task_id"] == task.id for e in effects),
            )
            theirs = (
                task.status,
                task.token,
                task.attempts,
                lease,
                task.cancel,
                task.progress,
                task.run,
                task.effects,
            )
            expect(mine == theirs, f"task {task.task_type}: database {mine} != model {theirs}")
            # I1: one open attempt at most, and only the running row's current token.
            mine_open = [a for a in attempts if a["task_id"] == task.id and a["ended_at"] is None]
            expect(
                [a["token"] for a in mine_open] == ([task.token] if task.status == "running" else []),
                f"I1: open attempts {mine_open}",
            )
            expect(
                len([a for a in attempts if a["task_id"] == task.id]) == task.attempts,
                "every claim is recorded as an attempt",
            )
            # I2: every committed domain effect was written by one of the task's own attempts.
            tokens = {a["token"] for a in attempts if a["task_id"] == task.id}
            expect(
                all(e["attempt_token"] in tokens for e in effects if e["task_id"] == task.id),
                "I2: an effect by a stranger",
            )
        # I5: never more running than the capacity; the slots hold exactly the running tokens.
        running = {(t.id, t.token) for t in self.model.tasks if t.status == "running"}
        expect(len(running) <= CAPACITY, "I5: over capacity")
        expect(set(slots) == running and len(slots) == len(running), f"I5: slots {slots} != {running}")
        # I4: one active task per (owner, type, key).
        active = [
            (r["owner"], r["task_type"], r["dedupe_key"])
            for r in rows.values()
            if r["status"] in ("pending", "running") and r["dedupe_key"] is not None
        ]
        expect(len(active) == len(set(active)), f"I4: {active}")
        # I6: no domain row in progress under a terminal task.
        for task_id, run in runs.items():
            terminal = rows[task_id]["status"] in ("success", "failed", "cancelled")
            expect(not (terminal and run["status"] == "running"), "I6: a run row in progress after the end")


async def _domain_write(conn: AsyncConnection, task_id: uuid.UUID, token: uuid.UUID) -> None:
    """The diagnostics handler's write as owner: its run row in progress, one effect row."""
    stmt = insert(diagnostics_runs).values(task_id=task_id, attempt_token=token, status="running")
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[diagnostics_runs.c.task_id], set_={"attempt_token": token, "status": "running"}
        )
    )
    await conn.execute(diagnostics_effects.insert().values(task_id=task_id, attempt_token=token, step=1))


@contextmanager
def machine(database_url: str) -> Iterator[type[ProtocolMachine]]:
    """The state machine bound to the test database, with its loop and engine for the run."""
    loop = asyncio.Runner()
    engine = loop.run(_make_engine(database_url))
    try:
        yield type("Machine", (ProtocolMachine,), {"loop": loop, "engine": engine})
    finally:
        loop.run(engine.dispose())
        loop.close()


async def _make_engine(database_url: str) -> AsyncEngine:
    return make_engine(database_url, pool_size=WORKERS + 1, max_overflow=2)
