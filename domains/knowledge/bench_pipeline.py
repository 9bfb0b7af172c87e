"""The knowledge bench's plain pipeline, and the pre-fill of a base with N indexed files.

Both do, per file, what an ingest does without the task system: parse and chunk (the parse
process's own function, in-process), embed, put the original to S3, insert its vectors into Milvus,
and write its file row (``indexed``) and chunk rows in one PostgreSQL transaction. The pre-fill does
it for many files per call (bulk statements, a few S3 puts at once) so a base of 10,000 files takes
about a minute; the result is a base like any other: originals, vectors and rows that agree.

The plain pipeline runs ``concurrency`` worker processes (spawned, each with its own event loop and
store clients) that take one file at a time from a shared pool, as the capacity's slots take tasks:
its files/s beside the durable system's at the same concurrency is the cost of durability.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from domains.knowledge.model import INDEXED
from domains.knowledge.parse_child import parse
from domains.knowledge.parse_process import ParseLimits
from domains.knowledge.settings import get_knowledge_settings
from domains.knowledge.storage import object_key
from domains.knowledge.stores import KnowledgeStores, StoreConfig
from tasks_core.db import make_engine
from tasks_core.devkit.bench.common import BenchError

# Files per pre-fill step: one Milvus insert call (about 2 MiB of vectors), one transaction.
PREFILL_BATCH = 64
# S3 puts in flight during a pre-fill step.
PREFILL_PUTS = 8
# Seconds the plain pipeline's processes may take to start and connect.
READY_SECONDS = 120.0

_INSERT_FILE = text(
    f"""INSERT INTO knowledge_files
       (file_id, kb_id, filename, file_type, size_bytes, status, chunk_count, content_hash)
    VALUES (:file_id, :kb_id, :filename, 'txt', :size_bytes, '{INDEXED}', :chunk_count, :content_hash)"""
)
_INSERT_CHUNK = text(
    """INSERT INTO knowledge_chunks (chunk_id, file_id, seq, text, attempt_token)
    VALUES (:chunk_id, :file_id, :seq, :text, :tok)"""
)


@dataclass(frozen=True)
class Target:
    """Where the files go: the stores, the database and the base (made over HTTP, so it is real)."""

    stores: StoreConfig
    db_url: str
    base_id: str
    dimension: int


@dataclass
class _Prepared:
    file_id: str
    filename: str
    data: bytes
    chunks: list[str]
    vectors: list[list[float]]


def _prepare(stores: KnowledgeStores, filename: str, data: bytes) -> _Prepared:
    limits = ParseLimits.from_settings(get_knowledge_settings())
    chunks = parse(data, "txt", limits.max_chars, limits.max_chunks)
    return _Prepared(uuid.uuid4().hex, filename, data, chunks, stores.embedder.embed(chunks))


async def _store(stores: KnowledgeStores, engine: Any, target: Target, files: Sequence[_Prepared]) -> None:
    """Originals to S3, vectors to Milvus (plain inserts: new chunk ids), rows in one transaction."""
    objects = await stores.objects()
    puts = asyncio.Semaphore(PREFILL_PUTS)

    async def put(f: _Prepared) -> None:
        async with puts:
            key = object_key(target.base_id, f.file_id)
            await objects.put(key, io.BytesIO(f.data), len(f.data), "text/plain")

    await asyncio.gather(*(put(f) for f in files))
    index = await stores.index(target.base_id, target.dimension)
    await index.insert(
        [(f.file_id, [f"{f.file_id}-{seq}" for seq in range(len(f.chunks))], f.vectors) for f in files]
    )
    token = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            _INSERT_FILE,
            [
                {
                    "file_id": f.file_id,
                    "kb_id": target.base_id,
                    "filename": f.filename,
                    "size_bytes": len(f.data),
                    "chunk_count": len(f.chunks),
                    "content_hash": hashlib.sha256(f.data).hexdigest(),
                }
                for f in files
            ],
        )
        rows = [
            {"chunk_id": f"{f.file_id}-{seq}", "file_id": f.file_id, "seq": seq, "text": t, "tok": token}
            for f in files
            for seq, t in enumerate(f.chunks)
        ]
        if rows:
            await conn.execute(_INSERT_CHUNK, rows)


def _prepare_all(stores: KnowledgeStores, docs: Sequence[tuple[str, bytes]]) -> list[_Prepared]:
    return [_prepare(stores, name, data) for name, data in docs]


async def prefill(target: Target, docs: Callable[[int], tuple[str, bytes]], count: int) -> None:
    """``count`` files ``docs(0..count-1)`` into the base, indexed, in bulk steps."""
    stores = KnowledgeStores(target.stores)
    engine = make_engine(target.db_url, pool_size=1)
    try:
        for start in range(0, count, PREFILL_BATCH):
            batch = [docs(n) for n in range(start, min(count, start + PREFILL_BATCH))]
            prepared = await asyncio.to_thread(_prepare_all, stores, batch)
            await _store(stores, engine, target, prepared)
    finally:
        await engine.dispose()


async def base_counts(target: Target) -> dict[str, int]:
    """What the base holds now: indexed files, chunk rows, vectors and originals (read back)."""
    stores = KnowledgeStores(target.stores)
    engine = make_engine(target.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            files, chunks = (
                await conn.execute(
                    text(
                        f"""SELECT count(*) FILTER (WHERE f.status = '{INDEXED}'),
                       (SELECT count(*) FROM knowledge_chunks c JOIN knowledge_files g
                        ON g.file_id = c.file_id WHERE g.kb_id = :kb)
                FROM knowledge_files f WHERE f.kb_id = :kb"""
                    ),
                    {"kb": target.base_id},
                )
            ).one()
        vectors = await (await stores.index(target.base_id, target.dimension)).count()
        objects = await stores.objects()
        originals = len(await objects.listing(f"{target.base_id}/"))
    finally:
        await engine.dispose()
    return {
        "indexed_files": int(files),
        "chunk_rows": int(chunks),
        "vectors": vectors,
        "originals": originals,
    }


# ------------------------------------------------------------------------------------ plain pipeline

# One per plain worker process: its loop, stores and engine, built by _init.
_process: dict[str, Any] = {}


def _init(target: Target) -> None:
    loop = asyncio.new_event_loop()
    stores = KnowledgeStores(target.stores)
    engine = make_engine(target.db_url, pool_size=1)

    async def warm() -> None:
        # What a warm worker has too: clients connected, the collection's handle built.
        await stores.objects()
        await stores.index(target.base_id, target.dimension)
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    loop.run_until_complete(warm())
    _process.update(loop=loop, stores=stores, engine=engine, target=target)


def _ready() -> tuple[int, float]:
    return os.getpid(), time.process_time()


def _one(filename: str, data: bytes) -> tuple[float, int, float]:
    """One file, start to end: the wall clock (time.time()) when it was stored, and this process's
    id and CPU seconds then."""
    stores: KnowledgeStores = _process["stores"]
    prepared = _prepare(stores, filename, data)
    _process["loop"].run_until_complete(_store(stores, _process["engine"], _process["target"], [prepared]))
    return time.time(), os.getpid(), time.process_time()


@dataclass(frozen=True)
class PlainRun:
    seconds: float  # from the first file taken to the last one stored
    done: list[float]  # each file's seconds from that start until it was stored
    cpu_seconds: float  # of the pool's processes over the same span (their start-up excluded)


def run_plain(target: Target, docs: Sequence[tuple[str, bytes]], concurrency: int) -> PlainRun:
    """The files through ``concurrency`` warm processes, one file at a time each."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(concurrency, mp_context=context, initializer=_init, initargs=(target,)) as pool:
        # Every process started and warm before the clock starts.
        ready: dict[int, float] = {}
        deadline = time.monotonic() + READY_SECONDS
        while len(ready) < concurrency:
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(ready)} of the plain pipeline's {concurrency} processes started")
            ready.update(f.result() for f in [pool.submit(_ready) for _ in range(concurrency * 4)])
            time.sleep(0.05)  # a process still connecting answers once it is up
        started = time.time()
        results = [f.result() for f in [pool.submit(_one, name, data) for name, data in docs]]
    cpu: dict[int, float] = {}
    for _, pid, used in results:
        cpu[pid] = max(cpu.get(pid, 0.0), used)
    return PlainRun(
        max(t for t, _, _ in results) - started,
        [t - started for t, _, _ in results],
        sum(used - ready.get(pid, used) for pid, used in cpu.items()),
    )
