"""The seeded fault schedule, the real processes the faults are done to, and the fault actions.

``build_schedule(seed, ...)`` is a pure function of its arguments: the same seed gives the same
fault kinds, instants, durations and choices, and the same task mix (``build_workload``). Which
worker a fault hits is decided when it fires (the owner of a running task, if any), by the
schedule's pre-drawn ``pick``, so a replay hits the same rank among the candidates of that moment.

Processes are started exactly as an operator would (``celery -A tasks_core.celery_app worker`` and
``... beat``), each in its own session and process group, so SIGKILL/SIGSTOP/SIGCONT reach a
worker's main process and all its pool children at once. ``FaultActions`` does what each event
of the schedule says (kill, pause, outage, duplicate, terminate, cancel) and waits for its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import random
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from tasks_core.devkit import outage
from tasks_core.devkit.chaos.checker import PostgresOutage, RunningLease
from tasks_core.devkit.cluster import ROOT as ROOT
from tasks_core.devkit.cluster import Cluster, ClusterProcess, process_env
from tasks_core.duties.readiness import READINESS_KEY

if TYPE_CHECKING:
    from tasks_core.devkit.chaos.campaign import Campaign

KILL = "kill_worker"
PAUSE = "pause_worker"
# SIGSTOP of a worker caught inside a write transaction (holding row locks), for longer than
# the recovery bound: a stalled claimer must not stall the cluster.
PAUSE_CLAIMER = "pause_claimer"
DUPLICATE = "duplicate_publish"
REDIS = "redis_restart"
PG_TERMINATE = "pg_terminate"
CANCEL = "cancel"
KINDS = (KILL, PAUSE, PAUSE_CLAIMER, DUPLICATE, REDIS, PG_TERMINATE, CANCEL)
# Only with --own-postgres (a server the campaign started itself): the postmaster and every backend
# SIGSTOPped for longer than the lease, and an immediate shutdown with the server back on the same
# port within 1-3 s.
PG_PAUSE = "pg_pause"
PG_RESTART = "pg_restart"
PG_KINDS = (PG_PAUSE, PG_RESTART)
ALL_KINDS = KINDS + PG_KINDS
# With RabbitMQ as the broker (--broker rabbitmq) the broker fault takes the Redis restart's place in
# the schedule (same draws): the campaign's own vhost refuses its user and loses every connection for
# the fault's duration, then is granted again. The machine's RabbitMQ server is never restarted.
RABBITMQ = "rabbitmq_outage"


def on_broker(kind: str, rabbitmq: bool) -> str:
    """The fault kind a scheduled broker fault is called on this broker."""
    return RABBITMQ if rabbitmq and kind == REDIS else kind
# Relative frequency of each fault after the guaranteed ones.
WEIGHTS = {KILL: 3, PAUSE: 3, DUPLICATE: 2, REDIS: 1, PG_TERMINATE: 2, CANCEL: 1}
# Every campaign does each fault at least this often (pauses twice: fencing must be exercised).
MINIMUM = {KILL: 1, PAUSE: 2, PAUSE_CLAIMER: 1, DUPLICATE: 1, REDIS: 1, PG_TERMINATE: 1, CANCEL: 1}
GAP_SECONDS = (2.0, 5.0)
# PostgreSQL faults: at least these, one more per PG_EXTRA_EVERY seconds of faults, drawn by weight.
PG_MINIMUM = {PG_PAUSE: 1, PG_RESTART: 2}
PG_WEIGHTS = {PG_PAUSE: 1, PG_RESTART: 2}
PG_EXTRA_EVERY = 60.0
PG_RESTART_DOWN = (1.0, 3.0)
# After a PostgreSQL fault the next fault waits this long past the outage's planned end.
PG_SETTLE_SECONDS = 2.0

FAKETIME_LIBS = (
    "/usr/lib/*/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)


@dataclass(frozen=True)
class FaultEvent:
    at: float  # seconds after the fault phase began
    kind: str
    duration: float  # pause length, Redis downtime, or delay before a killed worker restarts
    pick: float  # [0, 1): which candidate (victim, ids) among those available when it fires
    amount: float  # [0, 1): how much (share of backends, number of ids)


def claimer_pause_seconds(lease_seconds: float, reconcile_seconds: float, margin_seconds: float) -> float:
    """Longer than I3's recovery bound (heartbeat + reconcile + margin after a lease's end) plus
    the lease itself, so a cluster that waits for the paused claimer is caught."""
    return round(lease_seconds * 4 / 3 + reconcile_seconds + margin_seconds + 3.0, 3)


def build_schedule(
    seed: int, fault_seconds: float, lease_seconds: float, *, exclude: tuple[str, ...] = (),
    claimer_pause: float | None = None, own_postgres: bool = False,
) -> list[FaultEvent]:
    """The campaign's faults; ``exclude`` drops kinds (the rest of the schedule keeps its draws).

    ``own_postgres`` adds the PostgreSQL faults from a stream of their own, so the other faults keep
    every draw they have without the flag (only their instants move, past each PostgreSQL outage)."""
    events = _base_schedule(seed, fault_seconds, lease_seconds, claimer_pause)
    if own_postgres:
        events = _with_postgres_faults(seed, events, fault_seconds, lease_seconds)
    return [e for e in events if e.kind not in exclude]


def _base_schedule(
    seed: int, fault_seconds: float, lease_seconds: float, claimer_pause: float | None
) -> list[FaultEvent]:
    rng = random.Random(f"dtask-chaos:{seed}:faults")
    claimer_pause = claimer_pause or claimer_pause_seconds(lease_seconds, 1.0, 5.0)
    # The last fault fires early enough that a pause (lease + up to 3 s) ends within the phase.
    last = max(1.0, fault_seconds - _tail(lease_seconds))
    times: list[float] = []
    t = rng.uniform(*GAP_SECONDS)
    while t <= last:
        times.append(t)
        t += rng.uniform(*GAP_SECONDS)
    required = [kind for kind, n in MINIMUM.items() for _ in range(n)]
    if len(times) < len(required):  # a short phase: squeeze the guaranteed faults in
        step = last / (len(required) + 1)
        times = [step * (i + 1) for i in range(len(required))]
    extra = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=len(times) - len(required))
    kinds = required + extra
    rng.shuffle(kinds)
    events = []
    for at, kind in zip(times, kinds, strict=True):
        if kind == PAUSE:
            duration = lease_seconds + rng.uniform(1.0, 3.0)  # longer than the lease: it must lapse
        elif kind == REDIS:
            duration = rng.uniform(1.0, 4.0)
        elif kind == KILL:
            duration = rng.uniform(0.0, 2.0)
        elif kind == PAUSE_CLAIMER:
            duration = claimer_pause
        else:
            duration = 0.0
        events.append(FaultEvent(round(at, 3), kind, round(duration, 3), rng.random(), rng.random()))
    return events


def _with_postgres_faults(
    seed: int, events: list[FaultEvent], fault_seconds: float, lease_seconds: float
) -> list[FaultEvent]:
    """Insert the PostgreSQL faults between the others: each midway between two of them, or once an
    earlier worker pause (or a killed worker's restart delay) is over, and move every later fault
    back by as much as it needs. No fault is fired while the database is down (the campaign needs
    it to aim a fault and to stamp it with its clock), and no paused owner sleeps through a database
    outage: it would wake up with dead connections and give up without ever trying the late write
    that fencing must refuse. (A claimer pause or a Redis outage may still span one.)"""
    rng = random.Random(f"dtask-chaos:{seed}:postgres")
    kinds = [kind for kind, n in PG_MINIMUM.items() for _ in range(n)]
    extra = int(fault_seconds // PG_EXTRA_EVERY)
    kinds += rng.choices(list(PG_WEIGHTS), weights=list(PG_WEIGHTS.values()), k=extra)
    rng.shuffle(kinds)
    # Insert before events[i] (i >= 1: the first fault is never a database one), at most one per gap.
    before = sorted(rng.sample(range(1, len(events)), k=min(len(kinds), len(events) - 1)))
    planned = dict(zip(before, kinds, strict=False))
    out: list[FaultEvent] = []
    shift = busy_until = 0.0
    for i, event in enumerate(events):
        kind = planned.get(i)
        if kind is not None:
            midway = (events[i - 1].at + event.at) / 2 + shift
            at = max(midway, busy_until + PG_SETTLE_SECONDS)
            if kind == PG_PAUSE:
                duration = lease_seconds + rng.uniform(1.0, 3.0)  # longer than the lease: it must lapse
            else:
                duration = rng.uniform(*PG_RESTART_DOWN)
            out.append(FaultEvent(round(at, 3), kind, round(duration, 3), rng.random(), rng.random()))
            shift += at - midway + duration + PG_SETTLE_SECONDS
        moved = dataclasses.replace(event, at=round(event.at + shift, 3))
        out.append(moved)
        if moved.kind in (PAUSE, KILL):
            busy_until = max(busy_until, moved.at + moved.duration)
    return out


def phase_seconds(schedule: list[FaultEvent], fault_seconds: float, lease_seconds: float) -> float:
    """How long the fault phase lasts: ``fault_seconds``, or longer when PostgreSQL's outages moved
    the last fault back (the last one always leaves a lease + 3 s for its effects to play out)."""
    return max(fault_seconds, max((e.at for e in schedule), default=0.0) + _tail(lease_seconds))


def _tail(lease_seconds: float) -> float:
    return lease_seconds + 3.0


@dataclass(frozen=True)
class TaskPlan:
    task_type: str
    payload: dict[str, Any]
    dedupe_key: str | None = None
    # Run later / run first (the campaign's workload leaves them unset: delayed tasks wait for the
    # publisher, which the stall check's bound does not allow for yet).
    delay_seconds: float | None = None
    priority: int = 0


def build_workload(seed: int, n: int) -> list[TaskPlan]:
    """The mixed diagnostics tasks of a campaign, a pure function of the seed."""
    rng = random.Random(f"dtask-chaos:{seed}:tasks")
    plans = []
    for i in range(n):
        roll = rng.random()
        sleep = {"seconds": round(rng.uniform(0.5, 4.0), 2), "steps": rng.randint(2, 8), "effects": True}
        if roll < 0.35:
            plans.append(TaskPlan("diagnostics.sleep", sleep))
        elif roll < 0.55:
            plans.append(TaskPlan("diagnostics.sleep_retry_safe", sleep))
        elif roll < 0.72:
            plans.append(TaskPlan("diagnostics.noop", {"i": i}))
        elif roll < 0.82:
            plans.append(TaskPlan("diagnostics.fail", {"message": f"chaos task {i} fails on purpose"}))
        else:  # a few keys, reused all campaign long: actives collide, finished ones free their key
            task_type = rng.choice(("diagnostics.sleep", "diagnostics.sleep_retry_safe"))
            plans.append(TaskPlan(task_type, sleep, dedupe_key=f"chaos-key-{rng.randrange(4)}"))
    return plans


def faketime_library() -> str | None:
    """libfaketime (Debian package `faketime`/`libfaketime`), if installed."""
    for pattern in FAKETIME_LIBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


@dataclass
class Managed(ClusterProcess):
    """One real process: a worker (its main process and pool children share a process group) or beat."""

    started: float = 0.0
    skewed: bool = False
    dense: bool = False  # the dense mode (--pool threads): every task on one event loop
    paused: bool = False
    ready: bool = False
    killed: bool = False  # by the campaign (an exit we caused)
    notes: list[str] = field(default_factory=list)

    def kill(self) -> None:
        self.killed = True
        self.kill_group()


class Processes:
    """Starts workers and beat against the campaign's database and Redis; kills them all at the end."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base_env = env
        self.cluster = Cluster(workdir, Managed, logs=self.logs)
        self.all = self.cluster.procs
        self._generation: dict[int, int] = {}

    def env(self, **extra: str) -> dict[str, str]:
        # Nothing from the caller's DTASK_* settings leaks in: the campaign decides every one.
        return process_env({**self.base_env, **extra}, strip=("DTASK_", "FAKETIME", "LD_PRELOAD"))

    def start_worker(
        self, slot: int, *, concurrency: int, skew: tuple[str, float] | None = None, pool: str = "prefork"
    ) -> Managed:
        gen = self._generation[slot] = self._generation.get(slot, 0) + 1
        name = f"w{slot}.{gen}"
        node = f"chaos-{name}@{os.uname().nodename}"
        extra: dict[str, str] = {}
        if skew is not None:
            lib, seconds = skew
            # Every clock of the process is shifted (wall and monotonic: with the monotonic one left
            # alone, libfaketime's sleep wrappers fail with EINVAL); rates stay true, so timers and the
            # heartbeat cadence are unchanged while every timestamp the worker could make is off.
            extra = {"LD_PRELOAD": lib, "FAKETIME": f"{int(seconds):+d}"}
        return self.cluster.start_worker(
            name, self.env(**extra), node=node, concurrency=concurrency, pool=pool, started=time.monotonic(),
            skewed=skew is not None, dense=pool == "threads",
        )

    def start_beat(self) -> Managed:
        return self.cluster.start_beat("beat", self.env(), started=time.monotonic())

    def stop_all(self) -> None:
        """SIGCONT (a stopped group cannot die cleanly otherwise) and SIGKILL every group we started."""
        self.cluster.stop_all()

    def tail(self, proc: Managed, lines: int = 40) -> str:
        return proc.log_tail(lines)


class FaultActions:
    """What each fault of the schedule does to the campaign's cluster, and how its end is awaited.

    The campaign keeps the orchestration (the schedule's clock, start-up, the monitor, convergence,
    the verdict); it hands each event to ``fire`` and lends these actions its processes, services,
    clocks and fault log."""

    def __init__(self, campaign: Campaign) -> None:
        self.c = campaign
        self.owner_pauses: set[str] = set()  # workers a pause_worker fault holds stopped
        self.broker_down = False

    async def _owner_nodes(self) -> dict[str, int]:
        """Worker node -> number of running tasks it owns with a live lease."""
        async with self.c.services.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        """SELECT a.worker FROM tasks t JOIN task_attempts a ON a.token = t.attempt_token
                        WHERE t.status = 'running' AND t.lease_expires_at > clock_timestamp()"""
                    )
                )
            ).scalars().all()
        owned: dict[str, int] = {}
        for worker in rows:
            node = str(worker).rsplit(":", 1)[0]
            owned[node] = owned.get(node, 0) + 1
        return owned

    async def _pick_worker(self, pick: float) -> tuple[Managed, int] | None:
        """A healthy worker, preferably one that owns running tasks; never the last healthy one."""
        healthy = [p for p in self.c.slots if p.alive() and p.ready and not p.paused]
        if len(healthy) < 2:
            return None
        owned = await self._owner_nodes()
        candidates = [p for p in healthy if owned.get(p.node or "", 0)] or healthy
        victim = candidates[min(len(candidates) - 1, int(pick * len(candidates)))]
        return victim, owned.get(victim.node or "", 0)

    async def fire(self, ev: FaultEvent) -> None:
        if ev.kind in (KILL, PAUSE):
            chosen = await self._pick_worker(ev.pick)
            if chosen is None:
                await self.c.fault(ev.kind, "-", "skipped: fewer than two healthy workers")
                return
            victim, owned = chosen
            slot = self.c.slots.index(victim)
            if ev.kind == KILL:
                await asyncio.to_thread(victim.kill)
                at = await self.c.fault(ev.kind, victim.name, f"SIGKILL group {victim.pid} owning {owned} "
                                        f"running tasks; restart in {ev.duration:.1f} s")
                self.c.spawn_bg(self.restart(slot, ev.duration))
            else:
                victim.paused = True
                victim.signal_group(signal.SIGSTOP)
                self.owner_pauses.add(victim.name)
                detail = (f"SIGSTOP group {victim.pid} owning {owned} running tasks for {ev.duration:.1f} s "
                          f"(lease {self.c.cfg.lease_seconds:g} s)")
                at = await self.c.fault(ev.kind, victim.name, detail)
                self.c.spawn_bg(self._resume(victim, ev.duration))
            self._worker_hit(at, victim)
        elif ev.kind == PAUSE_CLAIMER:
            await self._pause_claimer(ev)
        elif ev.kind == DUPLICATE:
            await self._duplicate(ev)
        elif ev.kind in (REDIS, RABBITMQ):
            if self.broker_down:
                await self.c.fault(ev.kind, "broker", "skipped: the broker is still down or recovering")
                return
            self.broker_down = True
            outage = self._redis_restart if ev.kind == REDIS else self._rabbitmq_outage
            self.c.spawn_bg(outage(ev.duration))
        elif ev.kind == PG_TERMINATE:
            await self._pg_terminate(ev)
        elif ev.kind == CANCEL:
            await self._cancel(ev)
        elif ev.kind in PG_KINDS:
            await self._postgres_fault(ev)

    def _worker_hit(self, at: datetime | None, victim: Managed) -> None:
        """Remember which worker a kill or pause hit, when: its tasks owe no restart its survival."""
        if at is not None and victim.node:
            self.c.worker_faults.append((at, victim.node))

    async def _pause_claimer(self, ev: FaultEvent) -> None:
        """SIGSTOP a worker caught inside a transaction that holds row locks (a claim on the locked
        path, an owning transaction, a terminal write with its hook), with the locks still held.

        Claims take capacity slots without a cluster-wide lock, so a stalled holder must cost the
        others nothing but that one task: PostgreSQL ends its session after a lease idle in the
        transaction. The campaign polls pg_stat_activity for a worker backend holding a transaction
        id, stops its group, and checks that the transaction is still open; if not it resumes the
        worker at once and tries again."""
        sql = text(
            """SELECT application_name FROM pg_stat_activity
            WHERE datname = current_database() AND application_name LIKE 'dtask-worker:%'
              AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()"""
        )
        deadline = time.monotonic() + 10.0
        tries = 0
        while time.monotonic() < deadline:
            async with self.c.services.engine.connect() as conn:
                holders = (await conn.execute(sql)).scalars().all()
                healthy = [p for p in self.c.slots if p.alive() and p.ready and not p.paused]
                victim = next((p for name in holders for p in healthy
                               if p.owns_pid(int(str(name).rsplit(":", 1)[1]))), None)
                if victim is None or len(healthy) < 2:
                    await asyncio.sleep(0.005)
                    continue
                tries += 1
                victim.paused = True
                victim.signal_group(signal.SIGSTOP)
                still = (await conn.execute(sql)).scalars().all()
                caught = [n for n in still if victim.owns_pid(int(str(n).rsplit(":", 1)[1]))]
                if not caught:
                    victim.signal_group(signal.SIGCONT)
                    victim.paused = False
                    continue
            at = await self.c.fault(ev.kind, victim.name, f"SIGSTOP group {victim.pid} inside a transaction "
                                    f"holding row locks ({caught[0]}), for {ev.duration:.1f} s; try {tries}")
            self._worker_hit(at, victim)
            self.c.spawn_bg(self._resume(victim, ev.duration))
            return
        await self.c.fault(ev.kind, "-", f"skipped: no worker caught in a write transaction ({tries} tries)")

    async def _postgres_fault(self, ev: FaultEvent) -> None:
        """Pause or restart the campaign's own PostgreSQL, in the foreground of the fault loop (no
        other fault fires until recovery works again). The campaign's own users of the database
        wait on the lock while it is down."""
        if self.c.pg is None:
            await self.c.fault(ev.kind, "postgres", "skipped: the campaign does not own its PostgreSQL")
            return
        await self._until_workers_settled()
        self.c.pg_up.clear()  # before taking the lock: no new stamp queues up behind the outage
        try:
            async with self.c.db_lock:
                down_at, running = await self._running_leases()
                if ev.kind == PG_PAUSE:
                    up_at = await self._pause_postgres(ev, down_at, len(running))
                else:
                    up_at = await self._restart_postgres(ev, down_at, running)
                with contextlib.suppress(Exception):  # only a reconcile from now on counts
                    await self.c.redis.delete(READINESS_KEY)
        finally:
            self.c.pg_up.set()
        kind = "pause" if ev.kind == PG_PAUSE else "restart"
        outage = PostgresOutage(kind, down_at, up_at, tuple(running))
        if up_at is not None:
            outage = dataclasses.replace(outage, recovered_at=await self._await_recovery(up_at))
        self.c.postgres_outages.append(outage)

    async def _await_recovery(self, up_at: datetime) -> datetime | None:
        """When recovery works again after the database answered: a reconcile has run (the readiness
        fact, deleted when the database answered, is back). Until then workers may still be stuck in
        calls to the stopped server; as with Redis, I3's deadlines start from here."""
        if not await self.c.await_readiness_fact(self.c.cfg.startup_timeout):
            self.c.notes.append("no reconcile ran within the start-up timeout after a PostgreSQL outage")
            await self.c.fault("pg_recovered", "postgres", "NOT recovered: no reconcile ran")
            return None
        recovered = await self.c.pg_now()
        after = (recovered - up_at).total_seconds()
        detail = f"a reconcile ran {after:.2f} s after the database answered"
        await self.c.fault("pg_recovered", "postgres", detail, pg=recovered)
        return recovered

    async def _until_workers_settled(self) -> None:
        """The schedule keeps worker pauses and kills clear of database outages, but the fault loop
        may run late: wait (at most the start-up timeout) until no owner is paused (it would wake up
        with dead connections and give up without trying the late write fencing must refuse), no
        killed worker awaits its restart and none is still starting (its schema check would fail
        against a stopped database and it would exit). A paused claimer may go on sleeping."""

        def unsettled(p: Managed) -> bool:
            return (not p.alive() and p.killed) or (p.alive() and not p.ready) or p.name in self.owner_pauses

        for _ in range(int(self.c.cfg.startup_timeout / 0.1)):
            if not any(unsettled(p) for p in self.c.slots):
                return
            await asyncio.sleep(0.1)

    async def _running_leases(self) -> tuple[datetime, list[RunningLease]]:
        """PostgreSQL's clock and the running tasks with a live lease, just before a fault."""
        async with self.c.services.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        """SELECT clock_timestamp() AS now, id, attempt_token, lease_expires_at FROM tasks
                        WHERE status = 'running' AND lease_expires_at > clock_timestamp()"""
                    )
                )
            ).all()
        now = rows[0].now if rows else await self.c.clock()
        return now, [RunningLease(r.id, r.attempt_token, r.lease_expires_at) for r in rows]

    async def _pause_postgres(self, ev: FaultEvent, down_at: datetime, running: int) -> datetime | None:
        pid = await asyncio.to_thread(outage.pause_postgres, self.c.pg)
        lease = self.c.cfg.lease_seconds
        await self.c.fault(ev.kind, "postgres", f"SIGSTOP postmaster {pid} and every backend for "
                           f"{ev.duration:.1f} s (lease {lease:g} s); {running} tasks running", pg=down_at)
        await asyncio.sleep(ev.duration)
        await asyncio.to_thread(outage.resume, pid)
        up_at = await self._await_postgres()
        if up_at is not None:
            await self.c.fault("pg_resume", "postgres", f"SIGCONT; answering again "
                               f"{(up_at - down_at).total_seconds():.2f} s after the pause", pg=up_at)
        return up_at

    async def _restart_postgres(
        self, ev: FaultEvent, down_at: datetime, running: list[RunningLease]
    ) -> datetime | None:
        left = sorted((r.lease_expires_at - down_at).total_seconds() for r in running)
        leases = f" (leases {left[0]:.1f}-{left[-1]:.1f} s left)" if left else ""
        await self.c.fault(ev.kind, "postgres", f"immediate shutdown (SIGQUIT), back in {ev.duration:.1f} s "
                           f"on the same port; {len(running)} tasks running{leases}", pg=down_at)
        await self.c.services.engine.dispose()  # the campaign's pooled connections die with the server
        admin = self.c.admin
        took = await asyncio.to_thread(outage.restart_postgres, self.c.pg, ev.duration)
        if self.c.pg.url != admin:
            self.c.notes.append(f"PostgreSQL came back on another address ({self.c.pg.url}, was {admin})")
        up_at = await self._await_postgres()
        if up_at is not None:
            await self.c.fault("pg_back", "postgres", f"answering again: down {took:.2f} s by this host's "
                               f"clock, {(up_at - down_at).total_seconds():.2f} s by PostgreSQL's", pg=up_at)
        return up_at

    async def _await_postgres(self) -> datetime | None:
        """PostgreSQL's clock at its first answer after an outage (None: not within the start-up timeout)."""
        deadline = time.monotonic() + self.c.cfg.startup_timeout
        while time.monotonic() < deadline:
            try:
                return await self.c.clock()
            except Exception:  # refused, starting up, or a pooled connection that died with it
                await asyncio.sleep(0.05)
        self.c.notes.append("PostgreSQL did not answer again within the start-up timeout")
        await self.c.fault("pg_back", "postgres", "NOT answering within the start-up timeout")
        return None

    async def restart(self, slot: int, delay: float) -> None:
        await asyncio.sleep(delay)
        # A worker refuses to start without its database (the schema gate fails closed), as an
        # operator's supervisor would find: it restarts the worker once PostgreSQL is back.
        deferred = time.monotonic()
        await self.c.pg_up.wait()
        deferred = time.monotonic() - deferred
        proc = self.c.start_worker(slot)
        self.c.slots[slot] = proc
        waited = f" (after waiting {deferred:.1f} s for PostgreSQL)" if deferred > 0.05 else ""
        await self.c.fault("worker_restart", proc.name, f"started pid {proc.pid}{waited}")
        await self.c.await_ready(proc, self.c.cfg.startup_timeout)
        if proc.ready:
            self.c.say(f"{proc.name} ready {time.monotonic() - proc.started:.1f} s after its start")

    async def _resume(self, victim: Managed, duration: float) -> None:
        await asyncio.sleep(duration)
        victim.signal_group(signal.SIGCONT)
        victim.paused = False
        self.owner_pauses.discard(victim.name)
        detail = f"SIGCONT group {victim.pid}: wakes up past its lease"
        await self.c.fault("worker_resume", victim.name, detail)

    async def _redis_restart(self, downtime: float) -> None:
        await self.c.collect_metrics()  # the hash dies with Redis' data
        outage: list[datetime | None] = [await self.c.pg_now(), None]
        self.c.outages.append(outage)
        await asyncio.to_thread(self.c.redis_server.stop)
        await self.c.fault(REDIS, "redis", f"stopped (data lost); restarting in {downtime:.1f} s")
        await asyncio.sleep(downtime)
        await asyncio.to_thread(self.c.redis_server.start)
        await self.c.fault("redis_start", "redis", f"started empty on the same port ({self.c.redis_url})")
        await self._await_transport("redis", "the Redis restart", outage)

    async def _rabbitmq_outage(self, downtime: float) -> None:
        """The campaign's vhost refuses its user and loses every connection, then is granted again:
        publishes fail, workers and beat retry their connections, and all must carry on after it.
        (Quorum queues keep their messages: unlike Redis restarted empty, nothing is lost.)"""
        assert self.c.vhost is not None
        outage: list[datetime | None] = [await self.c.pg_now(), None]
        self.c.outages.append(outage)
        await asyncio.to_thread(self.c.vhost.revoke)
        await self.c.fault(RABBITMQ, "rabbitmq", f"vhost {self.c.vhost.name}: permissions cleared, its "
                           f"connections closed; granting again in {downtime:.1f} s")
        await asyncio.sleep(downtime)
        await asyncio.to_thread(self.c.vhost.grant)
        # The readiness fact outlived the outage in Redis: only a reconcile from now on counts.
        with contextlib.suppress(Exception):
            await self.c.redis.delete(READINESS_KEY)
        detail = f"vhost {self.c.vhost.name}: permissions set again"
        await self.c.fault("rabbitmq_restore", "rabbitmq", detail)
        await self._await_transport("rabbitmq", "permissions were set again", outage)

    async def _await_transport(self, broker: str, since: str, outage: list[datetime | None]) -> None:
        """Recovered = a worker answers over the broker and a reconcile beat scheduled has run."""
        began = time.monotonic()
        fact = await self.c.await_readiness_fact(self.c.cfg.startup_timeout)
        answered = False
        while fact and not answered and time.monotonic() - began < self.c.cfg.startup_timeout:
            live = [p for p in self.c.slots if p.alive() and not p.paused]
            answered = any([await self.c.ping(p) for p in live])
        outage[1] = await self.c.pg_now()
        self.broker_down = False
        if fact and answered:
            await self.c.fault(f"{broker}_recovered", broker,
                               f"transport working again {time.monotonic() - began:.1f} s after {since}")
        else:
            self.c.notes.append(f"the transport did not recover after {since}")
            await self.c.fault(f"{broker}_recovered", broker, "NOT recovered within the start-up timeout")

    async def _duplicate(self, ev: FaultEvent) -> None:
        if not self.c.submitted:
            await self.c.fault(ev.kind, "-", "skipped: nothing submitted yet")
            return
        rng = random.Random(f"{self.c.cfg.seed}:{ev.at}:dup")
        ids = rng.sample(self.c.submitted, min(len(self.c.submitted), 5 + int(ev.amount * 15)))
        copies = 2 if ev.amount > 0.5 else 1
        async with self.c.services.engine.connect() as conn:
            rows = (
                await conn.execute(text("SELECT status FROM tasks WHERE id = ANY(:ids)"), {"ids": ids})
            ).scalars().all()
        by_status = {s: rows.count(s) for s in sorted(set(rows))}
        try:
            await asyncio.to_thread(self.c.services.transport.publish_sync, [str(i) for i in ids] * copies)
            outcome = "published"
        except Exception as exc:
            outcome = f"publish failed ({type(exc).__name__})"
        await self.c.fault(ev.kind, f"{len(ids)} ids x{copies}", f"{outcome}; ids were {by_status}")

    async def _pg_terminate(self, ev: FaultEvent) -> None:
        async with self.c.services.engine.connect() as conn:
            pids = sorted((
                await conn.execute(
                    text(
                        """SELECT pid FROM pg_stat_activity WHERE datname = current_database()
                        AND application_name LIKE 'dtask-worker:%'"""
                    )
                )
            ).scalars().all())
            rng = random.Random(f"{self.c.cfg.seed}:{ev.at}:pg")
            chosen = rng.sample(pids, max(1, round(len(pids) * (0.3 + 0.7 * ev.amount)))) if pids else []
            ended = 0
            for pid in chosen:
                done = await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                ended += bool(done.scalar())
            await conn.commit()
        await self.c.fault(ev.kind, "postgres", f"terminated {ended} of {len(pids)} worker backends")

    async def _cancel(self, ev: FaultEvent) -> None:
        async with self.c.services.engine.connect() as conn:
            ids = (
                await conn.execute(
                    text("SELECT id FROM tasks WHERE status IN ('pending', 'running') ORDER BY created_at")
                )
            ).scalars().all()
        if not ids:
            await self.c.fault(ev.kind, "-", "skipped: no active task")
            return
        rng = random.Random(f"{self.c.cfg.seed}:{ev.at}:cancel")
        chosen = rng.sample(list(ids), min(len(ids), 1 + int(ev.amount * 3)))
        outcomes = [await self.c.services.repo.request_cancel(i, self.c.services.registry) for i in chosen]
        await self.c.fault(ev.kind, f"{len(chosen)} tasks", ", ".join(str(o) for o in outcomes))
