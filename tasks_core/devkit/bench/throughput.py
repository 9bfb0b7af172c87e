"""`dtask bench throughput`: no-op tasks end to end, durable vs plain Celery vs the database's limit.

Variants, run in alternating rounds:

- ``durable-capN``: ``diagnostics.noop`` through the real path — submit (commit, then publish) →
  a ``celery worker`` subprocess running ``tasks_core.celery_app`` claims, runs, commits the
  terminal transaction and relays. Timed with PostgreSQL's clock from just before the first submit
  to the last ``finished_at``. Run at the default capacity and at capacity = worker concurrency
  (below that, surplus messages are refused by the claim and the relay hands slots on). A worker
  process runs the task its terminal write picked next itself (DTASK_WORKER_RUN_NEXT, default).
- ``durable-capN-via-broker``: capacity = concurrency with DTASK_WORKER_RUN_NEXT=0, every task from a
  message of its own (the path before run-next), side by side.
- ``plain-celery``: ``tasks_core.devkit.bench.plain_app`` — same celeryconfig, broker, queues, pool and
  concurrency, a trivial task; publish-to-last-completion.
- ``pgbench-cN``: the three commits of a task's life (insert, claim, terminal) as a pgbench script
  on a copy of the task table, N clients.

Each durable/plain round starts a fresh worker (startup is not timed) and a warm-up batch, so every
round begins from the same state.

``broker``: an amqp:// URL of a local RabbitMQ runs the durable and plain rounds through a vhost of
the run's own there (made and deleted by the run); the result records which broker carried them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from tasks_core.db import db_now
from tasks_core.devkit.bench import cpu, peers, pgbench, plain_app
from tasks_core.devkit.bench.common import (
    BenchEnv,
    CommonOptions,
    durable_services,
    effective_settings,
    poll,
    public_options,
    reset_tables,
    seconds,
    submit,
    wait_terminal,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio
from tasks_core.devkit.rabbitmq import masked
from tasks_core.metrics import METRICS_KEY, parse_field

NOOP = "diagnostics.noop"


@dataclass
class ThroughputOptions(CommonOptions):
    tasks: int = 2000
    warmup: int = 50
    # Worker pool processes; the project's default is capacity + 2.
    concurrency: int = 6
    capacity: int = 4
    pgbench_seconds: float = 5.0
    # Empty means 1, the worker concurrency (the fair comparison) and 8 (the design's reference).
    pgbench_clients: tuple[int, ...] = ()
    stall_seconds: float = 60.0
    peers: bool = True  # Procrastinate and arq, where installed
    # None: the run's Redis DB carries the messages; an amqp:// URL: a vhost of the run's own there.
    broker: str | None = None


QUICK = {"tasks": 40, "warmup": 6, "concurrency": 3, "capacity": 2, "pgbench_seconds": 1.0, "rounds": 1,
         "stall_seconds": 30.0}


def run(opts: ThroughputOptions) -> dict[str, Any]:
    return asyncio.run(_run(opts))


async def _run(opts: ThroughputOptions) -> dict[str, Any]:
    clients = opts.pgbench_clients or tuple(
        dict.fromkeys((1, opts.concurrency) if opts.quick else (1, opts.concurrency, 8))
    )
    capacities = tuple(dict.fromkeys((opts.capacity, opts.concurrency)))
    exe = pgbench.find_pgbench()
    variants: dict[str, str] = {}
    for cap in capacities:
        variants[f"durable-cap{cap}"] = (
            f"diagnostics.noop through submit, a celery worker (prefork -c {opts.concurrency}), claim, "
            f"run and terminal commit; DTASK_CAPACITY={cap}"
        )
    # The same at capacity = concurrency with every id through the broker: what run-next buys.
    via_broker = f"durable-cap{opts.concurrency}-via-broker"
    variants[via_broker] = (
        f"as durable-cap{opts.concurrency}, with DTASK_WORKER_RUN_NEXT=0: every task from a message of "
        "its own"
    )
    variants["plain-celery"] = (
        f"plain Celery no-op, same transport settings, prefork -c {opts.concurrency}, "
        "publish to last completion"
    )
    # Peers on their natural stores, where installed; a missing one is a note, not an error.
    found = peers.installed(opts.peers)
    pv, arq_python = found.procrastinate, found.arq_python
    if pv is not None:
        variants["procrastinate"] = (
            f"procrastinate {pv} no-op, one worker process with --concurrency {opts.concurrency}, "
            "batch_defer_async of 1,000 to last success (PostgreSQL clock)"
        )
    if arq_python is not None:
        variants["arq"] = (
            f"arq {found.arq} no-op, one worker process with max_jobs={opts.concurrency} "
            "(other settings at arq's defaults), Redis; first enqueue to last completion"
        )
    # Without pgbench the other variants still run; the ratios against it are then null.
    for c in clients if exe else ():
        variants[f"pgbench-c{c}"] = f"pgbench: insert + claim update + terminal update, {c} client(s)"
    options = {**public_options(opts), "pgbench_clients": list(clients), "pgbench": exe}
    options["broker"] = None if opts.broker is None else masked(opts.broker)
    doc = Document("throughput", options, quick=opts.quick)
    rounds = Rounds(variants)
    async with BenchEnv("throughput", opts) as env:
        doc.settings["broker"] = {"kind": "redis", "url": masked(env.broker)}
        if opts.broker is not None:
            vhost = await env.use_rabbitmq(opts.broker)
            doc.settings["broker"] = {"kind": "rabbitmq", "url": masked(opts.broker), "vhost": vhost}
        db_url = await env.create_database("throughput")
        services = durable_services(env, db_url)
        pq = peers.Procrastinate(db_url) if pv is not None else None
        try:
            if pq is not None:
                await pq.open()
            script = await pgbench.prepare(services.engine, env.dir)
            for round_no, seq, name in alternate(list(variants), opts.rounds):
                if name.startswith("durable-cap"):
                    cap = int(name.removeprefix("durable-cap").removesuffix("-via-broker"))
                    data = await durable_round(env, services, db_url, opts, cap,
                                               run_next=0 if name == via_broker else None)
                    doc.settings.setdefault("worker_settings", {})[name] = data.pop("settings")
                    doc.settings["celery"] = env.celery_settings()
                elif name == "plain-celery":
                    data = await _plain_round(env, opts)
                    doc.settings["plain_worker_argv"] = data.pop("argv")
                elif name == "procrastinate":
                    assert pq is not None
                    data = await pq.throughput_round(
                        env, services.engine, tasks=opts.tasks, warmup=opts.warmup,
                        concurrency=opts.concurrency, stall_seconds=opts.stall_seconds,
                    )
                    doc.settings["procrastinate_worker_argv"] = data.pop("argv")
                elif name == "arq":
                    assert arq_python is not None
                    data = await peers.arq_round(
                        env, arq_python, tasks=opts.tasks, warmup=opts.warmup,
                        concurrency=opts.concurrency, stall_seconds=opts.stall_seconds,
                    )
                    doc.settings["arq_worker_argv"] = data.pop("argv")
                else:
                    assert exe is not None
                    await pgbench.truncate(services.engine)
                    data = await asyncio.to_thread(
                        pgbench.run, exe, db_url, script, clients=int(name.removeprefix("pgbench-c")),
                        seconds=opts.pgbench_seconds,
                    )
                    doc.settings.setdefault("pgbench_argv", {})[name] = data.pop("argv")
                rounds.add(name, round_no, seq, data)
        finally:
            if pq is not None:
                await pq.close()
            await services.close()
    for line in found.missing:
        doc.note(line)
    return _finish(doc, rounds, capacities, clients, opts.concurrency)


async def durable_round(
    env: BenchEnv, services: Any, db_url: str, opts: ThroughputOptions, capacity: int,
    pool: str = "prefork", run_next: int | None = None,
) -> dict[str, Any]:
    """One round of no-ops through the real durable path on a fresh worker (``pool``: prefork, or
    threads for the dense mode; ``run_next``: DTASK_WORKER_RUN_NEXT, else its default)."""
    engine = services.engine
    env.clear_queues()
    await reset_tables(engine)
    extra = {} if run_next is None else {"worker_run_next": run_next}
    settings = env.dtask_settings(db_url, capacity=capacity, worker_concurrency=opts.concurrency, **extra)
    proc = env.start_worker("durable", settings, concurrency=opts.concurrency, pool=pool)
    try:
        startup = await env.wait_ready(proc)
        if opts.warmup:
            await submit(services, NOOP, [{}] * opts.warmup)
            await wait_terminal(env, engine, opts.warmup, procs=[proc], stall_seconds=opts.stall_seconds)
        env.redis.delete(METRICS_KEY)  # count the measured tasks' claims only
        cpu_before = cpu.snapshot([proc.pid])
        t0 = await db_now(engine)
        ids = await submit(services, NOOP, [{}] * opts.tasks)
        submitted = await db_now(engine)
        await wait_terminal(env, engine, opts.warmup + opts.tasks, procs=[proc],
                            stall_seconds=opts.stall_seconds)
        cpu_spent = cpu.ms_per_task(cpu_before, cpu.snapshot([proc.pid]), opts.tasks)
    finally:
        env.kill(proc)
    async with engine.connect() as conn:
        facts = (await conn.execute(
            text(
                """SELECT max(finished_at) AS last, count(*) FILTER (WHERE status = 'success') AS ok,
                      sum(attempt_count) AS attempts FROM tasks WHERE id = ANY(:ids)"""
            ),
            {"ids": ids},
        )).mappings().one()
    elapsed = seconds(facts["last"] - t0)
    return {
        "tasks": opts.tasks,
        "seconds": elapsed,
        "tasks_per_s": opts.tasks / elapsed,
        "submit_seconds": seconds(submitted - t0),
        "succeeded": int(facts["ok"]),
        "attempts": int(facts["attempts"] or 0),
        "worker_startup_seconds": startup,
        **cpu_spent,
        **_worker_metrics(env),
        "settings": {"env": effective_settings(settings), "argv": proc.argv},
    }


def start_plain_worker(env: BenchEnv, concurrency: int) -> Any:
    """A fresh plain Celery worker on empty queues: the project's transport settings, no database."""
    env.clear_queues()
    return env.start_worker("plain", env.dtask_settings(None), concurrency=concurrency,
                            app="tasks_core.devkit.bench.plain_app")


async def _plain_round(env: BenchEnv, opts: ThroughputOptions) -> dict[str, Any]:
    proc = start_plain_worker(env, opts.concurrency)
    try:
        startup = await env.wait_ready(proc)
        if opts.warmup:
            await plain_batch(env, opts.warmup, proc, opts.stall_seconds)
        cpu_before = cpu.snapshot([proc.pid])
        t0, last = await plain_batch(env, opts.tasks, proc, opts.stall_seconds)
        cpu_spent = cpu.ms_per_task(cpu_before, cpu.snapshot([proc.pid]), opts.tasks)
    finally:
        env.kill(proc)
    elapsed = last - t0
    return {"tasks": opts.tasks, "seconds": elapsed, "tasks_per_s": opts.tasks / elapsed,
            "worker_startup_seconds": startup, **cpu_spent, "argv": proc.argv}


async def plain_batch(
    env: BenchEnv, n: int, proc: Any, stall_seconds: float, interval: float = 0.02
) -> tuple[float, float]:
    """Publish n no-ops; (publish start, last completion), both wall-clock seconds on this host."""
    env.redis.delete(plain_app.DONE_KEY, plain_app.LAST_KEY)
    t0 = await asyncio.to_thread(plain_app.publish, env.celery, n)

    async def done() -> bool:
        return int(env.redis.get(plain_app.DONE_KEY) or 0) >= n

    await poll(done, within=stall_seconds + n / 100, interval=interval, what=f"{n} plain no-ops",
               check=lambda: env.check_alive(proc))
    return t0, float(env.redis.get(plain_app.LAST_KEY) or 0)


def _worker_metrics(env: BenchEnv) -> dict[str, Any]:
    """Claims, refusals and hand-ons from the workers' shared metrics hash, when they flush it."""

    raw = env.redis.hgetall(METRICS_KEY)
    env.redis.delete(METRICS_KEY)
    out: dict[str, float] = {}
    for key, value in raw.items():
        name, labels = parse_field(key.decode() if isinstance(key, bytes) else key)
        if name == "dtask_claims":
            out["claims"] = out.get("claims", 0) + float(value)
        elif name == "dtask_claims_refused":
            out["claims_refused"] = out.get("claims_refused", 0) + float(value)
        elif name == "dtask_published" and labels.get("by") == "relay":
            out["relayed"] = out.get("relayed", 0) + float(value)
        elif name == "dtask_run_next":  # picks a worker ran itself, without a message
            out["run_next"] = out.get("run_next", 0) + float(value)
    return out


def _finish(
    doc: Document, rounds: Rounds, capacities: tuple[int, ...], clients: tuple[int, ...], concurrency: int
) -> dict[str, Any]:
    doc.data["variants"] = rounds.to_json()
    plain = rounds.median("plain-celery", "tasks_per_s")
    # As many database clients as the worker has processes, when measured; else the most clients.
    pg_best = concurrency if concurrency in clients else max(clients)
    pg_name = f"pgbench-c{pg_best}"
    pg = rounds.median(pg_name, "tasks_per_s") if pg_name in rounds.rounds else None
    for cap in capacities:
        durable = rounds.median(f"durable-cap{cap}", "tasks_per_s")
        doc.data["ratios"][f"durable-cap{cap} / plain-celery"] = ratio(durable, plain)
        doc.data["ratios"][f"durable-cap{cap} / pgbench-c{pg_best}"] = ratio(durable, pg)
        for peer in ("procrastinate", "arq"):
            if peer in rounds.rounds:
                doc.data["ratios"][f"durable-cap{cap} / {peer}"] = ratio(
                    durable, rounds.median(peer, "tasks_per_s"))
    via_broker = f"durable-cap{concurrency}-via-broker"
    doc.data["ratios"][f"durable-cap{concurrency} / {via_broker}"] = ratio(
        rounds.median(f"durable-cap{concurrency}", "tasks_per_s"), rounds.median(via_broker, "tasks_per_s"))
    rows = []
    for name in rounds.descriptions:
        m = rounds.medians(name)
        rows.append([name, m.get("tasks_per_s"), m.get("seconds"), len(rounds.rounds[name]),
                     ratio(m.get("tasks_per_s"), plain), ratio(m.get("tasks_per_s"), pg)])
        spent = {kind: m[f"cpu_{kind}_ms"] for kind in cpu.KINDS if f"cpu_{kind}_ms" in m}
        if spent:
            parts = ", ".join(f"{kind} {v:.2f}" for kind, v in spent.items())
            doc.note(f"CPU ms per task, {name}: {parts} (total {sum(spent.values()):.2f})")
    broker = doc.settings.get("broker", {}).get("kind", "redis")
    doc.table(f"throughput on {broker}: median tasks/s over rounds",
              ["variant", "tasks/s", "seconds", "rounds", "x plain", f"x pgbench-c{pg_best}"], rows)
    doc.note("CPU per task: the worker's main process, its pool children, and every PostgreSQL and "
             "Redis process on this host (/proc: every thread's time on CPU)")
    doc.note("durable and plain rounds each start a fresh worker; startup is excluded from the timing")
    if not any(name.startswith("pgbench") for name in rounds.descriptions):
        doc.note("pgbench not found (PATH, /usr/lib/postgresql/*/bin): no database-limit variants")
    return doc.finish()
