"""`dtask bench knowledge-ingest`: N files of a given size, uploaded over HTTP, until indexed.

The whole real path on loopback: a `dtask api` process takes multipart uploads (originals to S3,
file rows and their tasks in one transaction, one publish per request), a `celery worker` parses,
chunks, embeds and indexes them into Milvus. Milvus (milvus-lite server) and S3 (SeaweedFS) are
started for the run under its scratch directory; the database and Redis DB index are the bench's
own, as for every workload.

Per file, upload-to-indexed is the file row's ``updated_at`` when it became ``indexed`` minus
PostgreSQL's clock read just before its upload request was sent (so the S3 put, the transaction
and the queueing at the capacity limit are all inside it). Files/s is N over first request to
last file indexed.

``--beside-hostile`` measures tenant isolation instead, in two variants of alternating rounds,
each on fresh bases. ``alone``: tenant B uploads N small files (default 20). ``beside-hostile``:
tenant A (a second API key) first uploads the hostile set of ``domains.knowledge.hostile`` (an
amplification PDF drawing a billion characters in one operator, the same spread over 4,000, a
16 MB one-line text), then B uploads the same N files. B is timed alike in both, from its first
request to its last file indexed, so the ratio of the medians is what A's files cost B. Each
round then waits, untimed, until every task it made has ended, so the next starts idle. The
worker's process tree (main, pool processes and their parse processes) is sampled for its peak
RSS in both variants alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
from sqlalchemy import text

from tasks_core.db import db_now, make_engine
from tasks_core.devkit.bench.common import (
    BenchEnv,
    BenchError,
    CommonOptions,
    Proc,
    effective_settings,
    poll,
    public_options,
    seconds,
    wait_terminal,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio, summarize
from tasks_core.settings import Settings

VARIANT = "batch-upload"
ALONE, BESIDE = "alone", "beside-hostile"
# The isolation target: B's time beside A's hostile files over B's time alone.
TIME_RATIO = "beside-hostile / alone (B's time, medians)"
P99_RATIO = "beside-hostile / alone (B's p99, pooled)"
FILES = 200
ISOLATION_FILES = 20
# Tenants' key names (the owners of their tasks): B's is the plain bench's.
B_KEY, A_KEY = "bench", "hostile"
# Often enough to catch a parse process's climb to its limit, rarely enough that sampling (a scan
# of /proc) takes a few per cent of a core, in both variants alike.
RSS_INTERVAL = 0.1
MB = 1024 * 1024
_WORDS = [
    "river",
    "stone",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "signal",
    "orchard",
    "canyon",
    "ember",
    "quartz",
    "willow",
    "beacon",
    "thistle",
    "glacier",
    "falcon",
    "cedar",
    "marble",
    "tundra",
    "violet",
]


@dataclass
class IngestOptions(CommonOptions):
    files: int | None = None  # per round; None: FILES, or ISOLATION_FILES beside hostile documents
    size: int = 4096  # bytes per file
    batch: int = 100  # files per upload request
    capacity: int = 4
    concurrency: int = 6
    stall_seconds: float = 120.0
    beside_hostile: bool = False
    # Base sizes to compare (files already indexed when the batch is uploaded); empty: a fresh base.
    base_sizes: tuple[int, ...] = ()
    # DTASK_EMBEDDER of the api and the worker; given, the model's share is reported (bench_model).
    embedder: str | None = None


QUICK = {
    "files": 12,
    "size": 1024,
    "batch": 6,
    "rounds": 1,
    "capacity": 2,
    "concurrency": 3,
    "stall_seconds": 60.0,
}


def document(n: int, size: int) -> bytes:
    """A deterministic text document of ``size`` bytes, paragraphs of common words plus its own."""
    words: list[str] = []
    length = 0
    i = 0
    while length < size:
        word = f"doc{n}term{i % 7}" if i % 11 == 0 else _WORDS[(n * 31 + i * 7) % len(_WORDS)]
        words.append(word + ("\n\n" if i % 60 == 59 else " "))
        length += len(words[-1])
        i += 1
    return "".join(words).encode()[:size]


def run(opts: IngestOptions) -> dict[str, Any]:
    if opts.files is None:
        opts = replace(opts, files=ISOLATION_FILES if opts.beside_hostile else FILES)
    if opts.batch < 1 or not opts.files or opts.files < 1 or opts.size < 16:
        raise ValueError("--files and --batch must be positive and --size at least 16 bytes")
    if opts.base_sizes and (opts.beside_hostile or min(opts.base_sizes) < 0):
        raise ValueError("--base-size takes sizes of 0 or more, and not with --beside-hostile")
    if opts.embedder and (opts.beside_hostile or opts.base_sizes):
        raise ValueError("--embedder goes with the plain ingest, not with --beside-hostile or --base-size")
    return asyncio.run(_run(opts, opts.files))


@dataclass
class _Stack:
    """What a round talks to: the api (as tenant B unless told), the database, the processes."""

    env: BenchEnv
    client: httpx.AsyncClient
    engine: Any
    procs: list[Proc]
    opts: IngestOptions
    files: int


async def _run(opts: IngestOptions, files: int) -> dict[str, Any]:
    from domains.knowledge import bench_model as model
    from domains.knowledge import bench_scaling as scaling
    from domains.knowledge.stores import StoreConfig
    from tasks_core.devkit.embedded_stores import EmbeddedMilvus, EmbeddedS3
    from tasks_core.devkit.processes import free_port

    doc = Document("knowledge-ingest", public_options(opts), quick=opts.quick)
    async with BenchEnv("knowledge-ingest", opts) as env:
        milvus, s3 = EmbeddedMilvus(env.dir / "milvus"), EmbeddedS3(env.dir / "s3")
        try:
            uri = await asyncio.to_thread(milvus.start)
            endpoint = await asyncio.to_thread(s3.start)
            db_url = await env.create_database("knowledge")
            secret, hostile_secret = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
            settings = env.dtask_settings(db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency)
            if opts.embedder:
                settings["DTASK_EMBEDDER"] = opts.embedder
            if opts.beside_hostile:
                # Two tenants, under the per-owner running limit a deployment has by default (a
                # bench of one tenant gets the whole capacity).
                del settings["DTASK_OWNER_MAX_RUNNING"]
            stores = {"DTASK_MILVUS_URI": uri, **endpoint.env(), "DTASK_MINIO_BUCKET": "dtask-bench"}
            worker_env = effective_settings(settings)
            doc.settings.update(worker_env=worker_env, celery=env.celery_settings())
            keys = f"{B_KEY}:{secret}" + (f",{A_KEY}:{hostile_secret}" if opts.beside_hostile else "")
            settings.update(stores, DTASK_API_KEYS=keys)
            if opts.embedder:  # the openai embedder's server (DTASK_EMBEDDING_*): passed, not recorded
                settings.update(model.passed_environment())
            port = free_port()
            api = env.start_api(settings, port)
            worker = env.start_worker("worker", settings, concurrency=opts.concurrency)
            doc.settings["worker_startup_seconds"] = await env.wait_ready(worker)
            engine = make_engine(db_url, pool_size=2)
            headers = {"Authorization": f"Bearer {secret}"}
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=300
            ) as client:
                await _wait_api(env, client, api)
                stack = _Stack(env, client, engine, [api, worker], opts, files)
                try:
                    if opts.beside_hostile:
                        limit = Settings(  # type: ignore[call-arg]
                            _env_file=None,
                            capacity=worker_env["capacity"],
                            owner_max_running=worker_env["owner_max_running"],
                        ).owner_running_limit
                        doc.settings["owner_running_limit"] = limit
                        await _isolation(stack, doc, worker, {"Authorization": f"Bearer {hostile_secret}"})
                    elif opts.base_sizes:
                        config = StoreConfig(
                            uri, endpoint.endpoint, endpoint.access_key, endpoint.secret_key,
                            endpoint.secure, "dtask-bench", "hashing", 60.0,
                        )  # fmt: skip
                        await scaling.run(stack, doc, config, db_url, {"milvus": milvus.pid, "s3": s3.pid})
                    elif opts.embedder:
                        await model.run(stack, doc, worker.popen.pid, _ingest)
                    else:
                        await _ingest(stack, doc)
                finally:
                    await engine.dispose()
        finally:
            await asyncio.to_thread(milvus.stop)
            await asyncio.to_thread(s3.stop)
    return doc.finish()


async def _ingest(stack: _Stack, doc: Document) -> None:
    opts = stack.opts
    description = (
        f"{stack.files} files of {opts.size} bytes, {opts.batch} per multipart request, one "
        f"celery worker (prefork -c {opts.concurrency}), DTASK_CAPACITY={opts.capacity}"
    )
    rounds = Rounds({VARIANT: description})
    pooled: list[float] = []
    for round_no, seq, name in alternate([VARIANT], opts.rounds):
        base = await _create_base(stack.client, f"bench-{round_no}")
        data, latencies, _ = await _timed_upload(stack, base)
        pooled += latencies
        rounds.add(name, round_no, seq, data)
    stats = summarize(pooled)
    rounds.extra[VARIANT]["pooled_upload_to_indexed_ms"] = stats
    doc.data["variants"] = rounds.to_json()
    median = rounds.medians(VARIANT)
    doc.data["ratios"]["files/s per capacity slot"] = (
        median["files_per_s"] / opts.capacity if median.get("files_per_s") else None
    )
    doc.table(
        "knowledge ingest (upload to indexed)",
        ["variant", "files/s", "p50 ms", "p99 ms", "max ms", "files"],
        [
            [
                VARIANT,
                median.get("files_per_s"),
                stats.get("p50"),
                stats.get("p99"),
                stats.get("max"),
                stats.get("n"),
            ]
        ],
    )
    doc.note(
        "latency includes waiting for one of the capacity's slots: with N files and C slots, "
        "the last file waits for about N/C files ahead of it"
    )


async def _isolation(stack: _Stack, doc: Document, worker: Proc, hostile_headers: Mapping[str, str]) -> None:
    from domains.knowledge.hostile import hostile_set

    opts = stack.opts
    hostile = hostile_set()
    doc.settings["hostile_files"] = {name: len(content) for name, content in hostile}
    b_files = f"tenant B uploads {stack.files} files of {opts.size} bytes, {opts.batch} per request"
    workers = f"one celery worker (prefork -c {opts.concurrency}), DTASK_CAPACITY={opts.capacity}"
    rounds = Rounds(
        {
            ALONE: f"{b_files}; {workers}",
            BESIDE: f"tenant A first uploads {', '.join(n for n, _ in hostile)}; then {b_files}; {workers}",
        }
    )
    # Untimed: the first files a worker's processes take pay their imports, connections and parse
    # processes, and `alone` runs first.
    started = time.monotonic()
    _, _, warmup_tasks = await _timed_upload(stack, await _create_base(stack.client, "warmup"))
    await _settle(stack, warmup_tasks)
    doc.settings["warmup_seconds"] = time.monotonic() - started
    pooled: dict[str, list[float]] = {ALONE: [], BESIDE: []}
    for round_no, seq, name in alternate([ALONE, BESIDE], opts.rounds):
        b_base = await _create_base(stack.client, f"b-{round_no}-{name}")
        a_base = (
            await _create_base(stack.client, f"a-{round_no}", hostile_headers) if name == BESIDE else None
        )
        task_ids: list[uuid.UUID] = []
        async with PeakRss(worker.popen.pid) as rss:
            if a_base is not None:
                a_first = await db_now(stack.engine)
                _, a_tasks = await _upload(stack, a_base, hostile, len(hostile), hostile_headers)
                task_ids += a_tasks
            data, latencies, b_tasks = await _timed_upload(stack, b_base)
            task_ids += b_tasks
            # Untimed: A's files, and every task of the round, end before the next round starts.
            await _settle(stack, task_ids)
        data["worker_peak_rss_mb"] = rss.peak / MB
        if a_base is not None:
            endings = await _endings(stack.engine, a_base, a_first)
            data["a_files"] = len(endings)
            data["a_error_parsing"] = sum(e["status"] == "error_parsing" for e in endings)
            data["a_endings"] = endings
        pooled[name] += latencies
        rounds.add(name, round_no, seq, data)
    _isolation_report(doc, rounds, pooled)


def _isolation_report(doc: Document, rounds: Rounds, pooled: Mapping[str, list[float]]) -> None:
    stats = {name: summarize(values) for name, values in pooled.items()}
    for name, summary in stats.items():
        rounds.extra[name]["pooled_upload_to_indexed_ms"] = summary
    endings = [e for r in rounds.rounds[BESIDE] for e in r["a_endings"]]
    rounds.extra[BESIDE]["a_files"] = len(endings)
    rounds.extra[BESIDE]["a_error_parsing"] = sum(e["status"] == "error_parsing" for e in endings)
    doc.data["variants"] = rounds.to_json()
    doc.data["ratios"][TIME_RATIO] = ratio(
        rounds.median(BESIDE, "elapsed_seconds"), rounds.median(ALONE, "elapsed_seconds")
    )
    doc.data["ratios"][P99_RATIO] = ratio(stats[BESIDE].get("p99"), stats[ALONE].get("p99"))
    rows = []
    for name in (ALONE, BESIDE):
        median = rounds.medians(name)
        peaks = [r["worker_peak_rss_mb"] for r in rounds.rounds[name]]
        a = rounds.extra[name]
        rows.append(
            [
                name,
                median.get("files_per_s"),
                stats[name].get("p50"),
                stats[name].get("p99"),
                median.get("elapsed_seconds"),
                max(peaks) if peaks else None,
                f"{a['a_error_parsing']} of {a['a_files']}" if name == BESIDE else None,
            ]
        )
    doc.table(
        "tenant B's files beside tenant A's hostile documents",
        [
            "variant",
            "B files/s",
            "B p50 ms",
            "B p99 ms",
            "B round s",
            "worker peak MB",
            "A error_parsing",
        ],
        rows,
    )
    doc.note("target: the first ratio (B's time beside A's hostile files / alone) at most 1.5")
    doc.note(
        f"worker peak RSS: main, pool processes and parse processes, sampled every {RSS_INTERVAL:g} s "
        "from the round's first request until its last task ended"
    )
    for (filename, status, message), seen in _by_ending(endings).items():
        doc.note(
            f"A's {filename}: {status} in {len(seen)} of {len(rounds.rounds[BESIDE])} rounds, "
            f"{min(seen):.1f}-{max(seen):.1f} s after A's request: {message}"
        )


async def _settle(stack: _Stack, task_ids: Sequence[uuid.UUID]) -> None:
    """Until every one of these tasks has ended, so the next round starts on an idle system."""
    await wait_terminal(
        stack.env,
        stack.engine,
        len(task_ids),
        ids=task_ids,
        procs=stack.procs,
        stall_seconds=stack.opts.stall_seconds,
    )


def _by_ending(endings: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[float]]:
    """Seconds to each ending, by (file name, status, message)."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for e in endings:
        out.setdefault((e["filename"], e["status"], e["error_message"] or ""), []).append(e["seconds"])
    return out


class PeakRss:
    """The peak RSS of a process and all its descendants, sampled every ``interval`` s while in use."""

    def __init__(self, pid: int, interval: float = RSS_INTERVAL) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample_once()

    async def _sample(self) -> None:
        while True:
            self._sample_once()
            await asyncio.sleep(self.interval)

    def _sample_once(self) -> None:
        self.peak = max(self.peak, tree_rss(self.pid))


def _tree(pid: int) -> list[Any]:
    """``pid`` and its descendants as psutil processes (none once it is gone)."""
    import psutil  # the embedded extra, which this bench needs for Milvus and S3 anyway

    try:
        main = psutil.Process(pid)
        return [main, *main.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants, the ended ones it waited for
    included (0 once it is gone)."""
    import psutil

    total = 0.0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its live descendants (0 once it is gone)."""
    import psutil

    total = 0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


async def _wait_api(env: BenchEnv, client: httpx.AsyncClient, api: Any) -> None:
    async def answers() -> bool:
        try:
            return (await client.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    await poll(answers, within=60, interval=0.2, what="the api to answer", check=lambda: env.check_alive(api))


async def _create_base(
    client: httpx.AsyncClient, label: str, headers: Mapping[str, str] | None = None
) -> str:
    r = await client.post("/knowledge/bases", json={"name": f"{label}-{time.time_ns()}"}, headers=headers)
    if r.status_code != 201:
        raise BenchError(f"creating a base failed: {r.status_code} {r.text}")
    return str(r.json()["id"])


async def _upload(
    stack: _Stack,
    base: str,
    files: Sequence[tuple[str, bytes]],
    batch: int,
    headers: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], list[uuid.UUID]]:
    """Uploads in requests of ``batch`` files; each file's PostgreSQL time just before its request
    was sent, and the files' tasks (each once)."""
    sent_at: dict[str, Any] = {}
    tasks: list[uuid.UUID] = []
    for start in range(0, len(files), batch):
        parts = [
            ("files", (name, content, _content_type(name))) for name, content in files[start : start + batch]
        ]
        at = await db_now(stack.engine)
        r = await stack.client.post(f"/knowledge/bases/{base}/files", files=parts, headers=headers)
        if r.status_code != 202:
            raise BenchError(f"upload failed: {r.status_code} {r.text[:500]}")
        for f in r.json()["files"]:
            sent_at[f["id"]] = at
            tasks.append(uuid.UUID(f["task_id"]))
    return sent_at, list(dict.fromkeys(tasks))  # small files share a task


def _content_type(name: str) -> str:
    return "application/pdf" if name.endswith(".pdf") else "text/plain"


def named_document(n: int, size: int) -> tuple[str, bytes]:
    return f"doc-{n:05d}.txt", document(n, size)


async def _timed_upload(
    stack: _Stack, base: str, first: int = 0, files: int | None = None
) -> tuple[dict[str, Any], list[float], list[uuid.UUID]]:
    """The bench's documents ``first``.. (``files`` of them, default the round's) into ``base``, from
    the first request until the last file is done: the round's figures, each indexed file's
    upload-to-indexed ms, and the files' tasks."""
    opts = stack.opts
    count = stack.files if files is None else files
    docs = [named_document(n, opts.size) for n in range(first, first + count)]
    started = await db_now(stack.engine)
    sent_at, tasks = await _upload(stack, base, docs, opts.batch)
    ids = list(sent_at)
    await _wait_done(stack, ids)
    async with stack.engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT f.file_id, f.status, f.updated_at, t.finished_at - t.started_at "
                    "FROM knowledge_files f LEFT JOIN tasks t ON t.id = f.task_id "
                    "WHERE f.file_id = ANY(:ids)"
                ),
                {"ids": ids},
            )
        ).all()
    indexed = [r for r in rows if r[1] == "indexed"]
    latencies = [seconds(r[2] - sent_at[r[0]]) * 1000 for r in indexed]
    elapsed = seconds(max(r[2] for r in rows) - started)
    stats = summarize(latencies)
    # A task's run, claim to end: the cost of its files' index calls without the wait for a slot
    # (per file, so a task of several files counts once for each).
    runs = summarize([seconds(r[3]) * 1000 for r in indexed if r[3] is not None])
    return (
        {
            "files": len(rows),
            "indexed": len(indexed),
            "errors": len(rows) - len(indexed),
            "files_per_s": len(indexed) / elapsed if elapsed > 0 else None,
            "elapsed_seconds": elapsed,
            "p50_ms": stats.get("p50"),
            "p99_ms": stats.get("p99"),
            "task_run_p50_ms": runs.get("p50"),
            "tasks": len(tasks),
        },
        latencies,
        tasks,
    )


async def _endings(engine: Any, base: str, since: Any) -> list[dict[str, Any]]:
    """How each file of ``base`` ended, and how many seconds after ``since``."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT filename, status, error_message, updated_at FROM knowledge_files "
                    "WHERE kb_id = :kb ORDER BY filename"
                ),
                {"kb": base},
            )
        ).all()
    return [
        {"filename": name, "status": status, "error_message": message, "seconds": seconds(at - since)}
        for name, status, message, at in rows
    ]


async def _wait_done(stack: _Stack, file_ids: Sequence[str]) -> None:
    """Until these files are indexed or errored; fails when nothing moves for ``stall_seconds``."""
    query = text(
        "SELECT count(*) FROM knowledge_files WHERE file_id = ANY(:ids) "
        "AND status IN ('indexed', 'error_parsing', 'error_indexing')"
    )
    expected = len(file_ids)
    last, changed = -1, time.monotonic()
    while True:
        stack.env.check_alive(*stack.procs)
        async with stack.engine.connect() as conn:
            done = int((await conn.execute(query, {"ids": list(file_ids)})).scalar_one())
        if done >= expected:
            return
        if done != last:
            last, changed = done, time.monotonic()
        elif time.monotonic() - changed > stack.opts.stall_seconds:
            raise BenchError(
                f"no file finished for {stack.opts.stall_seconds:g} s ({done} of {expected});\n"
                + stack.env.logs()
            )
        await asyncio.sleep(0.1)
