"""`dtask bench soak`: 20 thousand no-ops through one worker; does its memory stay put?

Memory is the resident set of the worker's main process plus all its pool children, summed from
/proc (``VmRSS``), sampled when the worker is ready (idle), after a warm-up, every few seconds while
tasks flow, and when the last one is done. Forked children share pages, so the RSS sum counts shared
pages once per process; PSS (``smaps_rollup``) splits them fairly and is recorded beside it.
Variants, in alternating rounds: ``durable`` (``diagnostics.noop`` through the real path) and
``plain-celery`` (the plain no-op app, same settings), so growth can be told from Celery's own.

Children are recycled every ``worker_max_tasks_per_child`` tasks (celeryconfig), which bounds any
per-child growth; the main process is never recycled, so its line matters most.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from tasks_core.devkit.bench import plain_app
from tasks_core.devkit.bench.common import (
    TERMINAL_SQL,
    BenchEnv,
    BenchError,
    CommonOptions,
    Proc,
    durable_services,
    effective_settings,
    public_options,
    reset_tables,
    submit,
    wait_terminal,
    worker_pids,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio

NOOP = "diagnostics.noop"


@dataclass
class SoakOptions(CommonOptions):
    tasks: int = 20_000
    warmup: int = 200
    capacity: int = 4
    concurrency: int = 6
    sample_seconds: float = 5.0
    stall_seconds: float = 120.0
    rounds: int = 1  # one long round per variant is the point of a soak


QUICK = {"tasks": 200, "warmup": 20, "sample_seconds": 0.5, "rounds": 1, "capacity": 2, "concurrency": 3,
         "stall_seconds": 30.0}


def run(opts: SoakOptions) -> dict[str, Any]:
    return asyncio.run(_run(opts))


def memory_kb(root_pid: int) -> dict[str, int]:
    """RSS and PSS (kB) of a process and its descendants, and how many processes that is."""
    rss = pss = n = 0
    for pid in worker_pids(root_pid):
        with contextlib.suppress(OSError, ValueError, StopIteration):
            with open(f"/proc/{pid}/status") as f:
                rss += int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
            n += 1
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += int(next(line for line in f if line.startswith("Pss:")).split()[1])
    return {"rss_kb": rss, "pss_kb": pss, "processes": n}


async def _run(opts: SoakOptions) -> dict[str, Any]:
    variants = {
        "durable": f"{opts.tasks:,} diagnostics.noop through one worker (prefork -c {opts.concurrency}, "
                   f"capacity {opts.capacity})",
        "plain-celery": f"{opts.tasks:,} plain Celery no-ops, same settings, prefork -c {opts.concurrency}",
    }
    doc = Document("soak", public_options(opts), quick=opts.quick)
    rounds = Rounds(variants)
    async with BenchEnv("soak", opts) as env:
        db_url = await env.create_database("soak")
        services = durable_services(env, db_url, capacity=opts.capacity)
        settings = env.dtask_settings(db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency)
        doc.settings.update(worker_env=effective_settings(settings), celery=env.celery_settings())
        try:
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                env.clear_queues()
                if name == "durable":
                    await reset_tables(services.engine)
                    proc = env.start_worker("durable", settings, concurrency=opts.concurrency)
                    counter = _durable_counter(services)
                else:
                    proc = env.start_worker("plain", env.dtask_settings(None), concurrency=opts.concurrency,
                                            app="tasks_core.devkit.bench.plain_app")
                    counter = _plain_counter(env)
                try:
                    data, series = await _round(env, services, opts, name, proc, counter)
                finally:
                    env.kill(proc)
                rounds.add(name, round_no, seq, data)
                rounds.extra[name].setdefault("series", []).append(series)
        finally:
            await services.close()
    doc.data["variants"] = rounds.to_json()
    rows = []
    for name in variants:
        m = rounds.medians(name)
        rows.append([name, m.get("rss_start_mb"), m.get("rss_warm_mb"), m.get("rss_end_mb"),
                     m.get("rss_growth_mb"), m.get("pss_growth_mb"), m.get("tasks_per_s")])
    for name in variants:
        doc.data["ratios"][f"{name}: rss end / warm"] = ratio(
            rounds.median(name, "rss_end_mb"), rounds.median(name, "rss_warm_mb"))
    doc.data["ratios"]["durable / plain-celery (rss at end)"] = ratio(
        rounds.median("durable", "rss_end_mb"), rounds.median("plain-celery", "rss_end_mb"))
    doc.table(f"soak: worker memory (MB, main + children), {opts.tasks:,} tasks",
              ["variant", "rss idle", "rss warm", "rss end", "rss growth", "pss growth", "tasks/s"], rows)
    doc.note("growth = end minus after warm-up; children are recycled every worker_max_tasks_per_child "
             "tasks, so a sample can land just after a recycle")
    return doc.finish()


def _durable_counter(services: Any) -> Any:
    query = text(f"SELECT count(*) FROM tasks WHERE status IN {TERMINAL_SQL}")

    async def done() -> int:
        async with services.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    return done


def _plain_counter(env: BenchEnv) -> Any:
    async def done() -> int:
        return int(env.redis.get(plain_app.DONE_KEY) or 0)

    return done


async def _round(
    env: BenchEnv, services: Any, opts: SoakOptions, variant: str, proc: Proc, done: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    await env.wait_ready(proc)

    async def feed(n: int) -> None:
        if variant == "durable":
            await submit(services, NOOP, [{}] * n)
        else:
            await asyncio.to_thread(plain_app.publish, env.celery, n)

    async def drain(total: int) -> None:
        if variant == "durable":
            await wait_terminal(env, services.engine, total, procs=[proc], stall_seconds=opts.stall_seconds,
                                interval=0.2)
        else:
            await _wait_count(env, proc, done, total, opts.stall_seconds)

    start = memory_kb(proc.pid)
    await feed(opts.warmup)
    await drain(opts.warmup)
    warm = memory_kb(proc.pid)
    series: list[dict[str, Any]] = []
    t0 = time.monotonic()
    feeder = asyncio.create_task(feed(opts.tasks))
    total = opts.warmup + opts.tasks
    try:
        while True:
            if feeder.done():
                feeder.result()  # a failed submission ends the round with its error
            count = await done()
            series.append({"t": round(time.monotonic() - t0, 2), "done": count - opts.warmup,
                           **memory_kb(proc.pid)})
            if count >= total:
                break
            env.check_alive(proc)
            await _stalled(series, opts.stall_seconds, env)
            await asyncio.sleep(opts.sample_seconds)
    finally:
        if not feeder.done():
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
    await drain(total)
    elapsed = time.monotonic() - t0
    end = memory_kb(proc.pid)
    mb = 1 / 1024
    data = {
        "tasks": opts.tasks,
        "seconds": elapsed,
        "tasks_per_s": opts.tasks / elapsed,
        "rss_start_mb": start["rss_kb"] * mb,
        "rss_warm_mb": warm["rss_kb"] * mb,
        "rss_end_mb": end["rss_kb"] * mb,
        "rss_peak_mb": max(s["rss_kb"] for s in series) * mb,
        "rss_growth_mb": (end["rss_kb"] - warm["rss_kb"]) * mb,
        "pss_warm_mb": warm["pss_kb"] * mb,
        "pss_end_mb": end["pss_kb"] * mb,
        "pss_growth_mb": (end["pss_kb"] - warm["pss_kb"]) * mb,
        "processes": end["processes"],
    }
    return data, series


async def _stalled(series: list[dict[str, Any]], stall_seconds: float, env: BenchEnv) -> None:
    moved = [s for s in series if s["done"] != series[-1]["done"]]
    since = series[-1]["t"] - (moved[-1]["t"] if moved else series[0]["t"])
    if since > stall_seconds:
        raise BenchError(f"no task finished for {stall_seconds:g} s at {series[-1]['done']};\n{env.logs()}")


async def _wait_count(env: BenchEnv, proc: Proc, done: Any, total: int, stall_seconds: float) -> None:
    last, since = -1, time.monotonic()
    while (count := await done()) < total:
        env.check_alive(proc)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since > stall_seconds:
            raise BenchError(f"plain worker stalled at {count} of {total};\n{env.logs()}")
        await asyncio.sleep(0.05)
