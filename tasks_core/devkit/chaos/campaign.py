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
import shutil
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
from tasks_core.devkit.chaos import faults as F
from tasks_core.devkit.chaos.checker import (
    Bounds,
    ExpiredLease,
    Observations,
    PostgresOutage,
    Report,
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
        # While the campaign holds its PostgreSQL down, its own users of the database (submitter,
        # monitor, fault log) wait on this lock or log no PostgreSQL time, instead of hanging on a
        # paused server or retrying into a restart.
        self.db_lock = asyncio.Lock()
        self.pg_up = asyncio.Event()
        self.pg_up.set()
        self.expired: dict[tuple[uuid.UUID, datetime], datetime] = {}
        self.stalls: list[tuple[datetime, datetime]] = []
        self.max_running = 0
        self.metric_parts: list[dict[str, float]] = []
        self.vhost: PrivateVhost | None = None
        self._background: list[asyncio.Task[None]] = []
        self._stop_monitor = asyncio.Event()
        self._skew: tuple[str, float] | None = None
        self.admin: str | None = None
        self.pg: Any = None
        self._db_name = f"dtask_chaos_{uuid.uuid4().hex[:10]}"
        self._db_created = False
        self.redis_server: Any = None
        self.redis_url = ""
        self.broker_url = ""  # the Redis, or the campaign's vhost on RabbitMQ
        self.services: Any = None
        self.app: Any = None
        self.redis: Any = None
        self.actions = F.FaultActions(self)

    # ------------------------------------------------------------------------------ output

    @property
    def _pg_down(self) -> bool:
        return not self.pg_up.is_set()

    def say(self, line: str) -> None:
        self.out(f"[chaos +{time.monotonic() - self.t0:7.2f}s] {line}")

    async def clock(self) -> datetime:
        async with self.services.engine.connect() as conn:
            now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
        return now

    async def pg_now(self) -> datetime:
        """PostgreSQL's clock (after any outage the campaign is holding)."""
        async with self.db_lock:
            return await self.clock()

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
            await self.collect_metrics()
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
            self.pg = EmbeddedPostgres(self.workdir / "postgres")
            admin = await asyncio.to_thread(self.pg.start)
            if self.cfg.own_postgres and admin is not None:
                await _without_fsync(admin)
        assert admin is not None
        self.admin = admin
        db_url = await asyncio.to_thread(create_database, admin, self._db_name)
        self._db_created = True
        await asyncio.to_thread(command.upgrade, alembic_config(db_url), "head")
        self.redis_server = EmbeddedRedis(self.workdir / "redis")
        self.redis_url = await asyncio.to_thread(self.redis_server.start)
        self.broker_url = self.redis_url
        if self.cfg.rabbitmq_url is not None:
            # Redis stays for the readiness fact and the metrics; only the transport moves.
            self.vhost = PrivateVhost(self.cfg.rabbitmq_url, prefix="dtask_chaos")
            self.broker_url = await asyncio.to_thread(self.vhost.create)
            self.say(f"broker: RabbitMQ vhost {self.vhost.name} of the campaign's own")
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
            self.slots.append(self.start_worker(slot))
        self.beat = self.procs.start_beat()
        started = time.monotonic()
        timeout = self.cfg.startup_timeout
        await asyncio.gather(*(self.await_ready(p, timeout, fatal=True) for p in self.slots))
        await self.await_readiness_fact(self.cfg.startup_timeout)
        self.say(f"cluster ready in {time.monotonic() - started:.1f} s: "
                 + ", ".join(f"{p.node} pid {p.pid}{' (skewed)' if p.skewed else ''}"
                             f"{' (dense)' if p.dense else ''}" for p in self.slots)
                 + f", beat pid {self.beat.pid}")

    def start_worker(self, slot: int) -> F.Managed:
        assert self.procs is not None
        skew = self._skew if slot == 0 else None
        concurrency = self.cfg.concurrency or self.cfg.capacity + 2
        # The last worker of several runs the dense mode (many tasks on one process's event loop)
        # beside the prefork ones: every fault hits both kinds.
        pool = "threads" if self.cfg.workers > 1 and slot == self.cfg.workers - 1 else "prefork"
        return self.procs.start_worker(slot, concurrency=concurrency, skew=skew, pool=pool)

    async def ping(self, proc: F.Managed) -> bool:
        try:
            assert proc.node is not None
            return await asyncio.to_thread(answers_ping, self.app, proc.node, 1.0)
        except Exception:  # the broker is down or reconnecting
            await asyncio.sleep(0.5)
            return False

    async def await_ready(self, proc: F.Managed, within: float, *, fatal: bool = False) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not proc.alive():
                if fatal:
                    assert self.procs is not None
                    raise CampaignError(f"{proc.name} exited with {proc.popen.returncode}:\n"
                                        + self.procs.tail(proc))
                return
            if not proc.paused and await self.ping(proc):
                proc.ready = True
                return
            await asyncio.sleep(0.3)
        message = f"{proc.name} did not answer a ping within {within:g} s"
        if fatal:
            assert self.procs is not None
            raise CampaignError(message + ":\n" + self.procs.tail(proc))
        self.notes.append(message)
        self.say(message)

    async def await_readiness_fact(self, within: float) -> bool:
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
            intents = [
                TaskIntent(p.task_type, p.payload, dedupe_key=p.dedupe_key, delay_seconds=p.delay_seconds,
                           priority=p.priority)
                for p in batch
            ]  # fmt: skip
            # A batch whose COMMIT was sent but never answered (a database fault) may have been
            # stored: the retry carries the same key and gets the stored answer, never a copy.
            key = Idempotency(f"chaos-{self.cfg.seed}-{self._db_name}-{i}", f"batch-{i}-{len(batch)}")
            try:
                async with self.db_lock:
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
                await self.actions.fire(event)
            except Exception as exc:
                self.notes.append(f"fault {event.kind} at +{event.at:g}s raised {exc!r}")
                await self.fault(event.kind, "-", f"ERROR {exc!r}")
        phase = F.phase_seconds(schedule, self.cfg.fault_seconds, self.cfg.lease_seconds)
        await asyncio.sleep(max(0.0, start + phase - time.monotonic()))
        # Pauses end, Redis comes back, killed workers restart: only then have the faults stopped.
        while self._background:
            pending, self._background = self._background, []
            await asyncio.gather(*pending)

    def spawn_bg(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.append(asyncio.create_task(coro))

    # ------------------------------------------------------------------------------ watching

    async def _supervise(self) -> None:
        """A process that died without being killed is a finding of its own: note it, restart it."""
        for slot, proc in enumerate(self.slots):
            if not proc.alive() and not proc.killed:
                proc.killed = True
                self.notes.append(f"{proc.name} exited on its own with {proc.popen.returncode}")
                await self.fault("unexpected_exit", proc.name, f"exit {proc.popen.returncode}; restarting")
                self.spawn_bg(self.actions.restart(slot, 0.0))
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
                async with self.db_lock, self.services.engine.connect() as conn:
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

    async def collect_metrics(self) -> None:
        try:
            self.metric_parts.append(await metrics.read(self.redis))
        except Exception as exc:
            self.say(f"could not read the metrics hash: {exc!r}")

    # ------------------------------------------------------------------------------ convergence

    async def _drain(self) -> None:
        cfg = self.cfg
        for proc in self.slots:
            if not proc.ready:
                await self.await_ready(proc, cfg.startup_timeout)
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
        if self.redis_server is not None:
            await asyncio.to_thread(self.redis_server.stop)
        if self.vhost is not None:
            try:
                await asyncio.to_thread(self.vhost.delete)
            except Exception as exc:
                self.say(f"could not delete RabbitMQ vhost {self.vhost.name}: {exc!r}")
        if self._db_created and self.admin is not None and not self.cfg.own_postgres:
            if self.cfg.keep:
                self.say(f"kept database {self._db_name}")
            else:
                try:
                    await asyncio.to_thread(drop_database, self.admin, self._db_name)
                except Exception as exc:
                    self.say(f"could not drop {self._db_name}: {exc!r}")
        if self.pg is not None:
            if keep_files:  # the whole server is the campaign's: its cluster stays for a look
                self.say(f"kept database {self._db_name} in the campaign's PostgreSQL ({self.pg.pgdata})")
                await asyncio.to_thread(self.pg.stop)
            else:
                await asyncio.to_thread(self.pg.destroy)
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
