"""knowledge.ingest / knowledge.reindex: parse, chunk, embed and index files as their owning attempt.

A task indexes one file or several (an upload groups small files into tasks, a base reindex hands
one task all its files). Each file moves ``uploaded -> parsing -> indexing -> indexed`` (or
``error_parsing`` / ``error_indexing``); the moves of the task's files are made together, a few
short owning transactions per round of files (start; chunk rows and the move to indexing; the move
to indexed), and every statement names this task and attempt, so an attempt that lost its lease,
or a file taken over by a newer task or deleted, writes nothing for it. One file that cannot be
parsed ends ``error_parsing`` and the others go on; a store that does not answer sends the whole
task back to pending, and its next attempt skips the files already indexed. Blocking work (S3,
embedding, Milvus) runs in threads between those transactions; parsing runs in a child process
with memory, time, text and chunk limits (``parse_process``), killed on cancel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from domains.knowledge import catalog
from domains.knowledge.embedding import embed_texts, mismatch
from domains.knowledge.errors import (
    CollectionMissing,
    EmbeddingRejected,
    ObjectMissing,
    StoreError,
    StoreUnavailable,
)
from domains.knowledge.model import ERROR_INDEXING, ERROR_PARSING, INDEXED, INDEXING, PARSING
from domains.knowledge.parse_process import ParseLimits, parse_file
from domains.knowledge.parsing import ParseError
from domains.knowledge.settings import get_knowledge_settings
from domains.knowledge.storage import object_key
from domains.knowledge.stores import KnowledgeStores, stores_for
from domains.knowledge.tasks import INGEST
from domains.knowledge.vectors import BaseIndex
from tasks_core.retry import RetryableError
from tasks_core.settings import current_settings
from tasks_core.worker.context import TaskContext

log = logging.getLogger(__name__)
# Chunks embedded per step: cancel checks and bounded thread calls.
EMBED_BATCH = 32
# Chunks whose vectors are written to Milvus per call (from one file or several): each embedding
# step's vectors are written before the next step, so a large file's vectors land as it goes.
WRITE_BATCH = EMBED_BATCH
# A round of files is written once its parsed files hold this many chunks (or no file is left):
# what one attempt holds in memory at once, beyond the one file being parsed; and how many files
# become indexed together (at 512, 25 small files per task all waited for the task's last one).
ROUND_CHUNKS = 128
# A task's failure names at most this many of its files that ended in an error state.
MAX_FAILED_NAMED = 10
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


def _stores() -> KnowledgeStores:
    # Read when a task runs, not at import: a worker's settings come from its environment (and .env).
    return stores_for(current_settings())


def _text(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"payload.{key} must be a non-empty string")
    return value


async def ingest(ctx: TaskContext) -> Any:
    """``{"file_id"}``: one file (it failing fails the task), as every upload made them before
    uploads grouped files; ``{"file_ids"}``: several, each with its own outcome."""
    file_id = _text(ctx.payload, "file_id")
    file_ids = ctx.payload.get("file_ids")
    if file_id is not None:
        return await _one(ctx, _stores(), file_id)
    if not isinstance(file_ids, list) or not file_ids or not all(isinstance(f, str) and f for f in file_ids):
        raise ValueError("payload needs file_id, or file_ids: a list of file ids")
    return await _several(ctx, _stores(), file_ids)


async def reindex(ctx: TaskContext) -> Any:
    file_id, base_id = _text(ctx.payload, "file_id"), _text(ctx.payload, "base_id")
    stores = _stores()
    if file_id is not None:
        return await _one(ctx, stores, file_id)
    if base_id is None:
        raise ValueError("payload needs file_id or base_id")
    async with ctx.owning_transaction() as conn:
        file_ids = await catalog.owned_in_progress(conn, ctx.task_id)
    await index_files(ctx, stores, file_ids)
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


async def _several(ctx: TaskContext, stores: KnowledgeStores, file_ids: list[str]) -> Any:
    """The task's files; it fails (naming them) if any ended in an error state, as a one-file task
    does, after every other file was indexed."""
    outcomes = {o.file_id: o for o in await index_files(ctx, stores, file_ids)}
    if len(outcomes) < len(set(file_ids)):
        # An earlier attempt finished some (or they were deleted): their states say how.
        async with ctx.owning_transaction() as conn:
            counts, errors = await catalog.task_outcome(conn, ctx.task_id, MAX_FAILED_NAMED)
        indexed = counts.get(INDEXED, 0)
        failed = counts.get(ERROR_PARSING, 0) + counts.get(ERROR_INDEXING, 0)
    else:
        errors = {o.file_id: o.error or "" for o in outcomes.values() if o.error}
        indexed = sum(o.status == INDEXED for o in outcomes.values())
        failed = len(errors)
    if failed:
        named = "; ".join(f"{f}: {m}" for f, m in list(errors.items())[:MAX_FAILED_NAMED])
        raise FileFailed(f"{failed} of {len(file_ids)} files ended in an error state: {named}")
    chunks = sum(o.chunks for o in outcomes.values())
    return {"files": len(file_ids), "indexed": indexed, "chunks": chunks}


async def index_file(ctx: TaskContext, stores: KnowledgeStores, file_id: str) -> Outcome:
    """One file, start to end, as this attempt. Raises FileGone if the file is not ours (any more),
    RetryableError when a store does not answer (the task waits and tries again)."""
    outcomes = await index_files(ctx, stores, [file_id])
    if not outcomes:
        raise FileGone(f"file {file_id} was deleted or is owned by another task")
    return outcomes[0]


@dataclass
class _Parsed:
    row: dict[str, Any]
    texts: list[str]
    file_id: str = field(init=False)
    chunk_ids: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.file_id = self.row["file_id"]
        self.chunk_ids = [f"{self.file_id}-{seq}" for seq in range(len(self.texts))]


async def index_files(ctx: TaskContext, stores: KnowledgeStores, file_ids: Sequence[str]) -> list[Outcome]:
    """These files, start to end, as this attempt: the outcome of each it owned and finished (a file
    not ours, or deleted or taken over meanwhile, has none). Raises RetryableError when a store does
    not answer (the task waits and tries again; the files this attempt indexed stay indexed)."""
    async with ctx.owning_transaction() as conn:
        rows = await catalog.start_many(conn, file_ids, ctx.task_id, ctx.attempt_token)
    return await _Indexer(ctx, stores).run(rows)


class _Indexer:
    """One attempt's pass over the files it started: parsed one at a time, written a round at a time."""

    def __init__(self, ctx: TaskContext, stores: KnowledgeStores) -> None:
        self.ctx, self.stores = ctx, stores
        self.limits = ParseLimits.from_settings(get_knowledge_settings())
        self.outcomes: list[Outcome] = []
        # Started and not finished by this attempt: what a store failure notes its reason on.
        self.open: dict[str, str] = {}

    async def run(self, rows: list[dict[str, Any]]) -> list[Outcome]:
        self.open = {r["file_id"]: r["filename"] for r in rows}
        parsed: list[_Parsed] = []
        failed: dict[str, tuple[str, str]] = {}
        try:
            for n, row in enumerate(rows, 1):
                self.ctx.raise_if_cancelled()
                verdict = await self._parse(row)
                if isinstance(verdict, _Parsed):
                    parsed.append(verdict)
                else:
                    failed[row["file_id"]] = verdict
                if n == len(rows) or sum(len(p.texts) for p in parsed) >= ROUND_CHUNKS:
                    await self._write_round(parsed, failed)
                    parsed, failed = [], {}
                    if n < len(rows):
                        await self.ctx.report(100.0 * n / len(rows), f"{n} of {len(rows)} files")
        except _AllGone:
            pass  # every file left was deleted or taken over: nothing more to do
        return self.outcomes

    @contextlib.asynccontextmanager
    async def _store_step(self) -> AsyncIterator[None]:
        """A store that fails here is waited out (the task goes back to pending with backoff), its
        reason noted on the files this attempt still holds, unless they all went away meanwhile:
        deleting a base drops its collection under a running ingest."""
        try:
            yield
        except (StoreUnavailable, CollectionMissing) as exc:
            ctx = self.ctx
            async with ctx.owning_transaction() as conn:
                ours = await catalog.note_many(
                    conn, list(self.open), ctx.task_id, ctx.attempt_token, f"attempt {ctx.attempt}: {exc}"
                )
            if not ours:
                raise _AllGone from exc
            # A server's Retry-After (an embedding endpoint's) is the backoff, if it gave one.
            delay = getattr(exc, "delay", None)
            raise RetryableError(str(exc), code="store_unavailable", delay=delay) from exc

    async def _parse(self, row: dict[str, Any]) -> _Parsed | tuple[str, str]:
        """The file's chunk texts, or the error state and message it ends with."""
        base_id, file_id = row["kb_id"], row["file_id"]
        async with self._store_step():
            objects = await self.stores.objects()
            try:
                data = await objects.get(object_key(base_id, file_id))
            except ObjectMissing:
                return ERROR_PARSING, "the uploaded original is missing from the object store"
        self.ctx.raise_if_cancelled()
        try:
            texts = await parse_file(data, row["file_type"], self.limits)
        except ParseError as exc:
            return ERROR_PARSING, str(exc)
        async with self._store_step():  # a network embedder may ask its server for the dimension
            refused = mismatch(self.stores.embedder, row["embedder"], row["dimension"], who="this worker")
        if refused:
            return ERROR_INDEXING, refused
        return _Parsed(row, texts)

    async def _write_round(self, parsed: list[_Parsed], failed: dict[str, tuple[str, str]]) -> None:
        """The round's files that failed take their error states, the parsed ones their chunk rows and
        the move to indexing (one transaction); then their vectors; then the move to indexed (one)."""
        ctx, task, token = self.ctx, self.ctx.task_id, self.ctx.attempt_token
        # Chunk ids are <file>-<seq>, so the vector writes below overwrite every vector an earlier
        # attempt or an earlier version of the file wrote, except those past this version's last
        # chunk: they are removed first, by id, before the chunk rows that count them are replaced
        # (so a crash between the two leaves a count that still covers every vector there may be).
        for p in parsed:
            stale = [f"{p.file_id}-{seq}" for seq in range(len(p.texts), p.row["chunk_rows"])]
            if stale:
                async with self._store_step():
                    await (await self._index(p.row)).delete_chunks(stale)
        started = {p.file_id for p in parsed}
        async with ctx.owning_transaction() as conn:
            ended = await catalog.fail_many(conn, failed, task, token)
            moved = await catalog.advance_many(
                conn, [p.file_id for p in parsed], task, token, PARSING, INDEXING
            )
            parsed = [p for p in parsed if p.file_id in moved]
            await catalog.replace_chunks_many(
                conn, token, [(p.file_id, p.chunk_ids, p.texts) for p in parsed]
            )
        self._ended(failed, ended)
        for file_id in started - moved:
            self.open.pop(file_id, None)  # deleted or taken over since it started
        if not parsed:
            return
        ctx.raise_if_cancelled()
        try:
            parsed = await self._write_vectors(parsed)
        except EmbeddingRejected as exc:
            # For good (a bad key or model, a text the model refuses): the round's files end
            # error_indexing with the endpoint's own words; the task's other rounds go on.
            rejected = {p.file_id: (ERROR_INDEXING, str(exc)) for p in parsed}
            async with ctx.owning_transaction() as conn:
                self._ended(rejected, await catalog.fail_many(conn, rejected, task, token))
            return
        async with ctx.owning_transaction() as conn:
            indexed = await catalog.advance_many(
                conn,
                [p.file_id for p in parsed],
                task,
                token,
                INDEXING,
                INDEXED,
                [len(p.texts) for p in parsed],
            )
        for p in parsed:
            self.open.pop(p.file_id, None)
            if p.file_id in indexed:
                self.outcomes.append(Outcome(p.file_id, INDEXED, chunks=len(p.texts)))
            else:
                # Deleted while we indexed: take our vectors back out rather than leave orphans (with
                # the whole base deleted, its collection is gone already).
                with contextlib.suppress(StoreError):
                    await (await self._index(p.row)).delete_file(p.file_id)

    def _ended(self, failures: dict[str, tuple[str, str]], ended: set[str]) -> None:
        """The files of ``failures`` are done with; those this attempt ended (``ended``) have an outcome."""
        for file_id, (state, message) in failures.items():
            self.open.pop(file_id, None)
            if file_id in ended:
                self.outcomes.append(Outcome(file_id, state, error=message))

    async def _index(self, row: dict[str, Any]) -> BaseIndex:
        return await self.stores.index(row["kb_id"], row["dimension"])

    async def _write_vectors(self, parsed: list[_Parsed]) -> list[_Parsed]:
        """Only an upload's first attempt, on a file that never had chunk rows, knows that none of
        its chunk ids has a vector (an earlier attempt writes chunk rows before any vector): it
        inserts. Every other attempt upserts, so whatever an earlier one left is overwritten, never
        doubled. The files still ours afterwards."""
        ctx = self.ctx
        async with self._store_step():
            try:
                await self._embed_and_write(parsed, fresh=ctx.task_type == INGEST and ctx.attempt == 1)
            except CollectionMissing:
                # Dropped since this process cached the handle (by hand, or a restarted Milvus
                # released it): built again once, unless the base itself is gone (then its files
                # are too). Some of this attempt's vectors may be there (a released collection keeps
                # them): upserted.
                for base_id in {p.row["kb_id"] for p in parsed}:
                    self.stores.indexes.forget(base_id)
                ids = [p.file_id for p in parsed]
                async with ctx.owning_transaction() as conn:
                    ours = await catalog.advance_many(
                        conn, ids, ctx.task_id, ctx.attempt_token, INDEXING, INDEXING
                    )
                if not ours:
                    raise _AllGone from None
                parsed = [p for p in parsed if p.file_id in ours]
                await self._embed_and_write(parsed, fresh=False)
        return parsed

    async def _embed_and_write(self, parsed: list[_Parsed], *, fresh: bool) -> None:
        """Embed and write the files' vectors, a batch at a time: plain inserts, chunks of several
        files per call, for the files none of whose chunk ids can have a vector yet (``fresh`` and
        no chunk rows before); upserts by chunk id, a file at a time, for the others."""
        embedder = self.stores.embedder
        total = sum(len(p.texts) for p in parsed)
        written = reported = 0

        async def wrote(count: int) -> None:
            nonlocal written, reported
            written += count
            if written - reported >= WRITE_BATCH and written < total:
                # The last batch's news is the move to indexed, right after.
                reported = written
                await self.ctx.report(100.0 * written / total, f"{written} of {total} chunks indexed")

        for base_id in dict.fromkeys(p.row["kb_id"] for p in parsed):
            files = [p for p in parsed if p.row["kb_id"] == base_id]
            index = await self._index(files[0].row)
            inserted = [p for p in files if fresh and p.row["chunk_rows"] == 0]
            chunks = [(p, seq) for p in inserted for seq in range(len(p.texts))]
            pending: list[tuple[str, Sequence[str], Sequence[Sequence[float]]]] = []
            for start in range(0, len(chunks), EMBED_BATCH):
                self.ctx.raise_if_cancelled()
                part = chunks[start : start + EMBED_BATCH]
                vectors = await embed_texts(embedder, [p.texts[seq] for p, seq in part])
                pending += [
                    (p.file_id, [p.chunk_ids[seq]], [v]) for (p, seq), v in zip(part, vectors, strict=True)
                ]
                if len(pending) >= WRITE_BATCH or start + EMBED_BATCH >= len(chunks):
                    await index.insert(pending)
                    await wrote(len(pending))
                    pending = []
            # milvus-lite's upsert first reads each id's old row in every segment, under the lock its
            # compaction holds: at 80 k vectors it managed half an insert's files/s.
            for p in files:
                if p.file_id in {q.file_id for q in inserted}:
                    continue
                for start in range(0, len(p.texts), EMBED_BATCH):
                    self.ctx.raise_if_cancelled()
                    vectors = await embed_texts(embedder, p.texts[start : start + EMBED_BATCH])
                    await index.upsert(p.file_id, p.chunk_ids[start : start + EMBED_BATCH], vectors)
                    await wrote(len(vectors))


class _AllGone(Exception):
    """Every file this attempt held was deleted or taken over: nothing more to do."""
