"""One fault campaign: a real cluster, a seeded fault schedule, convergence, then the checker.

The cluster: ``workers`` Celery workers (``celery -A tasks_core.celery_app worker``, each its own
process group; one runs with a skewed wall clock when libfaketime is installed), one beat, a Redis of
its own on a loopback port (EmbeddedRedis) and a temporary database on the given PostgreSQL server
(created, migrated, dropped afterwards unless ``keep``). While mixed diagnostics tasks are submitted
in small batches, the schedule's faults fire: SIGKILL and restart of workers, SIGSTOP of a worker for
longer than the lease then SIGCONT (a paused owner that wakes up and tries to write), SIGSTOP of a
worker caught inside a write transaction while it holds row locks, duplicate publication
of ids, Redis stopped and restarted empty on the same port, ``pg_terminate_backend`` of worker
connections, cancellations. With ``broker="rabbitmq"`` the transport is a vhost of the campaign's own
on this machine's RabbitMQ (Redis stays for the readiness fact and the metrics), and the broker fault
is that vhost's outage: its user's permissions cleared and its connections closed, then granted
again (the server is never restarted: other vhosts live on it). With ``own_postgres`` the campaign
starts its own embedded PostgreSQL (under its work directory, never a server others use) and adds
two faults only an owner may do:
PostgreSQL paused (postmaster and backends SIGSTOPped) past the lease, and PostgreSQL restarted
(immediate shutdown, back on the same port within 1-3 s). A monitor samples PostgreSQL meanwhile
(expired leases, running count, stalls). After the last fault the campaign waits for every task to
finish, kills the cluster and hands the database to the checker.

Every time the campaign records for the checker is PostgreSQL's ``clock_timestamp()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

from tasks_core import metrics
from tasks_core.devkit import outage
from tasks_core.devkit.chaos import faults as F
from tasks_core.devkit.chaos.checker import (
    Bounds,
    ExpiredLease,
    Observations,
    PostgresOutage,
    Report,
    RunningLease,
    check,
    load_snapshot,
    merge_counts,
)
from tasks_core.devkit.cluster import answers_ping, celery_on
from tasks_core.devkit.rabbitmq import DEFAULT_URL as DEFAULT_RABBITMQ_URL
from tasks_core.devkit.rabbitmq import PrivateVhost, masked
from tasks_core.duties.readiness import READINESS_KEY
from tasks_core.worker.lease import MAX_BACKOFF

DEFAULT_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
MONITOR_INTERVAL = 0.5
SUBMIT_INTERVAL = 0.5
# Tasks are submitted during this share of the fault phase, so the last ones still meet faults.
SUBMIT_SHARE = 0.7
LEASE_LOST_LINE = "lease lost before its terminal write"
RETRY_BACKOFF_SECONDS = 1.0
RETRY_BACKOFF_MAX_SECONDS = 4.0
NO_FAKETIME_NOTE = ("libfaketime not installed: no worker ran with a skewed clock "
                    "(apt-get install faketime to add one)")


class CampaignError(RuntimeError):
    """The campaign could not run (a service or process did not start); not an invariant verdict."""


@dataclass
class CampaignConfig:
    seed: int
    workers: int = 3
    tasks: int = 400
    fault_seconds: float = 90.0
    capacity: int = 4
    concurrency: int | None = None  # pool processes per worker (None: capacity + 2, the default)
    lease_seconds: float = 4.0
    reconcile_seconds: float = 1.0
    publish_seconds: float = 2.0
    margin_seconds: float = 5.0
    skew_seconds: float = -3600.0  # wall-clock skew of worker 0 (0: none)
    exclude: tuple[str, ...] = ()  # fault kinds left out of the schedule
    # Start an embedded PostgreSQL of the campaign's own, and pause and restart it as faults.
    own_postgres: bool = False
    # "redis" (the campaign's own embedded Redis), "rabbitmq" (a vhost of the campaign's own on this
    # machine's RabbitMQ) or an amqp:// URL of a local RabbitMQ to make that vhost on.
    broker: str = "redis"
    admin_url: str | None = None
    keep: bool = False
    workdir: Path | None = None
    startup_timeout: float = 120.0

    @property
    def rabbitmq_url(self) -> str | None:
        """The RabbitMQ the campaign makes its vhost on; None when the broker is its Redis."""
        if self.broker == "redis":
            return None
        return DEFAULT_RABBITMQ_URL if self.broker == "rabbitmq" else self.broker

    def bounds(self) -> Bounds:
        return Bounds(self.capacity, self.lease_seconds, self.reconcile_seconds, self.publish_seconds,
                      self.margin_seconds, retry_gap_seconds=MAX_BACKOFF)

    def replay_command(self) -> str:
        defaults = CampaignConfig(seed=self.seed)
        parts = [f"dtask chaos --seed {self.seed}"] + (["--own-postgres"] if self.own_postgres else [])
        if self.broker != "redis":
            parts.append(f"--broker {masked(self.broker)}")
        for name, flag in (("workers", "--workers"), ("tasks", "--tasks"), ("fault_seconds", "--duration"),
                           ("capacity", "--capacity"), ("concurrency", "--concurrency"),
                           ("lease_seconds", "--lease"), ("reconcile_seconds", "--reconcile"),
                           ("publish_seconds", "--publish"), ("margin_seconds", "--margin"),
                           ("skew_seconds", "--skew")):
            value = getattr(self, name)
            if value is not None and value != getattr(defaults, name):
                parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
        parts += [f"--without {kind}" for kind in self.exclude]
        return " ".join(parts)

    def schedule(self) -> list[F.FaultEvent]:
        pause = F.claimer_pause_seconds(self.lease_seconds, self.reconcile_seconds, self.margin_seconds)
        rabbitmq = self.rabbitmq_url is not None
        # The broker fault keeps its place and draws in the schedule whatever the broker.
        exclude = tuple(F.REDIS if kind == F.RABBITMQ else kind for kind in self.exclude)
        events = F.build_schedule(
            self.seed, self.fault_seconds, self.lease_seconds, exclude=exclude, claimer_pause=pause,
            own_postgres=self.own_postgres,
        )
        return [dataclasses.replace(e, kind=F.on_broker(e.kind, rabbitmq)) for e in events]


@dataclass
class CampaignResult:
    config: CampaignConfig
    report: Report
    faults: list[dict[str, Any]]
    schedule: list[F.FaultEvent]
    database: str
    workdir: Path
    seconds: float
    submitted: int
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_json(self) -> dict[str, Any]:
        cfg: dict[str, Any] = asdict(self.config)
        cfg["workdir"] = None if self.config.workdir is None else str(self.config.workdir)
        cfg.pop("admin_url", None)  # may carry a password
        cfg["broker"] = masked(self.config.broker)
        return {
            "seed": self.config.seed,
            "replay": self.config.replay_command(),
            "ok": self.ok,
            "config": cfg,
            "database": self.database,
            "workdir": str(self.workdir),
            "seconds": round(self.seconds, 1),
            "tasks_submitted": self.submitted,
            "report": self.report.to_json(),
            "fault_log": self.faults,
            "schedule": [asdict(e) for e in self.schedule],
            "notes": self.notes,
        }


def resolve_admin_url(explicit: str | None) -> str | None:
    """Where to create the temporary database: --admin-url, else the server of DTASK_DATABASE_URL,
    else PostgreSQL on 127.0.0.1:5432; None means "start an embedded one"."""
    from sqlalchemy.engine import make_url

    from tasks_core.devkit.embedded import reachable

    if explicit:
        return explicit
    for candidate in (os.environ.get("DTASK_TEST_ADMIN_URL"), os.environ.get("DTASK_DATABASE_URL")):
        if candidate:
            url = make_url(candidate).set(database="postgres").render_as_string(hide_password=False)
            if reachable(url):
                return url
    return DEFAULT_ADMIN_URL if reachable(DEFAULT_ADMIN_URL) else None


class Campaign:
    def __init__(self, cfg: CampaignConfig, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.out = out
        self.t0 = time.monotonic()
        self.workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix=f"dtask-chaos-{cfg.seed}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        self.fault_log: list[dict[str, Any]] = []
        self.submitted: list[uuid.UUID] = []
        self.submit_stats: dict[str, int] = {}
        self.slots: list[F.Managed] = []
        self.beat: F.Managed | None = None
        self.procs: F.Processes | None = None
        self.outages: list[list[datetime | None]] = []
        self.postgres_outages: list[PostgresOutage] = []
        self.worker_faults: list[tuple[datetime, str]] = []
        self._owner_pauses: set[str] = set()  # workers a pause_worker fault holds stopped
        # While the campaign holds its PostgreSQL down, its own users of the database (submitter,
        # monitor, fault log) wait on this lock or log no PostgreSQL time, instead of hanging on a
        # paused server or retrying into a restart.
        self._db_lock = asyncio.Lock()
        self._pg_up = asyncio.Event()
        self._pg_up.set()
        self.expired: dict[tuple[uuid.UUID, datetime], datetime] = {}
        self.stalls: list[tuple[datetime, datetime]] = []
        self.max_running = 0
        self.metric_parts: list[dict[str, float]] = []
        self.broker_down = False
        self._vhost: PrivateVhost | None = None
        self._background: list[asyncio.Task[None]] = []
        self._stop_monitor = asyncio.Event()
        self._skew: tuple[str, float] | None = None
        self._admin: str | None = None
        self._pg: Any = None
        self._db_name = f"dtask_chaos_{uuid.uuid4().hex[:10]}"
        self._db_created = False
        self._redis_server: Any = None
        self.redis_url = ""
        self.broker_url = ""  # the Redis, or the campaign's vhost on RabbitMQ
        self.services: Any = None
        self.app: Any = None
        self.redis: Any = None

    # ------------------------------------------------------------------------------ output

    @property
    def _pg_down(self) -> bool:
        return not self._pg_up.is_set()

    def say(self, line: str) -> None:
        self.out(f"[chaos +{time.monotonic() - self.t0:7.2f}s] {line}")

    async def _clock(self) -> datetime:
        async with self.services.engine.connect() as conn:
            now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
        return now

    async def pg_now(self) -> datetime:
        """PostgreSQL's clock (after any outage the campaign is holding)."""
        async with self._db_lock:
            return await self._clock()

    async def fault(
        self, kind: str, target: str, detail: str, *, pg: datetime | None = None
    ) -> datetime | None:
        """Log a fault with PostgreSQL's time (``pg``, else read now; none while the database is down)."""
        if pg is None and not self._pg_down:
            pg = await self.pg_now()
        entry: dict[str, Any] = {
            "t": round(time.monotonic() - self.t0, 3),
            "wall": datetime.now().astimezone().isoformat(timespec="milliseconds"),
            "pg": None if pg is None else pg.isoformat(timespec="milliseconds"),
            "kind": kind, "target": target, "detail": detail,
        }
        self.fault_log.append(entry)
        stamp = "pg down" if pg is None else f"pg {entry['pg'][11:23]}"
        self.say(f"FAULT {kind:<17} {target:<22} {detail}  ({stamp})")
        return pg

    # ------------------------------------------------------------------------------ run

    async def run(self) -> CampaignResult:
        cfg = self.cfg
        schedule = cfg.schedule()
        workload = F.build_workload(cfg.seed, cfg.tasks)
        self.say(f"seed {cfg.seed} - replay with: {cfg.replay_command()}")
        kinds = tuple(F.on_broker(k, cfg.rabbitmq_url is not None)
                      for k in (F.ALL_KINDS if cfg.own_postgres else F.KINDS))
        phase = F.phase_seconds(schedule, cfg.fault_seconds, cfg.lease_seconds)
        self.say(f"{len(schedule)} faults over {phase:g} s: "
                 + ", ".join(f"{k} {sum(1 for e in schedule if e.kind == k)}" for k in kinds))
        ok = False
        try:
            try:
                await self._setup()
            except Exception as exc:
                raise CampaignError(f"set-up failed: {exc!r}") from exc
            await self._start_cluster()
            window_start = await self.pg_now()
            monitor = asyncio.create_task(self._monitor(), name="monitor")
            try:
                submitter = asyncio.create_task(self._submit(workload), name="submitter")
                await self._faults(schedule)
                await submitter
                faults_end = await self.pg_now()
                self.say(f"faults stopped at pg {faults_end.isoformat(timespec='milliseconds')}; "
                         "waiting for convergence")
                await self._drain()
            finally:
                self._stop_monitor.set()
                await asyncio.gather(monitor, return_exceptions=True)
            await self._collect_metrics()
            assert self.procs is not None
            lease_lost = sum(p.log_text().count(LEASE_LOST_LINE) for p in self.procs.all)
            await asyncio.to_thread(self.procs.stop_all)
            window_end = await self.pg_now()
            report = await self._check(window_start, window_end, lease_lost)
            report.summary["submission"] = self.submit_stats
            done = [e["kind"] for e in self.fault_log if not e["detail"].startswith("skipped")]
            report.summary["faults"] = {kind: done.count(kind) for kind in sorted(set(done))}
            ok = report.ok
            return CampaignResult(
                cfg, report, self.fault_log, schedule, self._db_name, self.workdir,
                time.monotonic() - self.t0, len(self.submitted), self.notes,
            )
        finally:
            # Kept for a look after a failure or a problem noted on the way (not for a missing tool).
            trouble = [n for n in self.notes if n != NO_FAKETIME_NOTE]
            await self._teardown(keep_files=cfg.keep or not ok or bool(trouble))

    # ------------------------------------------------------------------------------ set-up

    async def _setup(self) -> None:
        from alembic import command

        from tasks_core.db import alembic_config
        from tasks_core.devkit.embedded import EmbeddedPostgres, EmbeddedRedis, create_database
        from tasks_core.services import build_services
        from tasks_core.settings import Settings

        admin = None
        if not self.cfg.own_postgres:
            admin = await asyncio.to_thread(resolve_admin_url, self.cfg.admin_url)
        if admin is None:
            why = "its own" if self.cfg.own_postgres else "no PostgreSQL answers: starting"
            self.say(f"{why} embedded PostgreSQL under {self.workdir / 'postgres'}")
            self._pg = EmbeddedPostgres(self.workdir / "postgres")
            admin = await asyncio.to_thread(self._pg.start)
            if self.cfg.own_postgres and admin is not None:
                await _without_fsync(admin)
        assert admin is not None
        self._admin = admin
        db_url = await asyncio.to_thread(create_database, admin, self._db_name)
        self._db_created = True
        await asyncio.to_thread(command.upgrade, alembic_config(db_url), "head")
        self._redis_server = EmbeddedRedis(self.workdir / "redis")
        self.redis_url = await asyncio.to_thread(self._redis_server.start)
        self.broker_url = self.redis_url
        if self.cfg.rabbitmq_url is not None:
            # Redis stays for the readiness fact and the metrics; only the transport moves.
            self._vhost = PrivateVhost(self.cfg.rabbitmq_url, prefix="dtask_chaos")
            self.broker_url = await asyncio.to_thread(self._vhost.create)
            self.say(f"broker: RabbitMQ vhost {self._vhost.name} of the campaign's own")
        self.say(f"database {self._db_name} (migrated), Redis {self.redis_url}, files {self.workdir}")

        settings = Settings(
            database_url=db_url, broker_url=self.broker_url, redis_url=self.redis_url,
            lease_seconds=self.cfg.lease_seconds, reconcile_seconds=self.cfg.reconcile_seconds,
            publish_seconds=self.cfg.publish_seconds, capacity=self.cfg.capacity, extra_task_modules="",
        )
        self.app = _celery_app(self.broker_url)
        from tasks_core.transport import CeleryTransport

        self.services = build_services(settings, transport=CeleryTransport(self.app), pool_size=5)
        import redis.asyncio as aioredis

        self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        env = {
            "DTASK_DATABASE_URL": db_url,
            "DTASK_BROKER_URL": self.broker_url,
            "DTASK_REDIS_URL": self.redis_url,
            "DTASK_LEASE_SECONDS": str(self.cfg.lease_seconds),
            "DTASK_RECONCILE_SECONDS": str(self.cfg.reconcile_seconds),
            "DTASK_PUBLISH_SECONDS": str(self.cfg.publish_seconds),
            "DTASK_CAPACITY": str(self.cfg.capacity),
            "DTASK_SHUTDOWN_GRACE_SECONDS": "1",
            "DTASK_RETRY_BACKOFF_SECONDS": str(RETRY_BACKOFF_SECONDS),
            "DTASK_RETRY_BACKOFF_MAX_SECONDS": str(RETRY_BACKOFF_MAX_SECONDS),
        }
        self.procs = F.Processes(self.workdir, env)

    async def _start_cluster(self) -> None:
        assert self.procs is not None
        if self.cfg.skew_seconds:
            lib = F.faketime_library()
            if lib is None:
                self.notes.append(NO_FAKETIME_NOTE)
                self.say(self.notes[-1])
            else:
                self._skew = (lib, self.cfg.skew_seconds)
        for slot in range(self.cfg.workers):
            self.slots.append(self._start_worker(slot))
        self.beat = self.procs.start_beat()
        started = time.monotonic()
        timeout = self.cfg.startup_timeout
        await asyncio.gather(*(self._await_ready(p, timeout, fatal=True) for p in self.slots))
        await self._await_readiness_fact(self.cfg.startup_timeout)
        self.say(f"cluster ready in {time.monotonic() - started:.1f} s: "
                 + ", ".join(f"{p.node} pid {p.pid}{' (skewed)' if p.skewed else ''}"
                             f"{' (dense)' if p.dense else ''}" for p in self.slots)
                 + f", beat pid {self.beat.pid}")

    def _start_worker(self, slot: int) -> F.Managed:
        assert self.procs is not None
        skew = self._skew if slot == 0 else None
        concurrency = self.cfg.concurrency or self.cfg.capacity + 2
        # The last worker of several runs the dense mode (many tasks on one process's event loop)
        # beside the prefork ones: every fault hits both kinds.
        pool = "threads" if self.cfg.workers > 1 and slot == self.cfg.workers - 1 else "prefork"
        return self.procs.start_worker(slot, concurrency=concurrency, skew=skew, pool=pool)

    async def _ping(self, proc: F.Managed) -> bool:
        try:
            assert proc.node is not None
            return await asyncio.to_thread(answers_ping, self.app, proc.node, 1.0)
        except Exception:  # the broker is down or reconnecting
            await asyncio.sleep(0.5)
            return False

    async def _await_ready(self, proc: F.Managed, within: float, *, fatal: bool = False) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not proc.alive():
                if fatal:
                    assert self.procs is not None
                    raise CampaignError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                                        + self.procs.tail(proc))
                return
            if not proc.paused and await self._ping(proc):
                proc.ready = True
                return
            await asyncio.sleep(0.3)
        message = f"{proc.name} did not answer a ping within {within:g} s"
        if fatal:
            assert self.procs is not None
            raise CampaignError(message + ":\n" + self.procs.tail(proc))
        self.notes.append(message)
        self.say(message)

    async def _await_readiness_fact(self, within: float) -> bool:
        """Beat scheduled a reconcile, the broker carried it, a worker ran it: recovery works."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if await self.redis.exists(READINESS_KEY):
                    return True
            await asyncio.sleep(0.2)
        if self.beat is not None and not self.beat.alive():
            assert self.procs is not None
            code = self.beat.popen.returncode
            raise CampaignError(f"beat exited with {code}:\n" + self.procs.tail(self.beat))
        return False

    # ------------------------------------------------------------------------------ workload

    async def _submit(self, workload: list[F.TaskPlan]) -> None:
        from tasks_core.submission import Idempotency, Submitted, Submitter, TaskIntent

        submitter = Submitter(self.services)
        ticks = max(1, int(self.cfg.fault_seconds * SUBMIT_SHARE / SUBMIT_INTERVAL))
        per_tick = max(1, math.ceil(len(workload) / ticks))
        start = time.monotonic()
        duplicates = publish_failed = 0
        i = tick = 0
        while i < len(workload):
            batch = workload[i : i + per_tick]
            intents = [TaskIntent(p.task_type, p.payload, dedupe_key=p.dedupe_key) for p in batch]
            # A batch whose COMMIT was sent but never answered (a database fault) may have been
            # stored: the retry carries the same key and gets the stored answer, never a copy.
            key = Idempotency(f"chaos-{self.cfg.seed}-{self._db_name}-{i}", f"batch-{i}-{len(batch)}")
            try:
                async with self._db_lock:
                    results = await submitter.submit_many(intents, owner="chaos", idempotency=key)
            except Exception as exc:  # the campaign's own connection is never a fault target
                self.say(f"submit failed ({exc!r}); retrying the batch")
                await asyncio.sleep(SUBMIT_INTERVAL)
                continue
            for r in results:
                if not isinstance(r, Submitted):
                    raise CampaignError(f"the campaign built an invalid task: {r}")
                if r.duplicate_of is not None:
                    duplicates += 1
                    continue
                self.submitted.append(r.task_id)
                publish_failed += r.publish_error is not None  # unsent for capacity is no failure
            i += len(batch)
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * SUBMIT_INTERVAL - time.monotonic()))
        self.submit_stats = {"stored": len(self.submitted), "refused_as_active_duplicates": duplicates,
                             "stored_while_the_broker_was_down": publish_failed}
        self.say(f"submitted {len(self.submitted)} tasks ({duplicates} refused as active duplicates, "
                 f"{publish_failed} stored while the broker was down)")

    # ------------------------------------------------------------------------------ faults

    async def _faults(self, schedule: list[F.FaultEvent]) -> None:
        start = time.monotonic()
        for event in schedule:
            await asyncio.sleep(max(0.0, start + event.at - time.monotonic()))
            try:
                await self._fire(event)
            except Exception as exc:
                self.notes.append(f"fault {event.kind} at +{event.at:g}s raised {exc!r}")
                await self.fault(event.kind, "-", f"ERROR {exc!r}")
        phase = F.phase_seconds(schedule, self.cfg.fault_seconds, self.cfg.lease_seconds)
        await asyncio.sleep(max(0.0, start + phase - time.monotonic()))
        # Pauses end, Redis comes back, killed workers restart: only then have the faults stopped.
        while self._background:
            pending, self._background = self._background, []
            await asyncio.gather(*pending)

    def _spawn_bg(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.append(asyncio.create_task(coro))

    async def _owner_nodes(self) -> dict[str, int]:
        """Worker node -> number of running tasks it owns with a live lease."""
        async with self.services.engine.connect() as conn:
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

    async def _pick_worker(self, pick: float) -> tuple[F.Managed, int] | None:
        """A healthy worker, preferably one that owns running tasks; never the last healthy one."""
        healthy = [p for p in self.slots if p.alive() and p.ready and not p.paused]
        if len(healthy) < 2:
            return None
        owned = await self._owner_nodes()
        candidates = [p for p in healthy if owned.get(p.node or "", 0)] or healthy
        victim = candidates[min(len(candidates) - 1, int(pick * len(candidates)))]
        return victim, owned.get(victim.node or "", 0)

    async def _fire(self, ev: F.FaultEvent) -> None:
        if ev.kind in (F.KILL, F.PAUSE):
            chosen = await self._pick_worker(ev.pick)
            if chosen is None:
                await self.fault(ev.kind, "-", "skipped: fewer than two healthy workers")
                return
            victim, owned = chosen
            slot = self.slots.index(victim)
            if ev.kind == F.KILL:
                await asyncio.to_thread(victim.kill)
                at = await self.fault(ev.kind, victim.name, f"SIGKILL group {victim.pid} owning {owned} "
                                      f"running tasks; restart in {ev.duration:.1f} s")
                self._spawn_bg(self._restart(slot, ev.duration))
            else:
                victim.paused = True
                victim.signal_group(signal.SIGSTOP)
                self._owner_pauses.add(victim.name)
                detail = (f"SIGSTOP group {victim.pid} owning {owned} running tasks for {ev.duration:.1f} s "
                          f"(lease {self.cfg.lease_seconds:g} s)")
                at = await self.fault(ev.kind, victim.name, detail)
                self._spawn_bg(self._resume(victim, ev.duration))
            self._worker_hit(at, victim)
        elif ev.kind == F.PAUSE_CLAIMER:
            await self._pause_claimer(ev)
        elif ev.kind == F.DUPLICATE:
            await self._duplicate(ev)
        elif ev.kind in (F.REDIS, F.RABBITMQ):
            if self.broker_down:
                await self.fault(ev.kind, "broker", "skipped: the broker is still down or recovering")
                return
            self.broker_down = True
            outage = self._redis_restart if ev.kind == F.REDIS else self._rabbitmq_outage
            self._spawn_bg(outage(ev.duration))
        elif ev.kind == F.PG_TERMINATE:
            await self._pg_terminate(ev)
        elif ev.kind == F.CANCEL:
            await self._cancel(ev)
        elif ev.kind in F.PG_KINDS:
            await self._postgres_fault(ev)

    def _worker_hit(self, at: datetime | None, victim: F.Managed) -> None:
        """Remember which worker a kill or pause hit, when: its tasks owe no restart its survival."""
        if at is not None and victim.node:
            self.worker_faults.append((at, victim.node))

    async def _pause_claimer(self, ev: F.FaultEvent) -> None:
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
            async with self.services.engine.connect() as conn:
                holders = (await conn.execute(sql)).scalars().all()
                healthy = [p for p in self.slots if p.alive() and p.ready and not p.paused]
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
            at = await self.fault(ev.kind, victim.name, f"SIGSTOP group {victim.pid} inside a transaction "
                                  f"holding row locks ({caught[0]}), for {ev.duration:.1f} s; try {tries}")
            self._worker_hit(at, victim)
            self._spawn_bg(self._resume(victim, ev.duration))
            return
        await self.fault(ev.kind, "-", f"skipped: no worker caught in a write transaction ({tries} tries)")

    async def _postgres_fault(self, ev: F.FaultEvent) -> None:
        """Pause or restart the campaign's own PostgreSQL, in the foreground of the fault loop (no
        other fault fires until recovery works again). The campaign's own users of the database
        wait on the lock while it is down."""
        if self._pg is None:
            await self.fault(ev.kind, "postgres", "skipped: the campaign does not own its PostgreSQL")
            return
        await self._until_workers_settled()
        self._pg_up.clear()  # before taking the lock: no new stamp queues up behind the outage
        try:
            async with self._db_lock:
                down_at, running = await self._running_leases()
                if ev.kind == F.PG_PAUSE:
                    up_at = await self._pause_postgres(ev, down_at, len(running))
                else:
                    up_at = await self._restart_postgres(ev, down_at, running)
                with contextlib.suppress(Exception):  # only a reconcile from now on counts
                    await self.redis.delete(READINESS_KEY)
        finally:
            self._pg_up.set()
        kind = "pause" if ev.kind == F.PG_PAUSE else "restart"
        outage = PostgresOutage(kind, down_at, up_at, tuple(running))
        if up_at is not None:
            outage = dataclasses.replace(outage, recovered_at=await self._await_recovery(up_at))
        self.postgres_outages.append(outage)

    async def _await_recovery(self, up_at: datetime) -> datetime | None:
        """When recovery works again after the database answered: a reconcile has run (the readiness
        fact, deleted when the database answered, is back). Until then workers may still be stuck in
        calls to the stopped server; as with Redis, I3's deadlines start from here."""
        if not await self._await_readiness_fact(self.cfg.startup_timeout):
            self.notes.append("no reconcile ran within the start-up timeout after a PostgreSQL outage")
            await self.fault("pg_recovered", "postgres", "NOT recovered: no reconcile ran")
            return None
        recovered = await self.pg_now()
        after = (recovered - up_at).total_seconds()
        detail = f"a reconcile ran {after:.2f} s after the database answered"
        await self.fault("pg_recovered", "postgres", detail, pg=recovered)
        return recovered

    async def _until_workers_settled(self) -> None:
        """The schedule keeps worker pauses and kills clear of database outages, but the fault loop
        may run late: wait (at most the start-up timeout) until no owner is paused (it would wake up
        with dead connections and give up without trying the late write fencing must refuse), no
        killed worker awaits its restart and none is still starting (its schema check would fail
        against a stopped database and it would exit). A paused claimer may go on sleeping."""

        def unsettled(p: F.Managed) -> bool:
            return (not p.alive() and p.killed) or (p.alive() and not p.ready) or p.name in self._owner_pauses

        for _ in range(int(self.cfg.startup_timeout / 0.1)):
            if not any(unsettled(p) for p in self.slots):
                return
            await asyncio.sleep(0.1)

    async def _running_leases(self) -> tuple[datetime, list[RunningLease]]:
        """PostgreSQL's clock and the running tasks with a live lease, just before a fault."""
        async with self.services.engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        """SELECT clock_timestamp() AS now, id, attempt_token, lease_expires_at FROM tasks
                        WHERE status = 'running' AND lease_expires_at > clock_timestamp()"""
                    )
                )
            ).all()
        now = rows[0].now if rows else await self._clock()
        return now, [RunningLease(r.id, r.attempt_token, r.lease_expires_at) for r in rows]

    async def _pause_postgres(self, ev: F.FaultEvent, down_at: datetime, running: int) -> datetime | None:
        pid = await asyncio.to_thread(outage.pause_postgres, self._pg)
        await self.fault(ev.kind, "postgres", f"SIGSTOP postmaster {pid} and every backend for "
                         f"{ev.duration:.1f} s (lease {self.cfg.lease_seconds:g} s); {running} tasks running",
                         pg=down_at)
        await asyncio.sleep(ev.duration)
        await asyncio.to_thread(outage.resume, pid)
        up_at = await self._await_postgres()
        if up_at is not None:
            await self.fault("pg_resume", "postgres", f"SIGCONT; answering again "
                             f"{(up_at - down_at).total_seconds():.2f} s after the pause", pg=up_at)
        return up_at

    async def _restart_postgres(
        self, ev: F.FaultEvent, down_at: datetime, running: list[RunningLease]
    ) -> datetime | None:
        left = sorted((r.lease_expires_at - down_at).total_seconds() for r in running)
        leases = f" (leases {left[0]:.1f}-{left[-1]:.1f} s left)" if left else ""
        await self.fault(ev.kind, "postgres", f"immediate shutdown (SIGQUIT), back in {ev.duration:.1f} s "
                         f"on the same port; {len(running)} tasks running{leases}", pg=down_at)
        await self.services.engine.dispose()  # the campaign's pooled connections die with the server
        admin = self._admin
        took = await asyncio.to_thread(outage.restart_postgres, self._pg, ev.duration)
        if self._pg.url != admin:
            self.notes.append(f"PostgreSQL came back on another address ({self._pg.url}, was {admin})")
        up_at = await self._await_postgres()
        if up_at is not None:
            await self.fault("pg_back", "postgres", f"answering again: down {took:.2f} s by this host's "
                             f"clock, {(up_at - down_at).total_seconds():.2f} s by PostgreSQL's", pg=up_at)
        return up_at

    async def _await_postgres(self) -> datetime | None:
        """PostgreSQL's clock at its first answer after an outage (None: not within the start-up timeout)."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        while time.monotonic() < deadline:
            try:
                return await self._clock()
            except Exception:  # refused, starting up, or a pooled connection that died with it
                await asyncio.sleep(0.05)
        self.notes.append("PostgreSQL did not answer again within the start-up timeout")
        await self.fault("pg_back", "postgres", "NOT answering within the start-up timeout")
        return None

    async def _restart(self, slot: int, delay: float) -> None:
        await asyncio.sleep(delay)
        # A worker refuses to start without its database (the schema gate fails closed), as an
        # operator's supervisor would find: it restarts the worker once PostgreSQL is back.
        deferred = time.monotonic()
        await self._pg_up.wait()
        deferred = time.monotonic() - deferred
        proc = self._start_worker(slot)
        self.slots[slot] = proc
        waited = f" (after waiting {deferred:.1f} s for PostgreSQL)" if deferred > 0.05 else ""
        await self.fault("worker_restart", proc.name, f"started pid {proc.pid}{waited}")
        await self._await_ready(proc, self.cfg.startup_timeout)
        if proc.ready:
            self.say(f"{proc.name} ready {time.monotonic() - proc.started:.1f} s after its start")

    async def _resume(self, victim: F.Managed, duration: float) -> None:
        await asyncio.sleep(duration)
        victim.signal_group(signal.SIGCONT)
        victim.paused = False
        self._owner_pauses.discard(victim.name)
        await self.fault("worker_resume", victim.name, f"SIGCONT group {victim.pid}: wakes up past its lease")

    async def _redis_restart(self, downtime: float) -> None:
        await self._collect_metrics()  # the hash dies with Redis' data
        outage: list[datetime | None] = [await self.pg_now(), None]
        self.outages.append(outage)
        await asyncio.to_thread(self._redis_server.stop)
        await self.fault(F.REDIS, "redis", f"stopped (data lost); restarting in {downtime:.1f} s")
        await asyncio.sleep(downtime)
        await asyncio.to_thread(self._redis_server.start)
        await self.fault("redis_start", "redis", f"started empty on the same port ({self.redis_url})")
        await self._await_transport("redis", "the Redis restart", outage)

    async def _rabbitmq_outage(self, downtime: float) -> None:
        """The campaign's vhost refuses its user and loses every connection, then is granted again:
        publishes fail, workers and beat retry their connections, and all must carry on after it.
        (Quorum queues keep their messages: unlike Redis restarted empty, nothing is lost.)"""
        assert self._vhost is not None
        outage: list[datetime | None] = [await self.pg_now(), None]
        self.outages.append(outage)
        await asyncio.to_thread(self._vhost.revoke)
        await self.fault(F.RABBITMQ, "rabbitmq", f"vhost {self._vhost.name}: permissions cleared, its "
                         f"connections closed; granting again in {downtime:.1f} s")
        await asyncio.sleep(downtime)
        await asyncio.to_thread(self._vhost.grant)
        # The readiness fact outlived the outage in Redis: only a reconcile from now on counts.
        with contextlib.suppress(Exception):
            await self.redis.delete(READINESS_KEY)
        await self.fault("rabbitmq_restore", "rabbitmq", f"vhost {self._vhost.name}: permissions set again")
        await self._await_transport("rabbitmq", "permissions were set again", outage)

    async def _await_transport(self, broker: str, since: str, outage: list[datetime | None]) -> None:
        """Recovered = a worker answers over the broker and a reconcile beat scheduled has run."""
        began = time.monotonic()
        fact = await self._await_readiness_fact(self.cfg.startup_timeout)
        answered = False
        while fact and not answered and time.monotonic() - began < self.cfg.startup_timeout:
            live = [p for p in self.slots if p.alive() and not p.paused]
            answered = any([await self._ping(p) for p in live])
        outage[1] = await self.pg_now()
        self.broker_down = False
        if fact and answered:
            await self.fault(f"{broker}_recovered", broker,
                             f"transport working again {time.monotonic() - began:.1f} s after {since}")
        else:
            self.notes.append(f"the transport did not recover after {since}")
            await self.fault(f"{broker}_recovered", broker, "NOT recovered within the start-up timeout")

    async def _duplicate(self, ev: F.FaultEvent) -> None:
        if not self.submitted:
            await self.fault(ev.kind, "-", "skipped: nothing submitted yet")
            return
        rng = random.Random(f"{self.cfg.seed}:{ev.at}:dup")
        ids = rng.sample(self.submitted, min(len(self.submitted), 5 + int(ev.amount * 15)))
        copies = 2 if ev.amount > 0.5 else 1
        async with self.services.engine.connect() as conn:
            rows = (
                await conn.execute(text("SELECT status FROM tasks WHERE id = ANY(:ids)"), {"ids": ids})
            ).scalars().all()
        by_status = {s: rows.count(s) for s in sorted(set(rows))}
        try:
            await asyncio.to_thread(self.services.transport.publish_sync, [str(i) for i in ids] * copies)
            outcome = "published"
        except Exception as exc:
            outcome = f"publish failed ({type(exc).__name__})"
        await self.fault(ev.kind, f"{len(ids)} ids x{copies}", f"{outcome}; ids were {by_status}")

    async def _pg_terminate(self, ev: F.FaultEvent) -> None:
        async with self.services.engine.connect() as conn:
            pids = sorted((
                await conn.execute(
                    text(
                        """SELECT pid FROM pg_stat_activity WHERE datname = current_database()
                        AND application_name LIKE 'dtask-worker:%'"""
                    )
                )
            ).scalars().all())
            rng = random.Random(f"{self.cfg.seed}:{ev.at}:pg")
            chosen = rng.sample(pids, max(1, round(len(pids) * (0.3 + 0.7 * ev.amount)))) if pids else []
            ended = 0
            for pid in chosen:
                done = await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                ended += bool(done.scalar())
            await conn.commit()
        await self.fault(ev.kind, "postgres", f"terminated {ended} of {len(pids)} worker backends")

    async def _cancel(self, ev: F.FaultEvent) -> None:
        async with self.services.engine.connect() as conn:
            ids = (
                await conn.execute(
                    text("SELECT id FROM tasks WHERE status IN ('pending', 'running') ORDER BY created_at")
                )
            ).scalars().all()
        if not ids:
            await self.fault(ev.kind, "-", "skipped: no active task")
            return
        rng = random.Random(f"{self.cfg.seed}:{ev.at}:cancel")
        chosen = rng.sample(list(ids), min(len(ids), 1 + int(ev.amount * 3)))
        outcomes = [await self.services.repo.request_cancel(i, self.services.registry) for i in chosen]
        await self.fault(ev.kind, f"{len(chosen)} tasks", ", ".join(str(o) for o in outcomes))

    # ------------------------------------------------------------------------------ watching

    async def _supervise(self) -> None:
        """A process that died without being killed is a finding of its own: note it, restart it."""
        for slot, proc in enumerate(self.slots):
            if not proc.alive() and not proc.killed:
                proc.killed = True
                self.notes.append(f"{proc.name} exited on its own with {proc.popen.returncode}")
                await self.fault("unexpected_exit", proc.name, f"exit {proc.popen.returncode}; restarting")
                self._spawn_bg(self._restart(slot, 0.0))
        if self.beat is not None and not self.beat.alive() and not self.beat.killed:
            self.beat.killed = True
            self.notes.append(f"beat exited on its own with {self.beat.popen.returncode}")
            assert self.procs is not None
            self.beat = self.procs.start_beat()

    async def _monitor(self) -> None:
        """Sample PostgreSQL: lapsed leases still running, the running count, and stalls (due
        pending tasks, free capacity, and no claim since the previous sample)."""
        stall_from: datetime | None = None
        stall_last: datetime | None = None
        last_claim: Any = None
        while not self._stop_monitor.is_set():
            if self._pg_down:  # the campaign holds PostgreSQL down: nothing to sample
                await self._supervise()
                await asyncio.sleep(MONITOR_INTERVAL)
                continue
            try:
                async with self._db_lock, self.services.engine.connect() as conn:
                    facts = (
                        await conn.execute(
                            text(
                                """SELECT clock_timestamp() AS now,
                                  count(*) FILTER (WHERE status = 'running') AS running,
                                  count(*) FILTER (WHERE status = 'pending' AND cancel_requested_at IS NULL
                                    AND (not_before IS NULL OR not_before <= clock_timestamp())) AS due,
                                  (SELECT max(claimed_at) FROM task_attempts) AS last_claim
                                FROM tasks WHERE status IN ('pending', 'running')"""
                            )
                        )
                    ).mappings().one()
                    lapsed = (
                        await conn.execute(
                            text(
                                """SELECT id, lease_expires_at, clock_timestamp() FROM tasks
                                WHERE status = 'running' AND lease_expires_at <= clock_timestamp()"""
                            )
                        )
                    ).all()
            except Exception as exc:
                self.say(f"monitor: {exc!r}")
                await asyncio.sleep(MONITOR_INTERVAL)
                continue
            now = facts["now"]
            self.max_running = max(self.max_running, int(facts["running"]))
            for task_id, lease, seen in lapsed:
                self.expired[(task_id, lease)] = seen
            claimed = facts["last_claim"]
            stalled = facts["due"] > 0 and facts["running"] < self.cfg.capacity and claimed == last_claim
            if stalled:
                stall_from = stall_from or now
                stall_last = now
            elif stall_from is not None and stall_last is not None:
                if (stall_last - stall_from).total_seconds() >= 1.0:
                    self.stalls.append((stall_from, stall_last))
                stall_from = stall_last = None
            last_claim = claimed
            await self._supervise()
            await asyncio.sleep(MONITOR_INTERVAL)
        if stall_from is not None and stall_last is not None:
            self.stalls.append((stall_from, stall_last))

    async def _collect_metrics(self) -> None:
        try:
            self.metric_parts.append(await metrics.read(self.redis))
        except Exception as exc:
            self.say(f"could not read the metrics hash: {exc!r}")

    # ------------------------------------------------------------------------------ convergence

    async def _drain(self) -> None:
        cfg = self.cfg
        for proc in self.slots:
            if not proc.ready:
                await self._await_ready(proc, cfg.startup_timeout)
        async with self.services.engine.connect() as conn:
            left = (
                await conn.execute(
                    text(
                        """SELECT count(*), coalesce(sum(CASE WHEN payload ? 'seconds'
                             THEN (payload->>'seconds')::float8 ELSE 0 END), 0)
                        FROM tasks WHERE status IN ('pending', 'running')"""
                    )
                )
            ).one()
        count, work = int(left[0]), float(left[1])
        # Not a protocol bound (the stall check is): the unfinished work at full capacity, doubled
        # for a busy two-core machine, after recovery and a retry's backoff.
        allowance = (cfg.lease_seconds + cfg.reconcile_seconds + 2 * cfg.publish_seconds
                     + RETRY_BACKOFF_MAX_SECONDS + cfg.margin_seconds
                     + 2 * (work + 0.3 * count) / cfg.capacity + 30)
        self.say(f"{count} tasks unfinished ({work:.0f} s of sleeping); allowing {allowance:.0f} s")
        deadline = time.monotonic() + allowance
        reported = time.monotonic()
        while True:
            async with self.services.engine.connect() as conn:
                active = int((await conn.execute(
                    text("SELECT count(*) FROM tasks WHERE status IN ('pending', 'running')")
                )).scalar_one())
            if active == 0:
                self.say("every task is terminal")
                break
            if time.monotonic() > deadline:
                self.notes.append(f"{active} tasks still unfinished after {allowance:.0f} s")
                self.say(self.notes[-1])
                break
            if time.monotonic() - reported > 10:
                self.say(f"{active} tasks still active")
                reported = time.monotonic()
            await asyncio.sleep(0.5)
        # Late writers (woken owners) end within a heartbeat; their counters flush after each run.
        await asyncio.sleep(max(2.0, 2 * cfg.reconcile_seconds) + cfg.lease_seconds / 3)

    # ------------------------------------------------------------------------------ verdict

    async def _check(self, window_start: datetime, window_end: datetime, lease_lost: int) -> Report:
        snapshot = await load_snapshot(self.services.engine)
        totals = merge_counts(self.metric_parts)
        rejected: dict[str, float] = {}
        for key, value in totals.items():
            name, labels = metrics.parse_field(key)
            if name == metrics.FENCED_WRITES_REJECTED.name:
                rejected[labels.get("write", "")] = rejected.get(labels.get("write", ""), 0.0) + value
        skewed = sorted({p.node for p in (self.procs.all if self.procs else []) if p.skewed and p.node})
        obs = Observations(
            window_start=window_start,
            window_end=window_end,
            outages=[(o[0], o[1]) for o in self.outages if o[0] is not None],
            expired_leases=[ExpiredLease(t, lease, seen) for (t, lease), seen in self.expired.items()],
            stalls=self.stalls,
            max_running_seen=self.max_running,
            skewed_workers=skewed,
            skew_seconds=self.cfg.skew_seconds if skewed else 0.0,
            rejected_writes=rejected,
            lease_lost_log_lines=lease_lost,
            postgres_outages=self.postgres_outages,
            worker_faults=self.worker_faults,
        )
        report = check(snapshot, obs, self.cfg.bounds())
        report.summary["metrics"] = {
            k: v for k, v in totals.items()
            if k.startswith(("dtask_claims", "dtask_lease_lost", "dtask_reconciled", "dtask_publish"))
        }
        return report

    async def _teardown(self, *, keep_files: bool) -> None:
        from tasks_core.devkit.embedded import drop_database

        if self.procs is not None:
            await asyncio.to_thread(self.procs.stop_all)
        for task in self._background:
            task.cancel()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        if self.services is not None:
            with contextlib.suppress(Exception):
                await self.services.close()
        if self._redis_server is not None:
            await asyncio.to_thread(self._redis_server.stop)
        if self._vhost is not None:
            try:
                await asyncio.to_thread(self._vhost.delete)
            except Exception as exc:
                self.say(f"could not delete RabbitMQ vhost {self._vhost.name}: {exc!r}")
        if self._db_created and self._admin is not None and not self.cfg.own_postgres:
            if self.cfg.keep:
                self.say(f"kept database {self._db_name}")
            else:
                try:
                    await asyncio.to_thread(drop_database, self._admin, self._db_name)
                except Exception as exc:
                    self.say(f"could not drop {self._db_name}: {exc!r}")
        if self._pg is not None:
            if keep_files:  # the whole server is the campaign's: its cluster stays for a look
                self.say(f"kept database {self._db_name} in the campaign's PostgreSQL ({self._pg.pgdata})")
                await asyncio.to_thread(self._pg.stop)
            else:
                await asyncio.to_thread(self._pg.destroy)
        if keep_files and self.procs is not None:
            self.say(f"logs kept in {self.workdir}")
        elif self.cfg.workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def _without_fsync(admin_url: str) -> None:
    """fsync off on the campaign's own, throwaway server. An immediate shutdown loses nothing the
    kernel already holds, and the next start then skips syncing the whole data directory before
    crash recovery (seconds on a busy disk), so a restart is back when the fault says it is."""
    from tasks_core.db import make_engine

    engine = make_engine(admin_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text("ALTER SYSTEM SET fsync = off"))
            await conn.execute(text("SELECT pg_reload_conf()"))
    finally:
        await engine.dispose()


def _celery_app(broker_url: str) -> Any:
    """A Celery app with the project's settings on the campaign's broker (publishing, pings),
    declaring the queues as the workers do (quorum on RabbitMQ)."""
    return celery_on(broker_url, "dtask-chaos")


async def run_campaign(cfg: CampaignConfig, out: Callable[[str], None] = print) -> CampaignResult:
    return await Campaign(cfg, out).run()
