"""`dtask bench latency`: how long a submitted no-op waits before it runs.

Submit-to-running is ``started_at - created_at`` of the row (both PostgreSQL's clock; ``created_at``
is the insert, so the commit, the publish, the broker hop and the claim are all inside it);
submit-to-terminal is ``finished_at - created_at``. Variants, in alternating rounds:

- ``idle``: nothing else runs; one no-op at a time.
- ``busy``: capacity - 1 long ``diagnostics.sleep`` tasks hold pool children and slots, one slot is
  free; one no-op at a time. Shows that nothing waits behind a long task (no prefetch).
- ``saturated``: the whole capacity is full of ``diagnostics.sleep`` tasks of S seconds; then the
  no-ops are submitted together and WAIT FOR A FREE SLOT (their claim is refused, the relay hands
  them the slots when the sleeps end). This is capacity queueing by design, not transport delay:
  expect about S. From the same rounds: the **relay hand-off**, from a task's terminal commit to the
  claim of the next task in the freed slot (p50/p99; see ``_handoffs``).

Peers, idle, one no-op at a time on a fresh worker each round (where installed; a missing one is a
note, not an error):

- ``plain-celery``: the same transport settings, pool and concurrency, no database; publish -> the
  task's own time stamp (wall clock). Its run is one Redis call, so only "to running" is reported.
- ``procrastinate``: ``defer_async`` -> its ``started`` and ``succeeded`` events (PostgreSQL's clock);
  its worker LISTENs, so a defer wakes it at once.
- ``arq`` at its defaults: enqueue -> the job's own time stamp; arq polls its queue every 0.5 s.

Each round starts a fresh worker (so leftover sleeps never leak into the next round) and warms it up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from tasks_core.devkit.bench import peers, throughput
from tasks_core.devkit.bench.common import (
    BenchEnv,
    CommonOptions,
    durable_services,
    effective_settings,
    public_options,
    reset_tables,
    seconds,
    submit,
    wait_running,
    wait_terminal,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio, summarize

NOOP = "diagnostics.noop"
SLEEP = "diagnostics.sleep"
# Longer than any round: busy-variant sleeps are ended by killing the round's worker.
LONG_SLEEP = {"seconds": 24 * 3600, "steps": 24 * 3600}


@dataclass
class LatencyOptions(CommonOptions):
    samples: int = 200
    capacity: int = 4
    concurrency: int = 6
    warmup: int = 20
    saturated_sleep: float = 5.0
    stall_seconds: float = 60.0
    peers: bool = True  # plain Celery always; Procrastinate and arq where installed


QUICK = {"samples": 5, "warmup": 4, "saturated_sleep": 1.0, "rounds": 1, "concurrency": 3, "capacity": 2,
         "stall_seconds": 30.0}


def run(opts: LatencyOptions) -> dict[str, Any]:
    if opts.capacity < 2:
        raise ValueError("--capacity must be at least 2 (the busy variant leaves one slot free)")
    return asyncio.run(_run(opts))


async def _run(opts: LatencyOptions) -> dict[str, Any]:
    busy = opts.capacity - 1
    variants = {
        "idle": "no other task; one no-op at a time",
        "busy": f"{busy} long diagnostics.sleep running, one slot free; one no-op at a time",
        "saturated": (
            f"capacity ({opts.capacity}) full of {opts.saturated_sleep:g} s diagnostics.sleep; no-ops "
            "submitted together WAIT FOR A FREE SLOT (capacity queueing, not transport delay)"
        ),
    }
    found = peers.installed(opts.peers)
    peer_names = _peer_variants(opts, variants, found)
    doc = Document("latency", public_options(opts), quick=opts.quick)
    rounds = Rounds(variants)
    pooled: dict[str, dict[str, list[float]]] = {
        v: {"running": [], "terminal": [], "handoff": []} for v in variants
    }
    async with BenchEnv("latency", opts) as env:
        db_url = await env.create_database("latency")
        services = durable_services(env, db_url, capacity=opts.capacity)
        settings = env.dtask_settings(db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency)
        doc.settings.update(worker_env=effective_settings(settings), celery=env.celery_settings())
        pq = peers.Procrastinate(db_url) if "procrastinate" in variants else None
        try:
            if pq is not None:
                await pq.open()
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                handoffs: list[float] = []
                if name == "plain-celery":
                    data, running = await _plain_round(env, opts)
                    terminal: list[float] = []
                elif name == "procrastinate":
                    assert pq is not None
                    data, running, terminal = await pq.latency_round(
                        env, services.engine, samples=opts.samples, warmup=opts.warmup,
                        concurrency=opts.concurrency, stall_seconds=opts.stall_seconds)
                elif name == "arq":
                    assert found.arq_python is not None
                    data, running = await peers.arq_latency_round(
                        env, found.arq_python, samples=opts.samples, warmup=opts.warmup,
                        concurrency=opts.concurrency)
                    terminal = []
                else:
                    data, running, terminal, handoffs = await _round(env, services, settings, opts, name)
                if name in peer_names:
                    doc.settings.setdefault("peer_argv", {})[name] = data.pop("argv")
                    data.update(_percentiles(running, terminal))
                pooled[name]["running"] += running
                pooled[name]["terminal"] += terminal
                pooled[name]["handoff"] += handoffs
                rounds.add(name, round_no, seq, data)
        finally:
            if pq is not None:
                await pq.close()
            await services.close()
    for line in found.missing:
        doc.note(line)
    for name in variants:
        rounds.extra[name]["pooled"] = {
            "submit_to_running_ms": summarize(pooled[name]["running"]),
            "submit_to_terminal_ms": summarize(pooled[name]["terminal"]),
        }
    hand = summarize(pooled["saturated"]["handoff"])
    rounds.extra["saturated"]["pooled"]["relay_handoff_ms"] = hand
    doc.data["variants"] = rounds.to_json()
    idle = rounds.extra["idle"]["pooled"]["submit_to_running_ms"].get("p50")
    for name in ("busy", "saturated"):
        p50 = rounds.extra[name]["pooled"]["submit_to_running_ms"].get("p50")
        doc.data["ratios"][f"{name} / idle (submit-to-running p50)"] = ratio(p50, idle)
    for name in peer_names:
        p50 = rounds.extra[name]["pooled"]["submit_to_running_ms"].get("p50")
        doc.data["ratios"][f"idle / {name} (submit-to-running p50)"] = ratio(idle, p50)
    rows = []
    for name in variants:
        run_ms = rounds.extra[name]["pooled"]["submit_to_running_ms"]
        end_ms = rounds.extra[name]["pooled"]["submit_to_terminal_ms"]
        rows.append([name, run_ms.get("p50"), run_ms.get("p99"), end_ms.get("p50"), end_ms.get("p99"),
                     run_ms.get("n"), ratio(run_ms.get("p50"), idle)])
    rows.append(["relay hand-off (saturated)", hand.get("p50"), hand.get("p99"), None, None, hand.get("n"),
                 None])
    doc.data["ratios"]["relay hand-off p99 / idle to running p99"] = ratio(
        hand.get("p99"), rounds.extra["idle"]["pooled"]["submit_to_running_ms"].get("p99"))
    columns = ["variant", "to running p50", "to running p99", "to terminal p50", "to terminal p99", "samples",
               "p50 x idle"]
    doc.table("latency (ms, pooled over rounds)", columns, rows)
    doc.note("relay hand-off = a terminal commit (finished_at) to the claim (started_at) of the task "
             "that took the freed slot, while the capacity is full and a backlog waits")
    doc.note(f"saturated = waiting for one of {opts.capacity} slots held by {opts.saturated_sleep:g} s "
             "sleeps; compare it with the sleep length, not with idle")
    if peer_names:
        doc.note("peers run idle, one no-op at a time, on the same machine in the same rounds; plain-celery "
                 "and arq time stamp their run once (no separate terminal)")
    return doc.finish()


def _peer_variants(opts: LatencyOptions, variants: dict[str, str], found: peers.Installed) -> list[str]:
    """Add the peers that can run to ``variants``; their names."""
    if not opts.peers:
        return []
    variants["plain-celery"] = (
        f"plain Celery no-op, same transport settings, prefork -c {opts.concurrency}; idle, one at a time, "
        "publish to the task's own time stamp"
    )
    if found.procrastinate is not None:
        variants["procrastinate"] = (
            f"procrastinate {found.procrastinate} no-op, one worker with --concurrency {opts.concurrency}; "
            "idle, one at a time, defer to its started/succeeded events (PostgreSQL clock)"
        )
    if found.arq is not None:
        variants["arq"] = (
            f"arq {found.arq} no-op, max_jobs={opts.concurrency}, other settings at arq's defaults (0.5 s "
            "queue poll); idle, one at a time, enqueue to the job's own time stamp"
        )
    return [name for name in ("plain-celery", "procrastinate", "arq") if name in variants]


def _percentiles(running: list[float], terminal: list[float]) -> dict[str, Any]:
    run_s, end_s = summarize(running), summarize(terminal)
    return {"to_running_p50_ms": run_s.get("p50"), "to_running_p99_ms": run_s.get("p99"),
            "to_terminal_p50_ms": end_s.get("p50"), "to_terminal_p99_ms": end_s.get("p99")}


async def _plain_round(env: BenchEnv, opts: LatencyOptions) -> tuple[dict[str, Any], list[float]]:
    """Idle latency of plain Celery on a fresh worker: publish one no-op, wait until it ran, again."""
    proc = throughput.start_plain_worker(env, opts.concurrency)
    running: list[float] = []
    try:
        startup = await env.wait_ready(proc)
        if opts.warmup:
            await throughput.plain_batch(env, opts.warmup, proc, opts.stall_seconds)
        for _ in range(opts.samples):
            t0, ran = await throughput.plain_batch(env, 1, proc, opts.stall_seconds, interval=0.002)
            running.append((ran - t0) * 1000)
    finally:
        env.kill(proc)
    return {"samples": len(running), "succeeded": len(running), "worker_startup_seconds": startup,
            "argv": proc.argv}, running


async def _round(
    env: BenchEnv, services: Any, settings: dict[str, str], opts: LatencyOptions, variant: str
) -> tuple[dict[str, Any], list[float], list[float], list[float]]:
    engine = services.engine
    env.clear_queues()
    await reset_tables(engine)
    proc = env.start_worker("worker", settings, concurrency=opts.concurrency)
    try:
        startup = await env.wait_ready(proc)
        if opts.warmup:
            # A burst, so most pool children connect and import before the first sample.
            await submit(services, NOOP, [{}] * opts.warmup)
            await wait_terminal(env, engine, opts.warmup, procs=[proc], stall_seconds=opts.stall_seconds)
        within = opts.stall_seconds
        if variant == "busy":
            sleeps = await submit(services, SLEEP, [LONG_SLEEP] * (opts.capacity - 1))
            await wait_running(env, engine, sleeps, procs=[proc], within=within)
        elif variant == "saturated":
            payload = {"seconds": opts.saturated_sleep, "steps": 1}
            sleeps = await submit(services, SLEEP, [payload] * opts.capacity)
            await wait_running(env, engine, sleeps, procs=[proc], within=within)
        ids: list[Any] = []
        if variant == "saturated":
            ids = await submit(services, NOOP, [{}] * opts.samples)
            await wait_terminal(env, engine, len(ids), procs=[proc], ids=ids, interval=0.02,
                                stall_seconds=within + opts.saturated_sleep)
        else:
            for _ in range(opts.samples):
                ids += await submit(services, NOOP, [{}])
                await wait_terminal(env, engine, 1, procs=[proc], stall_seconds=within, ids=ids[-1:],
                                    interval=0.005)
    finally:
        env.kill(proc)
    async with engine.connect() as conn:
        rows = (await conn.execute(
            text("SELECT created_at, started_at, finished_at, status FROM tasks WHERE id = ANY(:ids)"),
            {"ids": ids},
        )).mappings().all()
    running = [seconds(r["started_at"] - r["created_at"]) * 1000 for r in rows]
    terminal = [seconds(r["finished_at"] - r["created_at"]) * 1000 for r in rows]
    handoffs: list[float] = []
    if variant == "saturated":
        handoffs = await _handoffs(engine, [*sleeps, *ids], opts.capacity)
    data = {
        "samples": len(rows),
        "succeeded": sum(r["status"] == "success" for r in rows),
        **_percentiles(running, terminal),
        "worker_startup_seconds": startup,
    }
    if handoffs:
        hand = summarize(handoffs)
        data.update(handoff_p50_ms=hand["p50"], handoff_p99_ms=hand["p99"], handoff_max_ms=hand["max"],
                    handoffs=len(handoffs))
    return data, running, terminal, handoffs


async def _handoffs(engine: Any, ids: list[Any], capacity: int) -> list[float]:
    """Relay hand-off when saturated, in ms: terminal commit of a task -> claim of the next one.

    With every slot full and a backlog waiting, the (capacity + k)-th claim can only follow the k-th
    terminal transition that freed a slot (I5), so the k-th smallest ``finished_at`` is paired with
    the (capacity + k)-th smallest ``started_at`` over all tasks of the round (sleeps and no-ops).
    ``finished_at`` is written inside the terminal transaction, so each gap also holds that commit.
    """
    async with engine.connect() as conn:
        rows = (await conn.execute(
            text("SELECT started_at, finished_at FROM tasks WHERE id = ANY(:ids)"), {"ids": ids}
        )).all()
    starts = sorted(r.started_at for r in rows)
    ends = sorted(r.finished_at for r in rows)
    return [seconds(start - end) * 1000 for start, end in zip(starts[capacity:], ends, strict=False)]
