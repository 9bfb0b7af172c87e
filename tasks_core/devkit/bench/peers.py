"""Peer task queues, each on its natural store, for the same no-op work as the durable path.

- **Procrastinate** (PostgreSQL only): installed into the project's venv by the ``bench`` extra
  (``pip install -e .[bench]``). Its worker is ``procrastinate worker`` on
  ``tasks_core.devkit.bench.procrastinate_app``; its schema goes into the run's temporary database.
- **arq** (Redis): pins ``redis<6``, which conflicts with the ``redis`` this project runs on, so it
  lives in a venv of its own made by ``scripts/bench-peers`` (``.venv-peers``, or
  ``$DTASK_BENCH_PEERS_PYTHON``). Worker and enqueuer run there (``tasks_core/devkit/bench/arq_peer.py``
  imports nothing but arq and the standard library).

Where a peer is missing, the run says so in one line and goes on without it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from tasks_core.db import db_now
from tasks_core.devkit.bench.common import ROOT, BenchEnv, BenchError, Proc, poll, seconds

PROCRASTINATE_MISSING = "procrastinate is not installed (pip install -e .[bench]): its variants were skipped"
ARQ_MISSING = "arq is not installed (scripts/bench-peers makes .venv-peers): its variant was skipped"
PEERS_PYTHON_ENV = "DTASK_BENCH_PEERS_PYTHON"
PROCRASTINATE_DSN_ENV = "DTASK_BENCH_PROCRASTINATE_DSN"
ARQ_SCRIPT = Path(__file__).with_name("arq_peer.py")


@dataclass
class Installed:
    """The peers a run can include: Procrastinate's version, the arq venv's interpreter and arq's
    version (None where missing), and one line per missing peer for the result's notes."""

    procrastinate: str | None = None
    arq_python: str | None = None
    arq: str | None = None
    missing: list[str] = field(default_factory=list)


def installed(wanted: bool = True) -> Installed:
    """Which peers can run (none unless ``wanted``); each missing one is said in one line on stderr."""
    if not wanted:
        return Installed()
    python = peers_python()
    found = Installed(procrastinate_version(), python, arq_version(python) if python else None)
    found.missing = [line for absent, line in ((found.procrastinate is None, PROCRASTINATE_MISSING),
                                               (python is None, ARQ_MISSING)) if absent]
    for line in found.missing:
        print(f"dtask bench: {line}", file=sys.stderr)
    return found


def procrastinate_version() -> str | None:
    try:
        return importlib.metadata.version("procrastinate")
    except importlib.metadata.PackageNotFoundError:
        return None


def libpq_dsn(sqlalchemy_url: str) -> str:
    """The same database as a plain libpq URL (psycopg, pgbench)."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


class Procrastinate:
    """Procrastinate's app on the run's database: schema, defers, its worker, its clock."""

    def __init__(self, db_url: str) -> None:
        self.dsn = libpq_dsn(db_url)
        os.environ[PROCRASTINATE_DSN_ENV] = self.dsn  # read by procrastinate_app at import
        from tasks_core.devkit.bench import procrastinate_app

        self.module = procrastinate_app
        self.app = procrastinate_app.make_app(self.dsn)
        self.task = self.app.tasks[procrastinate_app.NOOP]
        self._schema = False

    async def open(self) -> None:
        await self.app.open_async()
        if not self._schema:
            await self.app.schema_manager.apply_schema_async()
            self._schema = True

    async def close(self) -> None:
        await self.app.close_async()

    async def truncate(self, engine: Any) -> None:
        async with engine.begin() as conn:
            await conn.execute(text("TRUNCATE procrastinate_jobs, procrastinate_workers CASCADE"))

    async def defer_round(self, n: int, *, batch: int) -> dict[str, Any]:
        """Defer ``n`` no-ops one by one (batch 1) or with ``batch_defer_async``; intents/s."""
        started = time.perf_counter()
        done = 0
        while done < n:
            size = min(batch, n - done)
            if batch == 1:
                await self.task.defer_async()
            else:
                await self.task.batch_defer_async(*({} for _ in range(size)))
            done += size
        elapsed = time.perf_counter() - started
        return {"intents": n, "seconds": elapsed, "intents_per_s": n / elapsed, "refused": 0, "failed": 0}

    def start_worker(self, env: BenchEnv, concurrency: int) -> Proc:
        app = "tasks_core.devkit.bench.procrastinate_app.app"
        argv = [sys.executable, "-m", "procrastinate", "--app", app,
                "worker", "--concurrency", str(concurrency), "--name", "bench"]
        return env.spawn("procrastinate", argv, {PROCRASTINATE_DSN_ENV: self.dsn})

    async def throughput_round(
        self, env: BenchEnv, engine: Any, *, tasks: int, warmup: int, concurrency: int, stall_seconds: float
    ) -> dict[str, Any]:
        """Defer ``tasks`` no-ops in batches of 1,000 to a running worker; first defer -> last success."""
        await self.truncate(engine)
        proc = self.start_worker(env, concurrency)
        try:
            startup = await self.wait_ready(env, engine, proc)
            if warmup:
                await self.defer_round(warmup, batch=1000)
                await self._wait_done(env, engine, warmup, proc, stall_seconds)
            t0 = await db_now(engine)
            await self.defer_round(tasks, batch=1000)
            last = await self._wait_done(env, engine, warmup + tasks, proc, stall_seconds)
        finally:
            env.kill(proc)
        elapsed = seconds(last - t0)
        return {"tasks": tasks, "seconds": elapsed, "tasks_per_s": tasks / elapsed,
                "worker_startup_seconds": startup, "argv": proc.argv}

    async def latency_round(
        self, env: BenchEnv, engine: Any, *, samples: int, warmup: int, concurrency: int, stall_seconds: float
    ) -> tuple[dict[str, Any], list[float], list[float]]:
        """Idle latency on a fresh worker: one no-op at a time, ``defer_async`` then wait for its
        success. From the job's own events (PostgreSQL's clock): deferred -> started, -> succeeded."""
        await self.truncate(engine)
        proc = self.start_worker(env, concurrency)
        ids: list[int] = []
        try:
            startup = await self.wait_ready(env, engine, proc)
            if warmup:
                await self.defer_round(warmup, batch=1000)
                await self._wait_done(env, engine, warmup, proc, stall_seconds, interval=0.002)
            for i in range(samples):
                ids.append(await self.task.defer_async())
                await self._wait_done(env, engine, warmup + i + 1, proc, stall_seconds, interval=0.002)
        finally:
            env.kill(proc)
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                """SELECT d.at AS deferred, s.at AS started, f.at AS succeeded
                     FROM procrastinate_events d
                     JOIN procrastinate_events s ON s.job_id = d.job_id AND s.type = 'started'
                     JOIN procrastinate_events f ON f.job_id = d.job_id AND f.type = 'succeeded'
                    WHERE d.type = 'deferred' AND d.job_id = ANY(:ids)"""), {"ids": ids})).all()
        running = [seconds(r.started - r.deferred) * 1000 for r in rows]
        terminal = [seconds(r.succeeded - r.deferred) * 1000 for r in rows]
        data = {"samples": len(ids), "succeeded": len(rows), "worker_startup_seconds": startup,
                "argv": proc.argv}
        return data, running, terminal

    async def wait_ready(self, env: BenchEnv, engine: Any, proc: Proc) -> float:
        """Seconds until the worker has registered itself and LISTENs for new jobs: it registers
        first, and a defer before its LISTEN waits for the 5 s poll instead of the notification."""
        started = time.monotonic()
        await poll(lambda: self._worker_registered(engine), within=60, interval=0.1,
                   what="the procrastinate worker", check=lambda: env.check_alive(proc))
        await poll(lambda: self._listening(engine), within=60, interval=0.05,
                   what="the procrastinate worker's LISTEN", check=lambda: env.check_alive(proc))
        return time.monotonic() - started

    async def _listening(self, engine: Any) -> bool:
        # Only this run's worker connects to this database with a LISTEN (the bench's own pool
        # defers); a previous round's worker is SIGKILLed, so its backend is gone by now.
        async with engine.connect() as conn:
            return bool((await conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query LIKE 'LISTEN %procrastinate%'"))).scalar_one())

    async def defer_sleeps(self, n: int, seconds: float) -> None:
        """``n`` jobs that each sleep ``seconds`` (`dtask bench density`), in one batch."""
        task = self.app.tasks[self.module.SLEEP]
        await task.batch_defer_async(*({"seconds": seconds} for _ in range(n)))

    async def running(self, engine: Any) -> int:
        """Jobs a worker has taken and not finished."""
        async with engine.connect() as conn:
            return int((await conn.execute(
                text("SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'"))).scalar_one())

    async def _worker_registered(self, engine: Any) -> bool:
        async with engine.connect() as conn:
            return bool((await conn.execute(text("SELECT count(*) FROM procrastinate_workers"))).scalar_one())

    async def _wait_done(
        self, env: BenchEnv, engine: Any, n: int, proc: Proc, stall_seconds: float, interval: float = 0.05
    ) -> Any:
        """Until ``n`` jobs succeeded; the time of the last success (PostgreSQL's clock)."""
        last_count, last_change = -1, time.monotonic()
        while True:
            env.check_alive(proc)
            async with engine.connect() as conn:
                done, failed, last = (await conn.execute(text(
                    "SELECT count(*) FILTER (WHERE type = 'succeeded'),"
                    " count(*) FILTER (WHERE type = 'failed'),"
                    " max(at) FILTER (WHERE type = 'succeeded') FROM procrastinate_events"
                ))).one()
            if failed:
                raise BenchError(f"{failed} procrastinate jobs failed;\n{proc.log_tail()}")
            if done >= n:
                return last
            if done != last_count:
                last_count, last_change = done, time.monotonic()
            elif time.monotonic() - last_change > stall_seconds:
                raise BenchError(f"procrastinate: {done} of {n} done, stalled;\n{proc.log_tail()}")
            await asyncio.sleep(interval)


# ------------------------------------------------------------------------------------------ arq


def peers_python() -> str | None:
    """The interpreter of the peers venv, if it has arq."""
    candidate = os.environ.get(PEERS_PYTHON_ENV) or str(ROOT / ".venv-peers" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    probe = subprocess.run([candidate, "-c", "import arq, sys; sys.stdout.write(arq.VERSION)"],
                           capture_output=True, text=True, timeout=60)
    return candidate if probe.returncode == 0 else None


def arq_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import arq, sys; sys.stdout.write(arq.VERSION)"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


async def arq_round(
    env: BenchEnv, python: str, *, tasks: int, warmup: int, concurrency: int, stall_seconds: float
) -> dict[str, Any]:
    """An ``arq`` worker (one process, ``max_jobs`` = concurrency, other settings at arq's defaults);
    the bench enqueues through arq's own client, in the peers venv. First enqueue -> last completion."""
    proc, settings = start_arq_worker(env, python, concurrency)
    argv = proc.argv
    try:
        startup = await wait_arq_ready(env, proc)
        if warmup:
            await _arq_batch(env, python, settings, warmup, proc, stall_seconds)
        t0, last = await _arq_batch(env, python, settings, tasks, proc, stall_seconds)
    finally:
        env.kill(proc)
    elapsed = last - t0
    return {"tasks": tasks, "seconds": elapsed, "tasks_per_s": tasks / elapsed,
            "worker_startup_seconds": startup, "argv": argv}


def start_arq_worker(env: BenchEnv, python: str, concurrency: int) -> tuple[Proc, dict[str, str]]:
    """A fresh arq worker with ``max_jobs`` = concurrency on an empty arq keyspace; its settings."""
    env.clear_queues()
    for key in env.redis.scan_iter("arq:*"):  # a previous round's queue, results and health key
        env.redis.delete(key)
    settings = {"DTASK_BENCH_ARQ_REDIS": env.broker, "DTASK_BENCH_ARQ_MAX_JOBS": str(concurrency)}
    return env.spawn("arq", [python, str(ARQ_SCRIPT), "worker"], settings), settings


async def wait_arq_ready(env: BenchEnv, proc: Proc) -> float:
    started = time.monotonic()
    await poll(lambda: _arq_ready(env), within=60, interval=0.1, what="the arq worker",
               check=lambda: env.check_alive(proc))
    return time.monotonic() - started


async def arq_enqueue(env: BenchEnv, python: str, settings: dict[str, str], *args: str) -> float:
    """Run arq_peer.py's enqueuer (``N`` no-ops, or ``N S`` sleeps); when it began, wall clock."""
    return float((await _arq_client(env, python, settings, "enqueue", *args))["started"])


async def _arq_client(env: BenchEnv, python: str, settings: dict[str, str], *args: str) -> dict[str, Any]:
    """Run arq_peer.py as arq's client in the peers venv; the JSON it prints."""
    client = await asyncio.create_subprocess_exec(
        python, str(ARQ_SCRIPT), *args, env=env.process_env(settings),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=env.dir,
    )
    out, err = await client.communicate()
    if client.returncode != 0:
        raise BenchError(f"arq {args[0]} failed: {err.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


async def arq_latency_round(
    env: BenchEnv, python: str, *, samples: int, warmup: int, concurrency: int
) -> tuple[dict[str, Any], list[float]]:
    """Idle latency on a fresh arq worker at its defaults (it polls its queue every 0.5 s): one no-op
    at a time, enqueue -> the job's own time stamp (wall clock, ms)."""
    proc, settings = start_arq_worker(env, python, concurrency)
    try:
        startup = await wait_arq_ready(env, proc)
        if warmup:
            await _arq_client(env, python, settings, "latency", str(warmup))
        running = (await _arq_client(env, python, settings, "latency", str(samples)))["running_ms"]
    finally:
        env.kill(proc)
    return {"samples": len(running), "succeeded": len(running), "worker_startup_seconds": startup,
            "argv": proc.argv}, running


async def _arq_ready(env: BenchEnv) -> bool:
    # arq's worker writes its health-check key once it polls the queue.
    return any(True for _ in env.redis.scan_iter("arq:queue:health-check*"))


async def _arq_batch(
    env: BenchEnv, python: str, settings: dict[str, str], n: int, proc: Proc, stall_seconds: float
) -> tuple[float, float]:
    from tasks_core.devkit.bench.arq_peer import DONE_KEY, LAST_KEY

    env.redis.delete(DONE_KEY, LAST_KEY)
    t0 = await arq_enqueue(env, python, settings, str(n))

    async def done() -> bool:
        return int(env.redis.get(DONE_KEY) or 0) >= n

    await poll(done, within=stall_seconds + n / 100, interval=0.02, what=f"{n} arq no-ops",
               check=lambda: env.check_alive(proc))
    return t0, float(env.redis.get(LAST_KEY) or 0)
