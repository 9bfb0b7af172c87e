"""knowledge.ingest / knowledge.reindex: parse, chunk, embed and index files as their owning attempt.

A file moves ``uploaded -> parsing -> parsed -> indexing -> indexed`` (or ``error_parsing`` /
``error_indexing``); each move is one short owning transaction that also names this task and
attempt, so an attempt that lost its lease, or a file taken over by a newer task, writes nothing.
Blocking work (S3, embedding, Milvus) runs in threads between those transactions; parsing runs in
a child process with memory, time, text and chunk limits (``parse_process``), killed on cancel.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from domains.knowledge import catalog
from domains.knowledge.embedding import embed_texts
from domains.knowledge.errors import CollectionMissing, ObjectMissing, StoreError, StoreUnavailable
from domains.knowledge.model import ERROR_INDEXING, ERROR_PARSING, INDEXED, INDEXING, PARSED, PARSING
from domains.knowledge.parse_process import ParseLimits, parse_file
from domains.knowledge.parsing import ParseError
from domains.knowledge.settings import get_knowledge_settings
from domains.knowledge.storage import object_key
from domains.knowledge.stores import KnowledgeStores, stores_for
from domains.knowledge.tasks import INGEST
from domains.knowledge.vectors import BaseIndex
from tasks_core.retry import RetryableError
from tasks_core.settings import Settings
from tasks_core.worker.context import TaskContext

log = logging.getLogger(__name__)
# Chunks embedded (and upserted) per step: progress, cancel checks and bounded thread calls.
EMBED_BATCH = 32
# A base reindex's result names at most this many files that ended in an error state.
MAX_ERRORS_REPORTED = 100


class FileFailed(Exception):
    """The file ended in an error state (the message is on the file too)."""


class FileGone(Exception):
    """The file was deleted, or a newer task owns it now: this attempt has nothing more to do."""


@dataclass
class Outcome:
    file_id: str
    status: str
    chunks: int = 0
    error: str | None = None


# Reading Settings() (the environment and .env, validated) takes about 5 ms: a sixth of a small
# file's worker CPU while it ran for every task. Kept until the DTASK_* environment, or the
# directory whose .env it reads, changes.
_settings: tuple[tuple[object, ...], Settings] | None = None


def _current_settings() -> Settings:
    global _settings
    key = (os.getcwd(), *sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("DTASK_")))
    if _settings is None or _settings[0] != key:
        _settings = (key, Settings())
    return _settings[1]


def _stores() -> KnowledgeStores:
    # Read when a task runs, not at import: a worker's settings come from its environment (and .env).
    return stores_for(_current_settings())


def _text(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"payload.{key} must be a non-empty string")
    return value


async def ingest(ctx: TaskContext) -> Any:
    file_id = _text(ctx.payload, "file_id")
    if file_id is None:
        raise ValueError("payload.file_id is required")
    return await _one(ctx, _stores(), file_id)


async def reindex(ctx: TaskContext) -> Any:
    file_id, base_id = _text(ctx.payload, "file_id"), _text(ctx.payload, "base_id")
    stores = _stores()
    if file_id is not None:
        return await _one(ctx, stores, file_id)
    if base_id is None:
        raise ValueError("payload needs file_id or base_id")
    async with ctx.owning_transaction() as conn:
        file_ids = await catalog.owned_in_progress(conn, ctx.task_id)
    for n, fid in enumerate(file_ids, 1):
        ctx.raise_if_cancelled()
        with contextlib.suppress(FileGone):  # deleted meanwhile: nothing to do for it
            await index_file(ctx, stores, fid)
        await ctx.report(100.0 * n / len(file_ids), f"{n} of {len(file_ids)} files")
    # Counted from the files, so files an earlier attempt of this task finished count too.
    async with ctx.owning_transaction() as conn:
        counts, errors = await catalog.task_outcome(conn, ctx.task_id, MAX_ERRORS_REPORTED)
    return {
        "base_id": base_id,
        "files": sum(counts.values()),
        "indexed": counts.get(INDEXED, 0),
        "errors": errors,
    }


async def _one(ctx: TaskContext, stores: KnowledgeStores, file_id: str) -> Any:
    try:
        outcome = await index_file(ctx, stores, file_id)
    except FileGone as exc:
        return {"file_id": file_id, "skipped": str(exc)}
    if outcome.error:
        raise FileFailed(f"{outcome.status}: {outcome.error}")
    return {"file_id": file_id, "status": outcome.status, "chunks": outcome.chunks}


async def index_file(ctx: TaskContext, stores: KnowledgeStores, file_id: str) -> Outcome:
    """One file, start to end, as this attempt. Raises FileGone if the file is not ours (any more),
    RetryableError when a store does not answer (the task waits and tries again)."""
    task, token = ctx.task_id, ctx.attempt_token
    async with ctx.owning_transaction() as conn:
        row = await catalog.start(conn, file_id, task, token)
    if row is None:
        raise FileGone(f"file {file_id} was deleted or is owned by another task")
    base_id, name = row["kb_id"], row["filename"]

    async def fail(state: str, message: str) -> Outcome:
        async with ctx.owning_transaction() as conn:
            if not await catalog.fail(conn, file_id, task, token, state, message):
                raise FileGone(f"file {file_id} was deleted or taken over")
        return Outcome(file_id, state, error=message)

    async def move(expect: str, to: str, **values: Any) -> None:
        async with ctx.owning_transaction() as conn:
            if not await catalog.advance(conn, file_id, task, token, expect, to, **values):
                raise FileGone(f"file {file_id} was deleted or taken over")

    @contextlib.asynccontextmanager
    async def store_step() -> AsyncIterator[None]:
        """A store that fails here is waited out (the task goes back to pending with backoff), unless
        the file went away meanwhile: deleting a base drops its collection under a running ingest."""
        try:
            yield
        except (StoreUnavailable, CollectionMissing) as exc:
            async with ctx.owning_transaction() as conn:
                ours = await catalog.note(conn, file_id, task, token, f"attempt {ctx.attempt}: {exc}")
            if not ours:
                raise FileGone(f"file {file_id} was deleted or taken over") from exc
            raise RetryableError(str(exc), code="store_unavailable") from exc

    # -- parse (the file's own status says where it is; reports are kept to progress)
    async with store_step():
        objects = await stores.objects()
        try:
            data = await objects.get(object_key(base_id, file_id))
        except ObjectMissing:
            return await fail(ERROR_PARSING, "the uploaded original is missing from the object store")
    ctx.raise_if_cancelled()
    try:
        texts = await parse_file(data, row["file_type"], ParseLimits.from_settings(get_knowledge_settings()))
    except ParseError as exc:
        return await fail(ERROR_PARSING, str(exc))
    chunk_ids = [f"{file_id}-{seq}" for seq in range(len(texts))]
    # Chunk ids are <file>-<seq>, so the upserts below overwrite every vector an earlier attempt or
    # an earlier version of the file wrote, except those past this version's last chunk: they are
    # removed first, by id, before the chunk rows that count them are replaced (so a crash between
    # the two leaves a count that still covers every vector there may be).
    stale = [f"{file_id}-{seq}" for seq in range(len(texts), row["chunk_rows"])]
    if stale:
        async with store_step():
            await (await _index(stores, base_id, row["dimension"])).delete_chunks(stale)
    async with ctx.owning_transaction() as conn:
        if not await catalog.advance(conn, file_id, task, token, PARSING, PARSED):
            raise FileGone(f"file {file_id} was deleted or taken over")
        await catalog.replace_chunks(conn, file_id, token, chunk_ids, texts)

    # -- index
    embedder = stores.embedder
    if (embedder.name, embedder.dimension) != (row["embedder"], row["dimension"]):
        return await fail(
            ERROR_INDEXING,
            (
                f"the base was built with embedder {row['embedder']} ({row['dimension']} dimensions); this "
                f"worker embeds with {embedder.name} ({embedder.dimension}): set DTASK_EMBEDDER to match"
            ),
        )
    await move(PARSED, INDEXING)
    ctx.raise_if_cancelled()
    # Only an upload's first attempt, on a file that never had chunk rows, knows that none of its
    # chunk ids has a vector (an earlier attempt writes chunk rows before any vector): it inserts.
    # Every other attempt upserts, so whatever an earlier one left is overwritten, never doubled.
    fresh = ctx.task_type == INGEST and ctx.attempt == 1 and row["chunk_rows"] == 0
    async with store_step():
        index = await _index(stores, base_id, row["dimension"])
        try:
            await _replace_vectors(ctx, index, embedder, file_id, name, chunk_ids, texts, fresh=fresh)
        except CollectionMissing:
            # Dropped since this process cached the handle (by hand, or a restarted Milvus released
            # it): built again once, unless the base itself is gone (then the file is too). Some of
            # this attempt's vectors may be there (a released collection keeps them): upserted.
            stores.indexes.forget(base_id)
            await move(INDEXING, INDEXING)
            index = await _index(stores, base_id, row["dimension"])
            await _replace_vectors(ctx, index, embedder, file_id, name, chunk_ids, texts, fresh=False)
    try:
        await move(INDEXING, INDEXED, chunk_count=len(texts), error_message=None)
    except FileGone:
        # Deleted while we indexed: take our vectors back out rather than leave orphans (with the
        # whole base deleted, its collection is gone already).
        with contextlib.suppress(StoreError):  # the base's collection may be gone: nothing to remove
            await index.delete_file(file_id)
        raise
    return Outcome(file_id, INDEXED, chunks=len(texts))


async def _index(stores: KnowledgeStores, base_id: str, dimension: int) -> BaseIndex:
    return await stores.index(base_id, dimension)


async def _replace_vectors(
    ctx: TaskContext,
    index: BaseIndex,
    embedder: Any,
    file_id: str,
    name: str,
    chunk_ids: list[str],
    texts: list[str],
    *,
    fresh: bool,
) -> None:
    """Embed and write the file's vectors, a batch at a time. ``fresh``: no chunk id of the file can
    have a vector yet, so a plain insert; otherwise upserts by chunk id, so whatever an earlier
    attempt left is overwritten, never duplicated (what lay past the last chunk was removed before
    the chunk rows were replaced)."""
    for start in range(0, len(texts), EMBED_BATCH):
        ctx.raise_if_cancelled()
        batch = texts[start : start + EMBED_BATCH]
        vectors = await embed_texts(embedder, batch)
        ids = chunk_ids[start : start + EMBED_BATCH]
        # milvus-lite's upsert first reads each id's old row in every segment, under the lock its
        # compaction holds: at 80 k vectors it managed half an insert's files/s, with 20 s stalls.
        if fresh:
            await index.insert([(file_id, ids, vectors)])
        else:
            await index.upsert(file_id, ids, vectors)
        done = min(start + EMBED_BATCH, len(texts))
        if done < len(texts):  # the last batch's news is the move to indexed, right after
            await ctx.report(100.0 * done / len(texts), f"{name}: {done} of {len(texts)} chunks indexed")
