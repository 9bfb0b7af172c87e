"""What every workload needs around its measurement: a temporary database, a private Redis DB index,
real worker/beat subprocesses, and the durable client calls (submit, wait, reset).

``BenchEnv`` owns all of it for one run and releases everything in ``close()`` (called from a
``finally``): subprocesses are SIGKILLed by process group, databases dropped, the Redis DB index
flushed, the scratch directory removed. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis as redis_sync
from pydantic import TypeAdapter
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from tasks_core.devkit.cluster import ROOT as ROOT
from tasks_core.devkit.cluster import Cluster, ClusterProcess, celery_on, process_env
from tasks_core.devkit.cluster import poll as poll_until
from tasks_core.devkit.processes import process_tree
from tasks_core.devkit.rabbitmq import PrivateVhost
from tasks_core.settings import Settings

T = TypeVar("T")

DEFAULT_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_REDIS_DB = 13
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TERMINAL = ("success", "failed", "cancelled")
TERMINAL_SQL = "('success', 'failed', 'cancelled')"
STARTUP_TIMEOUT = 60.0
LOG_TAIL_LINES = 40
# Worker log level for every measured process, durable and plain alike: INFO logs two lines per
# task, which would measure the logging handler as much as the transport.
WORKER_LOGLEVEL = "WARNING"
# Submissions go in batches of this many (the HTTP batch limit): one transaction, one publish pass.
SUBMIT_BATCH = 1000


class BenchError(RuntimeError):
    """A benchmark could not run or did not converge; the message says why (with log tails)."""


def default_admin_url() -> str:
    env = os.environ
    return env.get("DTASK_BENCH_ADMIN_URL") or env.get("DTASK_TEST_ADMIN_URL") or DEFAULT_ADMIN_URL


def default_redis_url() -> str:
    env = os.environ
    return env.get("DTASK_BENCH_REDIS_URL") or env.get("DTASK_TEST_REDIS_URL") or DEFAULT_REDIS_URL


@dataclass
class CommonOptions:
    """Options every workload takes (the workload's own options come first in its subclass)."""

    rounds: int = 3
    admin_url: str = field(default_factory=default_admin_url)
    redis_url: str = field(default_factory=default_redis_url)
    redis_db: int = DEFAULT_REDIS_DB
    # Refuse a non-empty Redis DB index unless told: it may belong to someone else's run.
    flush_redis: bool = False
    quick: bool = False


Opts = TypeVar("Opts", bound=CommonOptions)


def resolve(cls: type[Opts], quick: bool, quick_values: Mapping[str, Any], given: Mapping[str, Any]) -> Opts:
    """Options = defaults, then the workload's tiny values when ``quick``, then what the user gave."""
    values: dict[str, Any] = dict(quick_values) if quick else {}
    values.update({k: v for k, v in given.items() if v is not None})
    return cls(quick=quick, **values)


# The Celery settings that shape the transport; recorded with every result.
CELERY_KEYS = (
    "task_serializer", "task_acks_late", "task_reject_on_worker_lost", "worker_prefetch_multiplier",
    "worker_disable_prefetch", "worker_max_tasks_per_child", "worker_send_task_events",
    "task_send_sent_event", "task_ignore_result", "broker_transport_options",
)
# Settings that are secrets or addresses of services the bench does not use.
_UNRECORDED = {"api_keys", "flower_basic_auth", "minio_secret_key", "minio_access_key", "database_url",
               "broker_url", "redis_url", "milvus_uri", "minio_endpoint", "dev_dir"}


def effective_settings(dtask: Mapping[str, str]) -> dict[str, Any]:
    """What a process started with these DTASK_* variables (and no others) runs with."""
    values: dict[str, Any] = {
        name: f.default for name, f in Settings.model_fields.items() if name not in _UNRECORDED
    }
    for key, value in dtask.items():
        name = key.removeprefix("DTASK_").lower()
        if name in values:
            # Typed as the process will parse it ("4" -> 4), so results compare as numbers.
            annotation = Settings.model_fields[name].annotation
            values[name] = value if annotation is None else TypeAdapter(annotation).validate_python(value)
    return values


def public_options(opts: Any) -> dict[str, Any]:
    """Options for the result file, with any password in the URLs masked."""
    out = dict(vars(opts))
    out["admin_url"] = make_url(opts.admin_url).render_as_string(hide_password=True)
    parts = urlsplit(opts.redis_url)
    if parts.password:
        out["redis_url"] = urlunsplit(parts._replace(netloc=f"***@{parts.hostname}:{parts.port or 6379}"))
    return out


def _require_loopback(kind: str, host: str | None) -> None:
    # Benchmarks saturate what they talk to; they must never be pointed at a shared server.
    if host is not None and host not in LOOPBACK and not host.startswith("/"):
        raise BenchError(f"{kind} host is {host!r}: benchmarks talk to 127.0.0.1 only")


def redis_db_url(base: str, index: int) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/{index}", parts.query, ""))


# A worker and all its live descendants (pool children), for memory and victim look-ups.
worker_pids = process_tree


@dataclass
class Proc(ClusterProcess):
    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return super().log_tail(lines)


async def poll(
    probe: Callable[[], Awaitable[T | None]], *, within: float, interval: float, what: str,
    check: Callable[[], None] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than None/False; BenchError after ``within`` s."""
    return await poll_until(probe, within=within, interval=interval, what=what, check=check, error=BenchError)


class BenchEnv:
    """One run's private resources. Use ``async with BenchEnv(...) as env``."""

    def __init__(self, workload: str, opts: CommonOptions) -> None:
        admin = make_url(opts.admin_url)
        _require_loopback("PostgreSQL", admin.host or admin.query.get("host"))  # type: ignore[arg-type]
        _require_loopback("Redis", urlsplit(opts.redis_url).hostname)
        self.workload = workload
        self.opts = opts
        self.admin_url = opts.admin_url
        self.broker = redis_db_url(opts.redis_url, opts.redis_db)
        self.redis = redis_sync.Redis.from_url(self.broker)
        # Where task messages go: this Redis DB, or a RabbitMQ vhost of the run's own (use_rabbitmq);
        # the readiness fact, the metrics and the bench's own counters stay on the Redis DB.
        self.transport = self.broker
        self.vhost: PrivateVhost | None = None
        self.dir = Path(tempfile.mkdtemp(prefix=f"dtask-bench-{workload}-"))
        self.databases: list[str] = []
        self.cluster = Cluster(self.dir, Proc)
        self.procs = self.cluster.procs
        self._celery: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> BenchEnv:
        # `kill <bench>` must clean up like Ctrl-C does: the workers run in their own sessions and
        # would outlive us. Cancelling the run lets every finally (and close()) run.
        task = asyncio.current_task()
        if task is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
                self._loop = asyncio.get_running_loop()
        try:
            keys = self.redis.dbsize()
        except redis_sync.RedisError as exc:
            await self.close()
            raise BenchError(f"Redis at {self.broker} does not answer: {exc}") from exc
        if keys and not self.opts.flush_redis:
            await self.close(flush=False)
            raise BenchError(
                f"Redis DB index {self.opts.redis_db} holds {keys} keys that may belong to someone else; "
                "choose another --redis-db or pass --flush-redis"
            )
        self.redis.flushdb()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, *, flush: bool = True) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGTERM)
            self._loop = None
        for proc in self.procs:
            proc.kill_group()
        self.procs.clear()
        if self._celery is not None:
            with contextlib.suppress(Exception):
                self._celery.close()
        if self.vhost is not None:
            try:
                await asyncio.to_thread(self.vhost.delete)
            except Exception as exc:
                print(f"dtask bench: could not delete vhost {self.vhost.name}: {exc!r}", file=sys.stderr)
            self.vhost = None
        for name in self.databases:
            try:
                await asyncio.to_thread(_drop, self.admin_url, name)
            except Exception as exc:  # keep releasing the rest
                print(f"dtask bench: could not drop database {name}: {exc!r}", file=sys.stderr)
        self.databases.clear()
        if flush:
            with contextlib.suppress(redis_sync.RedisError):
                self.redis.flushdb()
        self.redis.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ PostgreSQL

    async def create_database(self, label: str) -> str:
        """A fresh database with a random name, migrated to head; dropped by ``close()``."""
        from alembic import command

        from tasks_core.db import alembic_config
        from tasks_core.devkit.embedded import create_database

        name = f"dtask_bench_{label}_{uuid.uuid4().hex[:10]}"
        url = await asyncio.to_thread(create_database, self.admin_url, name)
        self.databases.append(name)
        # Alembic's env runs its own event loop, so it gets a thread of its own.
        await asyncio.to_thread(command.upgrade, alembic_config(url), "head")
        return url

    # ------------------------------------------------------------------ Redis / Celery

    async def use_rabbitmq(self, base_url: str) -> str:
        """Carry task messages through a vhost of this run's own on the (local) RabbitMQ at
        ``base_url``, made now and deleted by ``close()``; returns its name."""
        from tasks_core.devkit.rabbitmq import RabbitMQError

        try:
            vhost = PrivateVhost(base_url, prefix=f"dtask_bench_{self.workload}")
            self.vhost = vhost
            self.transport = await asyncio.to_thread(vhost.create)
        except RabbitMQError as exc:
            raise BenchError(str(exc)) from exc
        return vhost.name

    @property
    def celery(self) -> Any:
        """A Celery app with the project's transport settings, pointed at this run's broker.

        Used to publish (through ``CeleryTransport``) and for remote control (ping, consumers). It
        is not ``tasks_core.celery_app.app``, whose broker comes from the caller's environment.
        """
        if self._celery is None:
            self._celery = celery_on(self.transport, "dtask_bench_client")
        return self._celery

    def celery_settings(self) -> dict[str, Any]:
        conf = self.celery.conf
        return {key: conf.get(key) for key in CELERY_KEYS}

    def clear_queues(self) -> None:
        """Drop queued messages left by a previous round (kombu's bindings stay, workers need them)."""
        if self.transport != self.broker:  # RabbitMQ: our queues, in a vhost nobody else uses
            self.celery.control.purge()
        for pattern in ("durable*", "duties*", "unacked*", "dtask:bench:*"):
            for key in self.redis.scan_iter(pattern):
                self.redis.delete(key)

    # ------------------------------------------------------------------ processes

    def process_env(self, settings: Mapping[str, str]) -> dict[str, str]:
        """The caller's environment without any DTASK_* variable, plus exactly ``settings``.

        Stripping DTASK_* makes the recorded settings the complete truth about what ran.
        """
        return process_env(settings)

    def dtask_settings(self, db_url: str | None, **overrides: Any) -> dict[str, str]:
        """DTASK_* variables for a worker/beat process on this run's database and Redis DB. A
        bench is one tenant measuring the whole capacity: its running limit is the capacity (by
        default an owner leaves half of it to others), unless the bench sets one."""
        if "capacity" in overrides:
            overrides.setdefault("owner_max_running", overrides["capacity"])
        settings = {"DTASK_BROKER_URL": self.transport, "DTASK_REDIS_URL": self.broker}
        if db_url is not None:
            settings["DTASK_DATABASE_URL"] = db_url
        settings.update({f"DTASK_{k.upper()}": str(v) for k, v in overrides.items()})
        return settings

    def spawn(self, name: str, argv: list[str], settings: Mapping[str, str], node: str | None = None) -> Proc:
        # Own process group: one kill reaches the pool children too, and the terminal's Ctrl-C
        # reaches only the bench, whose finally then kills the group.
        return self.cluster.spawn(name, argv, self.process_env(settings), node=node)

    def start_worker(
        self,
        name: str,
        settings: Mapping[str, str],
        *,
        concurrency: int,
        app: str = "tasks_core.celery_app",
        queues: Sequence[str] = ("durable", "duties"),
        pool: str = "prefork",
    ) -> Proc:
        node = f"{name}-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
        return self.cluster.start_worker(
            name, self.process_env(settings), node=node, concurrency=concurrency, pool=pool, queues=queues,
            loglevel=WORKER_LOGLEVEL, app=app,
        )

    def start_beat(self, settings: Mapping[str, str], name: str = "beat") -> Proc:
        return self.cluster.start_beat(name, self.process_env(settings), loglevel=WORKER_LOGLEVEL)

    def start_api(self, settings: Mapping[str, str], port: int, name: str = "api") -> Proc:
        """``dtask api`` on 127.0.0.1:``port``."""
        return self.cluster.start_api(name, self.process_env(settings), port=port)

    def kill(self, proc: Proc) -> None:
        proc.kill_group()
        if proc in self.procs:
            self.procs.remove(proc)

    def check_alive(self, *procs: Proc) -> None:
        for proc in procs:
            if not proc.alive():
                raise BenchError(
                    f"{proc.name} exited with {proc.popen.returncode}; last log lines:\n{proc.log_tail()}"
                )

    async def wait_ready(self, proc: Proc, within: float = STARTUP_TIMEOUT) -> float:
        """Seconds until the worker answers a ping addressed to its own node name."""
        return await self.cluster.wait_answers_ping(
            self.celery, proc, within=within, interval=0.1, check=lambda: self.check_alive(proc),
            error=BenchError,
        )

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log_tail()}" for p in self.procs)


def _drop(admin_url: str, name: str) -> None:
    from tasks_core.devkit.embedded import drop_database

    drop_database(admin_url, name)


# ---------------------------------------------------------------------------- the durable client side


def client_settings(db_url: str, broker: str, redis: str | None = None, **overrides: Any) -> Settings:
    """Settings for the in-process submitter, independent of the caller's DTASK_* environment (its
    running limit is the capacity, as the workers' are: see BenchEnv.dtask_settings)."""
    settings = Settings(_env_file=None, database_url=db_url, broker_url=broker, redis_url=redis or broker,  # type: ignore[call-arg]
                        **overrides)
    if "owner_max_running" not in overrides:
        settings.owner_max_running = settings.capacity
    return settings


def durable_services(env: BenchEnv, db_url: str, *, pool_size: int = 5, **overrides: Any) -> Any:
    """Services whose transport publishes to this run's broker (not the caller's)."""
    from tasks_core.services import build_services
    from tasks_core.transport import CeleryTransport

    return build_services(
        client_settings(db_url, env.transport, env.broker, **overrides),
        transport=CeleryTransport(env.celery), pool_size=pool_size,
    )


async def submit(services: Any, task_type: str, payloads: Sequence[dict[str, Any]]) -> list[uuid.UUID]:
    """Submit through the real submission API, in batches; every id must have been published."""
    from tasks_core.submission import Submitter, TaskIntent

    submitter = Submitter(services)
    ids: list[uuid.UUID] = []
    for start in range(0, len(payloads), SUBMIT_BATCH):
        batch = [TaskIntent(task_type, p) for p in payloads[start:start + SUBMIT_BATCH]]
        for outcome in await submitter.submit_many(batch, owner="bench"):
            if isinstance(outcome, Exception):
                raise BenchError(f"submission refused: {outcome}")
            if outcome.publish_error:  # not published, but no error: sent later as slots free
                raise BenchError(f"publish failed: {outcome.publish_error}")
            ids.append(outcome.task_id)
    return ids


async def count_by_status(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT status, count(*) FROM tasks GROUP BY status"))).all()
    return {status: int(n) for status, n in rows}


async def wait_terminal(
    env: BenchEnv, engine: AsyncEngine, expected: int, *, procs: Sequence[Proc], stall_seconds: float,
    interval: float = 0.1, ids: Sequence[uuid.UUID] | None = None,
) -> None:
    """Until ``expected`` tasks (all rows, or just ``ids``) are terminal.

    Fails when the count stops moving for ``stall_seconds`` or a process dies, with the log tails,
    rather than hanging a benchmark forever.
    """
    last, last_change = -1, time.monotonic()
    query = text(
        f"SELECT count(*) FROM tasks WHERE status IN {TERMINAL_SQL}"
        + ("" if ids is None else " AND id = ANY(:ids)")
    )
    params = {} if ids is None else {"ids": list(ids)}
    while True:
        env.check_alive(*procs)
        async with engine.connect() as conn:
            done = int((await conn.execute(query, params)).scalar_one())
        if done >= expected:
            return
        now = time.monotonic()
        if done != last:
            last, last_change = done, now
        elif now - last_change > stall_seconds:
            states = await count_by_status(engine)
            raise BenchError(
                f"no task finished for {stall_seconds:g} s ({done} of {expected} terminal, {states});\n"
                + env.logs()
            )
        await asyncio.sleep(interval)


async def wait_running(
    env: BenchEnv, engine: AsyncEngine, ids: Sequence[uuid.UUID], *, procs: Sequence[Proc], within: float
) -> None:
    query = text("SELECT count(*) FROM tasks WHERE id = ANY(:ids) AND status = 'running'")

    async def all_running() -> bool:
        async with engine.connect() as conn:
            n = (await conn.execute(query, {"ids": list(ids)})).scalar_one()
        return int(n) == len(ids)

    await poll(all_running, within=within, interval=0.05, what=f"{len(ids)} tasks to be running",
               check=lambda: env.check_alive(*procs))


async def reset_tables(engine: AsyncEngine) -> None:
    """Empty the task tables between rounds, after ending every session a killed worker left."""
    async with engine.connect() as conn:
        await conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ))
        await conn.commit()
    # The engine's other pooled connections may just have been terminated: start afresh.
    await engine.dispose()
    async with engine.begin() as conn:
        await conn.execute(text(
            "TRUNCATE tasks, task_attempts, task_slots, diagnostics_runs, diagnostics_effects CASCADE"
        ))


def seconds(delta: Any) -> float:
    return float(delta.total_seconds())
