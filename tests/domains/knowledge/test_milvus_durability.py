"""Acknowledged vectors survive a crash of the embedded Milvus (milvus-lite), whatever the number of
processes writing to one collection at once: it runs with one request thread, so concurrent
writes can never interleave in its write-ahead log (interleaved, the log is cut at the first torn
record when the server restarts, and every write after it is lost for good). Real milvus-lite of
its own, SIGKILLed and restarted on its port."""

from __future__ import annotations

import asyncio
import random

from domains.knowledge import vectors
from domains.knowledge.catalog import new_id
from tests.store_faults import FaultyStores

WRITERS = 4
FILES_EACH = 25
CHUNKS = 30  # per file: 3,000 vectors of 1,024 dimensions in all, written in 64-row batches
DEADLINE = 30.0


async def test_concurrently_written_vectors_survive_a_kill_and_restart(faulty_stores: FaultyStores) -> None:
    uri = faulty_stores.env["DTASK_MILVUS_URI"]
    client = await vectors.call(DEADLINE, vectors.connect, uri)
    name = vectors.collection_name(new_id())
    await vectors.ensure_collection(client, name, 1024, DEADLINE)
    index = vectors.BaseIndex(client, name, DEADLINE)
    rng = random.Random(7)

    async def writer(w: int) -> None:
        for f in range(FILES_EACH):
            file_id = f"w{w}f{f}"
            rows = [[rng.random() for _ in range(1024)] for _ in range(CHUNKS)]
            await index.upsert(file_id, [f"{file_id}-{i}" for i in range(CHUNKS)], rows)

    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    written = WRITERS * FILES_EACH * CHUNKS
    assert await index.count() == written

    faulty_stores.kill("milvus")
    faulty_stores.restart("milvus")
    client = await vectors.call(DEADLINE, vectors.connect, uri)
    await vectors.ensure_collection(client, name, 1024, DEADLINE)  # loads it again
    assert await vectors.BaseIndex(client, name, DEADLINE).count() == written
    await vectors.drop_collection(client, name, DEADLINE)
