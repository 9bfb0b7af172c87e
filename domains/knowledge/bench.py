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
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import text

from tasks_core.bench.common import (
    BenchEnv,
    BenchError,
    CommonOptions,
    effective_settings,
    poll,
    public_options,
    seconds,
)
from tasks_core.bench.report import Document, Rounds, alternate, summarize
from tasks_core.db import db_now, make_engine

VARIANT = "batch-upload"
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
    files: int = 200
    size: int = 4096  # bytes per file
    batch: int = 100  # files per upload request
    capacity: int = 4
    concurrency: int = 6
    stall_seconds: float = 120.0


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
    if opts.batch < 1 or opts.files < 1 or opts.size < 16:
        raise ValueError("--files and --batch must be positive and --size at least 16 bytes")
    return asyncio.run(_run(opts))


async def _run(opts: IngestOptions) -> dict[str, Any]:
    from tasks_core.embedded import free_port
    from tasks_core.embedded_stores import EmbeddedMilvus, EmbeddedS3

    description = (
        f"{opts.files} files of {opts.size} bytes, {opts.batch} per multipart request, one "
        f"celery worker (prefork -c {opts.concurrency}), DTASK_CAPACITY={opts.capacity}"
    )
    doc = Document("knowledge-ingest", public_options(opts), quick=opts.quick)
    rounds = Rounds({VARIANT: description})
    pooled: list[float] = []
    async with BenchEnv("knowledge-ingest", opts) as env:
        milvus, s3 = EmbeddedMilvus(env.dir / "milvus"), EmbeddedS3(env.dir / "s3")
        try:
            uri = await asyncio.to_thread(milvus.start)
            endpoint = await asyncio.to_thread(s3.start)
            db_url = await env.create_database("knowledge")
            secret = secrets.token_urlsafe(24)
            settings = env.dtask_settings(db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency)
            stores = {"DTASK_MILVUS_URI": uri, **endpoint.env(), "DTASK_MINIO_BUCKET": "dtask-bench"}
            doc.settings.update(worker_env=effective_settings(settings), celery=env.celery_settings())
            settings.update(stores, DTASK_API_KEYS=f"bench:{secret}")
            port = free_port()
            api = env.spawn(
                "api",
                [sys.executable, "-m", "tasks_core.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
                settings,
            )
            worker = env.start_worker("worker", settings, concurrency=opts.concurrency)
            doc.settings["worker_startup_seconds"] = await env.wait_ready(worker)
            engine = make_engine(db_url, pool_size=2)
            headers = {"Authorization": f"Bearer {secret}"}
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=300
            ) as client:
                await _wait_api(env, client, api)
                try:
                    for round_no, seq, name in alternate([VARIANT], opts.rounds):
                        data, latencies = await _round(env, client, engine, opts, round_no, [api, worker])
                        pooled += latencies
                        rounds.add(name, round_no, seq, data)
                finally:
                    await engine.dispose()
        finally:
            await asyncio.to_thread(milvus.stop)
            await asyncio.to_thread(s3.stop)
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
    return doc.finish()


async def _wait_api(env: BenchEnv, client: httpx.AsyncClient, api: Any) -> None:
    async def answers() -> bool:
        try:
            return (await client.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    await poll(answers, within=60, interval=0.2, what="the api to answer", check=lambda: env.check_alive(api))


async def _round(
    env: BenchEnv,
    client: httpx.AsyncClient,
    engine: Any,
    opts: IngestOptions,
    round_no: int,
    procs: list[Any],
) -> tuple[dict[str, Any], list[float]]:
    r = await client.post("/knowledge/bases", json={"name": f"bench-{round_no}-{time.time_ns()}"})
    if r.status_code != 201:
        raise BenchError(f"creating a base failed: {r.status_code} {r.text}")
    base = r.json()["id"]
    sent_at: dict[str, Any] = {}
    first = await db_now(engine)
    for start in range(0, opts.files, opts.batch):
        names = range(start, min(start + opts.batch, opts.files))
        parts = [("files", (f"doc-{n:05d}.txt", document(n, opts.size), "text/plain")) for n in names]
        at = await db_now(engine)
        r = await client.post(f"/knowledge/bases/{base}/files", files=parts)
        if r.status_code != 202:
            raise BenchError(f"upload failed: {r.status_code} {r.text[:500]}")
        sent_at.update({f["id"]: at for f in r.json()["files"]})
    await _wait_done(env, engine, base, opts, procs)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT file_id, status, updated_at FROM knowledge_files WHERE kb_id = :kb"),
                {"kb": base},
            )
        ).all()
    indexed = [r for r in rows if r[1] == "indexed"]
    latencies = [seconds(r[2] - sent_at[r[0]]) * 1000 for r in indexed]
    elapsed = seconds(max(r[2] for r in rows) - first)
    stats = summarize(latencies)
    return {
        "files": len(rows),
        "indexed": len(indexed),
        "errors": len(rows) - len(indexed),
        "files_per_s": len(indexed) / elapsed if elapsed > 0 else None,
        "elapsed_seconds": elapsed,
        "p50_ms": stats.get("p50"),
        "p99_ms": stats.get("p99"),
    }, latencies


async def _wait_done(env: BenchEnv, engine: Any, base: str, opts: IngestOptions, procs: list[Any]) -> None:
    """Until every file is indexed or errored; fails when nothing moves for ``stall_seconds``."""
    query = text(
        "SELECT count(*) FROM knowledge_files WHERE kb_id = :kb "
        "AND status IN ('indexed', 'error_parsing', 'error_indexing')"
    )
    last, changed = -1, time.monotonic()
    while True:
        env.check_alive(*procs)
        async with engine.connect() as conn:
            done = int((await conn.execute(query, {"kb": base})).scalar_one())
        if done >= opts.files:
            return
        if done != last:
            last, changed = done, time.monotonic()
        elif time.monotonic() - changed > opts.stall_seconds:
            raise BenchError(
                f"no file finished for {opts.stall_seconds:g} s ({done} of {opts.files});\n" + env.logs()
            )
        await asyncio.sleep(0.1)
