"""graph.build: entities and co-occurrence edges of a base's chunks, counted batch by batch.

Each batch is read in one owning transaction, its entities extracted in a thread (no transaction
open meanwhile), and its counts added in a second owning transaction that also moves the build's
checkpoint by compare-and-set. A retry (after a lost lease or a worker shutdown) takes the build
over under its new attempt token and resumes at the checkpoint, so the finished graph equals the
graph of a build that was never interrupted. The success hook makes it the base's graph.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from domains.graph import store
from domains.graph.extraction import BatchCounts, count_chunks, load_extractor
from domains.graph.model import BUILDING
from domains.graph.payloads import BuildPayload
from domains.graph.settings import GraphSettings
from domains.graph.store import Position
from tasks_core.worker.context import TaskContext

log = logging.getLogger(__name__)


async def build(ctx: TaskContext) -> Any:
    payload = BuildPayload.model_validate(ctx.payload)
    settings = GraphSettings()
    extractor = load_extractor(settings.extractor)
    token = ctx.attempt_token
    async with ctx.owning_transaction() as conn:
        row = await store.take_over(conn, ctx.task_id, token, extractor.name)
        if row is None:
            # The base (and its builds) was deleted meanwhile: nothing to build.
            return {"base_id": payload.base_id, "skipped": "the base or its build is gone"}
        total = await store.count_chunks(conn, payload.base_id)
        await store.set_total(conn, row["id"], token, total)
    build_id = row["id"]
    pos: Position = None if row["cursor_file"] is None else (row["cursor_file"], int(row["cursor_seq"]))
    done = resumed_from = int(row["chunks_done"])
    if row["extractor"] != extractor.name:
        # A retry on a worker configured differently would mix two extractors in one graph.
        raise ValueError(
            f"the build started with extractor {row['extractor']!r}; this worker has {extractor.name!r} "
            "(set DTASK_GRAPH_EXTRACTOR alike on every worker)"
        )
    while True:
        ctx.raise_if_cancelled()
        async with ctx.owning_transaction() as conn:
            chunks = await store.chunks_after(conn, payload.base_id, pos, settings.batch_chunks)
        if not chunks:
            break
        counts = await asyncio.to_thread(count_chunks, extractor, [c[2] for c in chunks])
        last = (chunks[-1][0], chunks[-1][1])
        write = _batch_writer(build_id, token, pos, last, len(chunks), counts)
        if await ctx.run_in_owning_transaction(write):
            pos, done = last, done + len(chunks)
        else:
            # Not where we left it: a COMMIT whose answer was lost went through after all. The
            # build's own row says where it is.
            async with ctx.owning_transaction() as conn:
                where = await store.position(conn, build_id)
            if where is None:
                # The base was deleted meanwhile (its builds go with it): nothing left to build.
                return {"base_id": payload.base_id, "skipped": "the base was deleted during the build"}
            pos, done, status = where
            if status != BUILDING:
                raise RuntimeError(f"graph build {build_id} is {status}, not building")
            log.info("graph build %s: checkpoint re-read at %s", build_id, pos)
        await ctx.report(100.0 * done / max(1, total, done), f"{done} of {total} chunks")
    return {
        "base_id": payload.base_id,
        "build_id": str(build_id),
        "chunks": done,
        "resumed_from": resumed_from,
        "attempt": ctx.attempt,
        "extractor": extractor.name,
    }


def _batch_writer(
    build_id: uuid.UUID,
    token: uuid.UUID,
    before: Position,
    last: tuple[str, int],
    n: int,
    counts: BatchCounts,
) -> Callable[[AsyncConnection], Awaitable[bool]]:
    """One batch's transaction: the checkpoint step first, and the counts only if it took."""

    async def write(conn: AsyncConnection) -> bool:
        if not await store.checkpoint(conn, build_id, token, before, last, n):
            return False
        await store.add_counts(conn, build_id, counts)
        return True

    return write
