"""The real TaskRepository, on real PostgreSQL, held to the protocol model of docs/protocol.

A Hypothesis ``RuleBasedStateMachine`` plays several workers, a user and the reconciler against
one database: submits (with dedupe keys), claims (one at a time, and racing in real concurrent
sessions), heartbeats, fenced progress reports, owning transactions (whose lease may lapse
during the callback), terminal writes, retry-safe hand-backs, cancels and reconciles, while the
database clock (``TaskRepository.now``, which replaces ``clock_timestamp()`` in every
statement) only moves forward. A worker keeps its token after it lost the task, so it keeps
trying late writes. After every step the database must equal the model's state exactly, and
the invariants I1, I2, I4, I5, I6 of DESIGN.md must hold in what PostgreSQL holds (I7: no worker
clock exists here at all; only the database's decides).

Failures raise ``ModelMismatch`` (an AssertionError), so the mutant tests can tell a caught
mutant from a broken test.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from hooks_for_tests import registry_with_test_specs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from domains.diagnostics.model import diagnostics_effects, diagnostics_runs
from tasks_core.db import make_engine
from tasks_core.model import Status
from tasks_core.repository import Claim, NewTask, OwnershipLost, TaskRepository

LEASE = 10  # seconds of the database clock
CAPACITY = 2
WORKERS = 3
MAX_TASKS = 4
OWNER = "alice"
# (task_type, retry-safe max attempts or None)
TYPES = {"diagnostics.sleep": None, "test.retry_safe": 2}
TABLES = "tasks, task_attempts, task_slots, diagnostics_runs, diagnostics_effects"


class ModelMismatch(AssertionError):
    """The database disagrees with the model, or an invariant does not hold."""


# Every mismatch raised, in order: the mutant tests read it, since Hypothesis may report a
# failure it could not replay identically (claims_race is decided by PostgreSQL) as flaky.
MISMATCHES: list[str] = []


def expect(ok: bool, what: str) -> None:
    if not ok:
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
    database_url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.Runner()
        self.engine = self.loop.run(self._engine())
        self.registry = registry_with_test_specs()
        self.base: datetime = self.run(self._db_now())
        self.repo = TaskRepository(self.engine, now=self.base)
        self.model = Model()
        self.workers = [Worker() for _ in range(WORKERS)]

    async def _engine(self) -> Any:
        engine = make_engine(self.database_url, pool_size=WORKERS + 1, max_overflow=2)
        async with engine.begin() as conn:
            await conn.execute(text(f"TRUNCATE {TABLES} CASCADE"))
        return engine

    async def _db_now(self) -> datetime:
        async with self.engine.connect() as conn:
            return (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()  # type: ignore[no-any-return]

    def run(self, coro: Any) -> Any:
        return self.loop.run(coro)

    def teardown(self) -> None:
        self.loop.run(self.engine.dispose())
        self.loop.close()

    def at(self, seconds: int) -> datetime:
        return self.base + timedelta(seconds=seconds)

    def tick(self, seconds: int) -> None:
        """The database clock moves forward (never back)."""
        self.model.clock += seconds
        self.repo.now = self.at(self.model.clock)

    # ------------------------------------------------------------------ the user

    @initialize(types=st.lists(st.sampled_from(sorted(TYPES)), min_size=1, max_size=2))
    def first_tasks(self, types: list[str]) -> None:
        for task_type in types:
            self.submit(task_type, None)

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
    @rule(seconds=st.sampled_from([1, LEASE // 2, LEASE + 1]))
    def clock_moves(self, seconds: int) -> None:
        self.tick(seconds)

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

    @precondition(lambda self: bool(self.model.tasks))
    @rule(w=st.integers(0, WORKERS - 1), data=st.data())
    def claim(self, w: int, data: st.DataObject) -> None:
        """A message (fresh, duplicate or late) reaches worker w, which claims the task."""
        task = data.draw(st.sampled_from(self.model.tasks))
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

    @precondition(lambda self: bool(self.model.tasks))
    @rule(data=st.data())
    def claims_race(self, data: st.DataObject) -> None:
        """Every worker claims at once, in its own session: at most one winner per task, never more
        running than the capacity; which claimer wins is PostgreSQL's choice, and the model adopts it."""
        targets = [data.draw(st.sampled_from(self.model.tasks)) for _ in self.workers]

        async def race() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        self.repo.claim(t.id, self.registry, capacity=CAPACITY, lease_seconds=LEASE)
                        for t in targets
                    )
                )
            )

        free = CAPACITY - self.model.running()
        results = self.run(race())
        winners = [(w, t, r) for w, (t, r) in enumerate(zip(targets, results, strict=True)) if isinstance(r, Claim)]
        expect(len({t.id for _, t, _ in winners}) == len(winners), f"two claims of one task won: {results}")
        expect(len(winners) <= free, f"{len(winners)} claims won with {free} slots free")
        for _w, t, _r in winners:
            expect(self._claimable(t), f"a claim of an unclaimable ({t.status}) task won")
        claimable = {t.id for t in targets if self._claimable(t)}
        # Claimers skip slots locked by one another: a loser may see no free slot although the
        # winner of the same task ends up needing only one. At least one claim must win.
        expect(not claimable or not free or winners, f"no claim won: {results}")
        for w, t, r in winners:
            self._took(self.workers[w], t, r)

    def _holding(self, w: int) -> bool:
        return self.workers[w].task is not None

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1))
    def heartbeat(self, w: int) -> None:
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

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1), progress=st.sampled_from([10.0, 50.0, 90.0]))
    def report(self, w: int, progress: float) -> None:
        worker = self.workers[w]
        if worker.task is None or worker.token is None:
            return
        task = worker.task
        wrote = self.run(self.repo.report(task.id, worker.token, progress, None))
        owned = self.model.owned(task, worker.token)
        expect(wrote == owned, f"report wrote={wrote}, model owned={owned}")
        if owned:
            task.progress = progress

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1), lapse=st.booleans())
    def owning_write(self, w: int, lapse: bool) -> None:
        """The handler's domain write; with ``lapse`` the clock passes the lease while it runs."""
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

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1), outcome=st.sampled_from(["success", "failed", "cancelled"]))
    def finish(self, w: int, outcome: str) -> None:
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

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1))
    def hand_back(self, w: int) -> None:
        """Warm shutdown of a retry-safe handler with attempts left (runtime._shutdown_outcome)."""
        worker = self.workers[w]
        task = worker.task
        if task is None or worker.token is None or not task.max_attempts or worker.attempt >= task.max_attempts:
            return
        released = self.run(self.repo.release(task.id, worker.token, outcome="worker_shutdown", delay=0))
        owned = self.model.owned(task, worker.token)
        expect(released == owned, f"hand-back released={released}, model owned={owned}")
        if owned:
            # Under cancel intent too: the row waits, pending, for the reconciler (docs/protocol).
            task.status, task.token, task.lease = "pending", None, None

    @precondition(lambda self: any(w.task is not None for w in self.workers))
    @rule(w=st.integers(0, WORKERS - 1))
    def worker_forgets(self, w: int) -> None:
        """The worker process dies or moves on: its attempt is abandoned, writes nothing more."""
        self.workers[w] = Worker()

    # ------------------------------------------------------------------ after every step

    @invariant()
    def database_equals_model(self) -> None:
        if not hasattr(self, "repo"):
            return
        self.run(self._compare())

    async def _compare(self) -> None:
        async with self.engine.connect() as conn:
            rows = {r["id"]: dict(r) for r in (await conn.execute(text("SELECT * FROM tasks"))).mappings()}
            attempts = [dict(r) for r in (await conn.execute(text("SELECT * FROM task_attempts"))).mappings()]
            slots = [
                tuple(r)
                for r in (await conn.execute(text("SELECT task_id, token FROM task_slots WHERE task_id IS NOT NULL")))
            ]
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
