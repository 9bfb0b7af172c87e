"""`dtask bench WORKLOAD`: one command per workload.

Mounted on the main CLI with ``cli.add_typer(bench_app, name="bench")``. Every size is an option whose
default is the full benchmark; ``--quick`` swaps in tiny sizes (seconds per workload) for any option
not given explicitly. Each run writes ``bench-results/<workload>-<timestamp>.json`` (or ``--out``)
and prints a short table.
"""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from tasks_core.devkit.bench.common import BenchError, resolve

bench_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help=(
        "Benchmarks against the transport and the database: throughput, latency, recovery, scale, soak; "
        "and the knowledge domain's ingestion (knowledge-ingest). "
        "Each creates its own temporary database and Redis DB index on 127.0.0.1, alternates its "
        "variants round by round, prints a table and writes a JSON result."
    ),
)


def _opt(help_text: str, minimum: float | None = None) -> Any:
    return typer.Option(min=minimum, help=help_text)


Quick = Annotated[bool, typer.Option("--quick", help="tiny sizes (seconds) for options not given")]
Rounds = Annotated[int | None, _opt("rounds per variant (alternating A,B,C,A,B,C…)", 1)]
Out = Annotated[Path | None, typer.Option(help="result file (default: bench-results/<workload>-<time>.json)")]
AdminUrl = Annotated[str | None, typer.Option(
    help="PostgreSQL admin URL for the temporary database (default: $DTASK_BENCH_ADMIN_URL, "
         "$DTASK_TEST_ADMIN_URL, postgresql+asyncpg://postgres@127.0.0.1:5432/postgres)"
)]
RedisUrl = Annotated[str | None, typer.Option(
    help="Redis server (default: $DTASK_BENCH_REDIS_URL, $DTASK_TEST_REDIS_URL, redis://127.0.0.1:6379)"
)]
RedisDb = Annotated[int | None, _opt("Redis DB index used (and flushed) by the run (default 13)", 0)]
FlushRedis = Annotated[bool, typer.Option("--flush-redis", help="use the Redis DB index even if not empty")]
Concurrency = Annotated[int | None, _opt("worker pool processes (default 6 = capacity + 2)", 1)]
Capacity = Annotated[int | None, _opt("DTASK_CAPACITY of the workers (default 4)", 1)]


def _execute(
    module: ModuleType, options: type[Any], quick: bool, out: Path | None, given: dict[str, Any]
) -> None:
    from tasks_core.devkit.bench.report import print_table, write_result

    opts = resolve(options, quick, module.QUICK, given)
    try:
        result = module.run(opts)
    except (BenchError, ValueError) as exc:
        typer.echo(f"dtask bench: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:
        # SIGINT or SIGTERM: the run was cancelled and its processes and databases released.
        typer.echo("dtask bench: interrupted; workers stopped and temporary database dropped", err=True)
        raise typer.Exit(130) from exc
    path = write_result(result, out)
    print_table(result)
    typer.echo(f"result: {path}")


@bench_app.command()
def throughput(
    tasks: Annotated[int | None, _opt("no-op tasks per round (default 2000)", 1)] = None,
    warmup: Annotated[int | None, _opt("untimed no-ops before each round (default 50)", 0)] = None,
    concurrency: Concurrency = None,
    capacity: Capacity = None,
    pgbench_seconds: Annotated[float | None, _opt("pgbench -T per round (default 5)", 1)] = None,
    pgbench_clients: Annotated[list[int] | None, typer.Option(
        "--pgbench-clients", help="pgbench -c, repeatable (default 1 and the concurrency)")] = None,
    peers: Annotated[bool | None, typer.Option(
        "--peers/--no-peers", help="Procrastinate and arq variants, where installed (default on)")] = None,
    broker: Annotated[str | None, typer.Option(
        help="amqp://user:password@127.0.0.1:5672/ : carry the messages through a vhost of the run's own "
             "on this RabbitMQ (default: the run's Redis DB)")] = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """No-op tasks/s: durable path vs plain Celery vs peers vs pgbench (a task's three commits).

    The durable path runs at the default capacity and at capacity = worker concurrency; plain Celery
    uses the same transport settings, broker, pool and concurrency. Peers, where installed:
    Procrastinate (`pip install -e .[bench]`) and arq (`scripts/bench-peers`).
    """
    from tasks_core.devkit.bench import throughput as workload

    _execute(workload, workload.ThroughputOptions, quick, out, dict(
        tasks=tasks, warmup=warmup, concurrency=concurrency, capacity=capacity,
        pgbench_seconds=pgbench_seconds, pgbench_clients=tuple(pgbench_clients) if pgbench_clients else None,
        peers=peers, rounds=rounds, admin_url=admin_url, redis_url=redis_url, redis_db=redis_db,
        flush_redis=flush_redis or None, broker=broker,
    ))


@bench_app.command()
def latency(
    samples: Annotated[int | None, _opt("no-ops per variant per round (default 200)", 1)] = None,
    warmup: Annotated[int | None, _opt("untimed no-ops after each worker start (default 20)", 0)] = None,
    saturated_sleep: Annotated[float | None, _opt(
        "seconds each capacity-filling sleep lasts in the saturated variant (default 5)", 0.1)] = None,
    concurrency: Concurrency = None,
    capacity: Capacity = None,
    peers: Annotated[bool | None, typer.Option(
        "--peers/--no-peers",
        help="idle plain Celery, and Procrastinate and arq where installed (default on)")] = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Submit-to-running p50/p99: idle, busy (long tasks beside a free slot), saturated, and the
    relay hand-off; idle beside plain Celery, Procrastinate and arq.

    Saturated = the capacity is full of sleeps, so the no-ops wait for a slot (capacity queueing,
    reported apart from transport delay).
    """
    from tasks_core.devkit.bench import latency as workload

    _execute(workload, workload.LatencyOptions, quick, out, dict(
        samples=samples, warmup=warmup, saturated_sleep=saturated_sleep, concurrency=concurrency,
        capacity=capacity, peers=peers, rounds=rounds, admin_url=admin_url, redis_url=redis_url,
        redis_db=redis_db, flush_redis=flush_redis or None,
    ))


@bench_app.command()
def submit(
    single: Annotated[int | None, _opt("intents submitted one by one per round (default 1000)", 1)] = None,
    intents: Annotated[int | None, _opt("intents per batch round (default 10000)", 1)] = None,
    clients: Annotated[int | None, _opt("concurrent HTTP clients (default 32)", 1)] = None,
    http_requests: Annotated[int | None, _opt("GET /healthz, POST /tasks per round (3000)", 1)] = None,
    http_batches: Annotated[int | None, _opt("POST /tasks/batch of 1,000 per round (default 64)", 1)] = None,
    capacity: Capacity = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Intents/s committed and made runnable: one by one vs batches of 100 and 1,000, in process and
    over HTTP (one `dtask api`, no worker; ratios to its GET /healthz), beside Procrastinate's defers.
    """
    from tasks_core.devkit.bench import submit as workload

    _execute(workload, workload.SubmitOptions, quick, out, dict(
        single=single, intents=intents, clients=clients, http_requests=http_requests,
        http_batches=http_batches, capacity=capacity, rounds=rounds, admin_url=admin_url,
        redis_url=redis_url, redis_db=redis_db, flush_redis=flush_redis or None,
    ))


@bench_app.command()
def recovery(
    tasks: Annotated[int | None, _opt("sleeps running on the killed worker (default 4)", 1)] = None,
    lease_seconds: Annotated[float | None, _opt("DTASK_LEASE_SECONDS (default 30)", 0.5)] = None,
    reconcile_seconds: Annotated[float | None, _opt("DTASK_RECONCILE_SECONDS (default 10)", 0.5)] = None,
    publish_seconds: Annotated[float | None, _opt("DTASK_PUBLISH_SECONDS (default 15)", 0.5)] = None,
    concurrency: Concurrency = None,
    capacity: Capacity = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Time to terminal after SIGKILL of a worker (or one pool child), against lease + reconcile.

    Beat and a second worker run throughout; the killed worker holds long diagnostics.sleep tasks.
    """
    from tasks_core.devkit.bench import recovery as workload

    _execute(workload, workload.RecoveryOptions, quick, out, dict(
        tasks=tasks, lease_seconds=lease_seconds, reconcile_seconds=reconcile_seconds,
        publish_seconds=publish_seconds, concurrency=concurrency, capacity=capacity, rounds=rounds,
        admin_url=admin_url, redis_url=redis_url, redis_db=redis_db, flush_redis=flush_redis or None,
    ))


@bench_app.command()
def scale(
    history_small: Annotated[int | None, _opt("terminal rows, small table (default 10000)", 0)] = None,
    history_large: Annotated[int | None, _opt("terminal rows, large table (default 1000000)", 0)] = None,
    pending_small: Annotated[int | None, _opt("pending rows, small table (default 1000)", 0)] = None,
    pending_large: Annotated[int | None, _opt("pending rows, large table (default 100000)", 0)] = None,
    ops: Annotated[int | None, _opt("insert/claim/finish ops per round (default 500)", 1)] = None,
    publish_calls: Annotated[int | None, _opt("claim_for_publish calls per round (default 50)", 1)] = None,
    publish_batch: Annotated[int | None, _opt("claim_for_publish limit (default 500)", 1)] = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Per-op cost of insert, claim, finish, publish, summary: small vs large table.

    Defaults: 10 thousand vs 1 million rows of terminal history, 1 thousand vs 100 thousand pending.
    """
    from tasks_core.devkit.bench import scale as workload

    _execute(workload, workload.ScaleOptions, quick, out, dict(
        history_small=history_small, history_large=history_large, pending_small=pending_small,
        pending_large=pending_large, ops=ops, publish_calls=publish_calls, publish_batch=publish_batch,
        rounds=rounds, admin_url=admin_url, redis_url=redis_url, redis_db=redis_db,
        flush_redis=flush_redis or None,
    ))


@bench_app.command()
def soak(
    tasks: Annotated[int | None, _opt("no-op tasks through one worker (default 20000)", 1)] = None,
    warmup: Annotated[int | None, _opt("no-ops before the warm memory sample (default 200)", 0)] = None,
    sample_seconds: Annotated[float | None, _opt("memory sample interval (default 5)", 0.1)] = None,
    concurrency: Concurrency = None,
    capacity: Capacity = None,
    quick: Quick = False, rounds: Annotated[int | None, _opt("rounds per variant (default 1)", 1)] = None,
    out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Worker memory (RSS of main + children) at start and end of 20 thousand tasks.

    Durable worker vs a plain Celery worker with the same settings.
    """
    from tasks_core.devkit.bench import soak as workload

    _execute(workload, workload.SoakOptions, quick, out, dict(
        tasks=tasks, warmup=warmup, sample_seconds=sample_seconds, concurrency=concurrency,
        capacity=capacity, rounds=rounds, admin_url=admin_url,
        redis_url=redis_url, redis_db=redis_db, flush_redis=flush_redis or None,
    ))


@bench_app.command()
def density(
    sizes: Annotated[list[int] | None, typer.Option(
        "--size", help="concurrent sleeps per worker, repeatable (default 10, 100, 200)", min=1)] = None,
    sleep_seconds: Annotated[float | None, _opt("how long each sleep lasts (default 60)", 1)] = None,
    noop_tasks: Annotated[int | None, _opt("no-ops per mode, throughput variants (default 1000)", 1)] = None,
    noop_concurrency: Annotated[int | None, _opt(
        "worker concurrency and capacity for the no-op variants (default 8)", 1)] = None,
    quick: Quick = False, rounds: Annotated[int | None, _opt("rounds per variant (default 1)", 1)] = None,
    out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Worker memory and time-to-all-running for N concurrent sleeps: prefork vs the dense mode.

    The dense mode (`dtask worker --pool threads`) runs every task on one process's event loop; the
    result gives MiB per extra running task and the prefork/dense ratio, and each mode's no-op
    throughput at the same concurrency. Procrastinate and arq (where installed) run the same sleeps.
    """
    from tasks_core.devkit.bench import density as workload

    _execute(workload, workload.DensityOptions, quick, out, dict(
        sizes=tuple(sizes) if sizes else None, sleep_seconds=sleep_seconds, rounds=rounds,
        noop_tasks=noop_tasks, noop_concurrency=noop_concurrency,
        admin_url=admin_url, redis_url=redis_url, redis_db=redis_db, flush_redis=flush_redis or None,
    ))


# A domain's workload, named by module path like the registry's spec modules: tasks_core never
# imports a domain by name.
KNOWLEDGE_WORKLOAD = "domains.knowledge.bench"


@bench_app.command("knowledge-ingest")
def knowledge_ingest(
    files: Annotated[int | None, _opt("files per round (default 200; 20 with --beside-hostile)", 1)] = None,
    size: Annotated[int | None, _opt("bytes per file (default 4096)", 16)] = None,
    batch: Annotated[int | None, _opt("files per upload request (default 100)", 1)] = None,
    beside_hostile: Annotated[bool, typer.Option(
        "--beside-hostile",
        help="tenant isolation: tenant B's files alone vs after tenant A's hostile documents")] = False,
    base_size: Annotated[list[int] | None, typer.Option(
        "--base-size", min=0,
        help="repeatable: the batch into a base pre-filled with N indexed files, per N, beside the plain "
             "pipeline (no task system)")] = None,
    embedder: Annotated[str | None, typer.Option(
        help="DTASK_EMBEDDER of the api and worker (the plain ingest only), e.g. sentence-transformers:PATH: "
             "adds chunks/s and the model's share of the worker's CPU")] = None,
    concurrency: Concurrency = None,
    capacity: Capacity = None,
    quick: Quick = False, rounds: Rounds = None, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """Files/s and p50/p99 upload-to-indexed: multipart uploads to a `dtask api`, indexed by a worker.

    Milvus (milvus-lite) and S3 (SeaweedFS) are started for the run on loopback. With
    --beside-hostile, alternating rounds time tenant B's files alone and right after tenant A
    uploaded two amplification PDFs and a 16 MB one-line text: the ratio, A's files' endings and
    the worker's peak RSS. With --base-size (repeatable), the batch goes into bases pre-filled with N
    files, beside the same files through a plain pipeline without the task system.
    """
    workload = importlib.import_module(KNOWLEDGE_WORKLOAD)
    _execute(workload, workload.IngestOptions, quick, out, dict(
        files=files, size=size, batch=batch, beside_hostile=beside_hostile or None,
        base_sizes=tuple(base_size) if base_size else None, embedder=embedder, concurrency=concurrency,
        capacity=capacity, rounds=rounds, admin_url=admin_url, redis_url=redis_url, redis_db=redis_db,
        flush_redis=flush_redis or None,
    ))


QUALITY_WORKLOAD = "domains.knowledge.bench_quality"


@bench_app.command("knowledge-quality")
def knowledge_quality(
    embedder: Annotated[list[str] | None, typer.Option(
        "--embedder",
        help="a DTASK_EMBEDDER spec, repeatable: hashing, sentence-transformers:PATH, openai (its server "
             "from the caller's DTASK_EMBEDDING_* variables), module:attribute (default: hashing)")] = None,
    corpus: Annotated[list[Path] | None, typer.Option(
        "--corpus",
        help="a corpus directory (docs/, questions.jsonl), repeatable (default: tests/data/en_corpus)",
    )] = None,
    top_k: Annotated[int | None, _opt("hits asked per question (default 20)", 1)] = None,
    concurrency: Annotated[int | None, _opt("worker pool processes (default 2)", 1)] = None,
    capacity: Annotated[int | None, _opt("DTASK_CAPACITY of the worker (default 2)", 1)] = None,
    quick: Quick = False, out: Out = None, admin_url: AdminUrl = None,
    redis_url: RedisUrl = None, redis_db: RedisDb = None, flush_redis: FlushRedis = False,
) -> None:
    """MRR, hit@1 and hit@5 of each embedder on corpora with known answers, through the real system.

    Per embedder, a `dtask api` and a worker run with DTASK_EMBEDDER set to it; each corpus is uploaded
    over HTTP into a base, indexed into Milvus, and every question asked through the search route.
    """
    workload = importlib.import_module(QUALITY_WORKLOAD)
    _execute(workload, workload.QualityOptions, quick, out, dict(
        embedders=tuple(embedder) if embedder else None,
        corpora=tuple(str(c) for c in corpus) if corpus else None, top_k=top_k,
        concurrency=concurrency, capacity=capacity, admin_url=admin_url, redis_url=redis_url,
        redis_db=redis_db, flush_redis=flush_redis or None,
    ))
