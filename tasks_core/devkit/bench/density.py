"""`dtask bench density`: what many concurrent long, waiting tasks cost a worker.

For each N (10, 100, 200 by default) and each mode — ``prefork`` (a process per task) and
``dense`` (``--pool threads``: every task on one process's event loop) — a fresh worker with
concurrency N (+2 for the duties, like `dtask worker`'s default) and DTASK_CAPACITY = N runs N
``diagnostics.sleep`` tasks at once. Measured: the worker's memory once idle and once all N run
(RSS and PSS summed over the main process and its pool children; PSS splits shared pages fairly, so
it is the honest figure for prefork's copy-on-write children), the memory per extra running task,
and the seconds from the submission until all N are running. The modes alternate round by round.

Beside them, ``prefork-noop`` and ``dense-noop`` drain ``noop_tasks`` no-ops through each mode at the
same concurrency and capacity (``noop_concurrency``): the dense mode must not buy its memory with
throughput.

Peers, where installed (as in `dtask bench throughput`): ``procrastinate-N`` and ``arq-N`` run N jobs
that each ``asyncio.sleep`` for the same time on one worker process with concurrency N, measured the
same way (the worker's memory with the same function; seconds from the first defer/enqueue until all
N have started: Procrastinate's jobs in status ``doing``, arq's jobs counting their start in Redis).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from tasks_core.devkit.bench import peers
from tasks_core.devkit.bench.common import (
    BenchEnv,
    CommonOptions,
    Proc,
    durable_services,
    poll,
    public_options,
    reset_tables,
    submit,
    wait_running,
    worker_pids,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio
from tasks_core.devkit.bench.throughput import ThroughputOptions, durable_round

SLEEP = "diagnostics.sleep"
MODES = {"prefork": "prefork", "dense": "threads"}
PEERS = ("procrastinate", "arq")


@dataclass
class DensityOptions(CommonOptions):
    sizes: tuple[int, ...] = (10, 100, 200)
    # Long enough that all N are running at once when memory is read.
    sleep_seconds: float = 60.0
    rounds: int = 1
    stall_seconds: float = 120.0
    noop_tasks: int = 1000
    noop_concurrency: int = 8


QUICK = {"sizes": (4,), "sleep_seconds": 20.0, "rounds": 1, "stall_seconds": 60.0, "noop_tasks": 20,
         "noop_concurrency": 3}


def memory_mb(root_pid: int) -> dict[str, float]:
    """RSS and PSS of a worker: its main process and every pool child, in MiB."""
    rss = pss = 0
    for pid in worker_pids(root_pid):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:  # a child that just exited
            continue
    return {"rss_mb": rss / 1024, "pss_mb": pss / 1024}


# Connections a prefork child opens for one running task (the handler's writes and the heartbeat).
PREFORK_CONNECTIONS = 2


async def _free_connections(engine: Any) -> int:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    """SELECT current_setting('max_connections')::int
                              - current_setting('superuser_reserved_connections')::int
                              - (SELECT count(*) FROM pg_stat_activity)"""
                )
            )
        ).one()
    return int(row[0])


def run(opts: DensityOptions) -> dict[str, Any]:
    return asyncio.run(_run(opts))


async def _run(opts: DensityOptions) -> dict[str, Any]:
    variants = {
        f"{mode}-{n}": f"{n} concurrent {SLEEP} on one worker, --pool {pool} -c {n + 2}, capacity {n}"
        for n in opts.sizes
        for mode, pool in MODES.items()
    }
    for mode, pool in MODES.items():
        variants[f"{mode}-noop"] = (
            f"{opts.noop_tasks} diagnostics.noop on one worker, --pool {pool} -c {opts.noop_concurrency}, "
            f"capacity {opts.noop_concurrency}"
        )
    # Peers on their natural stores, where installed; a missing one is a note, not an error.
    found = peers.installed()
    pv, arq_python, arq_v = found.procrastinate, found.arq_python, found.arq
    for n in opts.sizes:
        if pv is not None:
            variants[f"procrastinate-{n}"] = (
                f"procrastinate {pv}: {n} concurrent asyncio.sleep jobs on one worker process with "
                f"--concurrency {n}; batch defer until all are `doing`")
        if arq_v is not None:
            variants[f"arq-{n}"] = (
                f"arq {arq_v}: {n} concurrent asyncio.sleep jobs on one worker process with max_jobs={n}; "
                "first enqueue until all have started")
    doc = Document("density", {**public_options(opts), "sizes": list(opts.sizes)}, quick=opts.quick)
    async with BenchEnv("density", opts) as env:
        db_url = await env.create_database("density")
        services = durable_services(env, db_url, capacity=max(opts.sizes))
        free = await _free_connections(services.engine)
        for size in opts.sizes:
            # Every prefork child holds database connections of its own (up to 4; 2 at rest):
            # past the server's max_connections the worker cannot run n tasks at all.
            need = PREFORK_CONNECTIONS * (size + 2)
            if need > free:
                variants.pop(f"prefork-{size}")
                doc.note(f"prefork-{size} not run: {size + 2} children need about {need} database "
                         f"connections, the server has {free} free (max_connections)")
        rounds = Rounds(variants)
        pq = peers.Procrastinate(db_url) if pv is not None else None
        try:
            if pq is not None:
                await pq.open()
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                mode, size_text = name.rsplit("-", 1)
                if mode == "procrastinate":
                    assert pq is not None
                    data = await _procrastinate_round(env, services, pq, opts, int(size_text))
                    doc.settings.setdefault("worker_argv", {})[name] = data.pop("argv")
                elif mode == "arq":
                    assert arq_python is not None
                    data = await _arq_round(env, arq_python, opts, int(size_text))
                    doc.settings.setdefault("worker_argv", {})[name] = data.pop("argv")
                elif size_text == "noop":
                    data = await _noop_round(env, services, db_url, opts, MODES[mode])
                    doc.settings.setdefault("worker_argv", {})[name] = data.pop("settings")["argv"]
                else:
                    data = await _round(env, services, db_url, opts, MODES[mode], int(size_text))
                    doc.settings.setdefault("worker_argv", {})[name] = data.pop("argv")
                rounds.add(name, round_no, seq, data)
        finally:
            if pq is not None:
                await pq.close()
            await services.close()
    for line in found.missing:
        doc.note(line)
    return _finish(doc, rounds, opts)


async def _round(
    env: BenchEnv, services: Any, db_url: str, opts: DensityOptions, pool: str, n: int
) -> dict[str, Any]:
    await reset_tables(services.engine)
    env.clear_queues()
    settings = env.dtask_settings(db_url, capacity=n)
    proc = env.start_worker(f"{pool}-{n}", settings, concurrency=n + 2, pool=pool)
    try:
        startup = await env.wait_ready(proc)
        await asyncio.sleep(1.0)  # let every pool child finish importing before the idle reading
        idle = memory_mb(proc.popen.pid)
        # Capacity n lets all n run; the submitter's budget publishes them all at once.
        started = time.monotonic()
        ids = await submit(services, SLEEP, [{"seconds": opts.sleep_seconds, "steps": 1}] * n)
        await wait_running(env, services.engine, ids, procs=[proc], within=opts.stall_seconds)
        to_running = time.monotonic() - started
        busy = memory_mb(proc.popen.pid)
    finally:
        env.kill(proc)
    return _sleeps_result(n, to_running, idle, busy, startup, proc)


async def _procrastinate_round(
    env: BenchEnv, services: Any, pq: peers.Procrastinate, opts: DensityOptions, n: int
) -> dict[str, Any]:
    # The Celery rounds' reset_tables terminates every session on the database, the bench's own
    # Procrastinate pool's too: a defer on those dead connections stalled for seconds. Reconnect.
    await pq.close()
    await pq.open()
    await pq.truncate(services.engine)
    proc = pq.start_worker(env, n)
    try:
        startup = await pq.wait_ready(env, services.engine, proc)
        await asyncio.sleep(1.0)  # as for the Celery workers: settle before the idle reading
        idle = memory_mb(proc.popen.pid)
        started = time.monotonic()
        await pq.defer_sleeps(n, opts.sleep_seconds)

        async def all_running() -> bool:
            return await pq.running(services.engine) >= n

        await poll(all_running, within=opts.stall_seconds, interval=0.02, what=f"{n} procrastinate sleeps",
                   check=lambda: env.check_alive(proc))
        to_running = time.monotonic() - started
        busy = memory_mb(proc.popen.pid)
    finally:
        env.kill(proc)
    return _sleeps_result(n, to_running, idle, busy, startup, proc)


async def _arq_round(env: BenchEnv, python: str, opts: DensityOptions, n: int) -> dict[str, Any]:
    from tasks_core.devkit.bench.arq_peer import STARTED_KEY

    proc, settings = peers.start_arq_worker(env, python, n)
    try:
        startup = await peers.wait_arq_ready(env, proc)
        await asyncio.sleep(1.0)
        idle = memory_mb(proc.popen.pid)
        env.redis.delete(STARTED_KEY)
        # The enqueuer reports when it began (wall clock), so its interpreter start is not counted.
        started = await peers.arq_enqueue(env, python, settings, str(n), repr(opts.sleep_seconds))

        async def all_started() -> bool:
            return int(env.redis.get(STARTED_KEY) or 0) >= n

        await poll(all_started, within=opts.stall_seconds, interval=0.02, what=f"{n} arq sleeps",
                   check=lambda: env.check_alive(proc))
        to_running = time.time() - started
        busy = memory_mb(proc.popen.pid)
    finally:
        env.kill(proc)
    return _sleeps_result(n, to_running, idle, busy, startup, proc)


def _sleeps_result(
    n: int, to_running: float, idle: dict[str, float], busy: dict[str, float], startup: float, proc: Proc
) -> dict[str, Any]:
    return {
        "tasks": n,
        "seconds_until_all_running": to_running,
        "idle_rss_mb": idle["rss_mb"],
        "idle_pss_mb": idle["pss_mb"],
        "running_rss_mb": busy["rss_mb"],
        "running_pss_mb": busy["pss_mb"],
        "rss_mb_per_task": busy["rss_mb"] / n,
        "pss_mb_per_task": busy["pss_mb"] / n,
        "worker_startup_seconds": startup,
        "argv": proc.argv,
    }


async def _noop_round(
    env: BenchEnv, services: Any, db_url: str, opts: DensityOptions, pool: str
) -> dict[str, Any]:
    noop = ThroughputOptions(tasks=opts.noop_tasks, warmup=min(50, opts.noop_tasks),
                             concurrency=opts.noop_concurrency, stall_seconds=opts.stall_seconds)
    return await durable_round(env, services, db_url, noop, opts.noop_concurrency, pool=pool)


def _finish(doc: Document, rounds: Rounds, opts: DensityOptions) -> dict[str, Any]:
    doc.data["variants"] = rounds.to_json()
    rows = []
    for n in opts.sizes:
        for mode in (*MODES, *PEERS):
            if f"{mode}-{n}" not in rounds.rounds:
                continue
            m = rounds.medians(f"{mode}-{n}")
            rows.append([
                f"{mode}-{n}", m.get("seconds_until_all_running"), m.get("running_rss_mb"),
                m.get("running_pss_mb"), m.get("pss_mb_per_task"), m.get("rss_mb_per_task"), None,
            ])
        dense = rounds.medians(f"dense-{n}")
        for other in ("prefork", *PEERS):
            if f"{other}-{n}" in rounds.rounds:
                doc.data["ratios"][f"{other}-{n} / dense-{n} (PSS per task)"] = ratio(
                    rounds.medians(f"{other}-{n}").get("pss_mb_per_task"), dense.get("pss_mb_per_task")
                )
    # Memory per *extra* task in the dense mode and each peer, between the smallest and the largest size.
    small, large = min(opts.sizes), max(opts.sizes)
    for mode in ("dense", *PEERS):
        if f"{mode}-{small}" not in rounds.rounds:
            continue
        lo, hi = rounds.medians(f"{mode}-{small}"), rounds.medians(f"{mode}-{large}")
        if lo.get("running_rss_mb") is None or hi.get("running_rss_mb") is None or large == small:
            continue
        # A difference, not a ratio (noise can make it slightly negative at quick sizes).
        per_task = (hi["running_rss_mb"] - lo["running_rss_mb"]) / (large - small)
        doc.data[f"{mode}_rss_mb_per_extra_task"] = per_task
        doc.note(f"{mode}: {per_task:.3f} MiB RSS per extra running task (between {small} and {large})")
    dense_noop, prefork_noop = rounds.medians("dense-noop"), rounds.medians("prefork-noop")
    doc.data["ratios"]["dense-noop / prefork-noop (tasks/s)"] = ratio(
        dense_noop.get("tasks_per_s"), prefork_noop.get("tasks_per_s")
    )
    for name, m in (("prefork-noop", prefork_noop), ("dense-noop", dense_noop)):
        rows.append([name, None, None, None, None, None, m.get("tasks_per_s")])
    doc.table(
        "density: N concurrent sleeps on one worker; no-op throughput per mode (medians over rounds)",
        ["variant", "s to all running", "RSS MiB", "PSS MiB", "PSS MiB/task", "RSS MiB/task", "no-ops/s"],
        rows,
    )
    doc.note("PSS divides pages shared by prefork's children among them; RSS counts them in each child")
    return doc.finish()
