"""The seeded fault schedule, and the real processes the faults are done to.

``build_schedule(seed, ...)`` is a pure function of its arguments: the same seed gives the same
fault kinds, instants, durations and choices, and the same task mix (``build_workload``). Which
worker a fault hits is decided when it fires (the owner of a running task, if any), by the
schedule's pre-drawn ``pick``, so a replay hits the same rank among the candidates of that moment.

Processes are started exactly as an operator would (``celery -A tasks_core.celery_app worker`` and
``... beat``), each in its own session and process group, so SIGKILL/SIGSTOP/SIGCONT reach a
worker's main process and all its pool children at once.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks_core.devkit.cluster import ROOT as ROOT
from tasks_core.devkit.cluster import Cluster, ClusterProcess, process_env

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
