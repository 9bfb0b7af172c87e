"""/knowledge: bases, file uploads (each a durable ingest task), reindexing and search.

A key sees only its own bases (an admin key sees all); anything else answers 404. Uploads put
the originals in the bucket first (hashing them as they stream), then commit every file row with
its task in one transaction, then publish the ids once; content the base already has (the unique
index on its hash decides) is answered with the file that has it, and its streamed copy removed.
When Milvus or the object store is not configured or not reachable the routes answer 503 naming
it; the rest of the API is unaffected.
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, BinaryIO

from fastapi import (
    APIRouter,
    Depends,
    File,
    HTTPException,
    Path,
    Query,
    Request,
    Response,
    UploadFile,
)
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app.auth import BodyRoute, Principal
from app.dependencies import Caller, Svc
from domains.knowledge import catalog, reindexing
from domains.knowledge.attempts import attempt_of
from domains.knowledge.embedding import embed_texts, mismatch
from domains.knowledge.errors import CollectionMissing, StoreError
from domains.knowledge.grouping import GroupingSettings, group
from domains.knowledge.model import FILE_TYPES, OTHER
from domains.knowledge.parsing import CONTENT_TYPES, file_type_of
from domains.knowledge.schemas import (
    ID,
    BaseIn,
    BaseList,
    BaseOut,
    FileOut,
    FilePage,
    FileRef,
    FileStatus,
    KnowledgeConflict,
    KnowledgeError,
    ReindexOut,
    SearchIn,
    SearchOut,
    UploadOut,
)
from domains.knowledge.storage import object_key
from domains.knowledge.stores import KnowledgeStores, milvus_fact, object_store_fact, stores_for
from domains.knowledge.tasks import INGEST
from tasks_core.registry import Registry
from tasks_core.services import Services
from tasks_core.settings import Settings
from tasks_core.submission import InvalidTask, Submitter, TaskIntent

PREFIX = "/knowledge"
# Multipart framing around the files: headers, boundaries, field names.
MULTIPART_OVERHEAD = 64 * 1024
# Bidirectional controls (embeddings, overrides, isolates, marks) reorder how a name is shown:
# "invoice\u202etxt.exe" reads "invoiceexe.txt". They are dropped from uploaded names.
BIDI_CONTROLS = dict.fromkeys([*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C])
# Originals put to the bucket at once per upload request.
PUT_CONCURRENCY = 8
# A search asks Milvus for 4 * top_k + this many vectors (at most MAX_SEARCH_FETCH): some are
# dropped (files being reindexed or deleted, texts already shown), and top_k should still be filled.
SEARCH_SLACK = 10
MAX_SEARCH_FETCH = 410
RETRY_AFTER = {"Retry-After": "5"}
# The types a file may have (by its name's extension); a file of none is kept as "other".
SUPPORTED = tuple(t for t in FILE_TYPES if t != OTHER)
# How often a file whose content another upload already has is looked for again, should that
# other file be deleted between our insert and our look (then ours is new after all).
CONTENT_RACE_TRIES = 3


def _err(description: str, model: type = KnowledgeError) -> dict[str, Any]:
    return {"model": model, "description": description}


Responses = dict[int | str, dict[str, Any]]
AUTH: Responses = {401: _err("Missing or invalid API key")}
UNAVAILABLE: Responses = {503: _err("Milvus or the object store is not configured or not reachable (named)")}
NOT_FOUND: Responses = {404: _err("No such base or file (or not yours)")}
COMMON: Responses = {**AUTH, **NOT_FOUND, **UNAVAILABLE}
QUOTA: Responses = {429: _err("You already have DTASK_OWNER_MAX_PENDING pending tasks")}


async def _stores(svc: Svc) -> KnowledgeStores:
    """Every knowledge route needs both stores configured (a worker will, to index anything)."""
    try:
        stores = stores_for(svc.settings)
    except ValueError as exc:  # DTASK_EMBEDDER names nothing usable
        raise HTTPException(503, f"DTASK_EMBEDDER: {exc}", headers=RETRY_AFTER) from None
    stores.require()
    return stores


router = APIRouter(prefix=PREFIX, tags=["knowledge"], dependencies=[Depends(_stores)])
Stores = Annotated[KnowledgeStores, Depends(_stores)]
BaseId = Annotated[str, Path(pattern=ID, description="A base id (32 hex digits)")]
FileId = Annotated[str, Path(pattern=ID, description="A file id (32 hex digits)")]


def _visible(row: dict[str, Any] | None, caller: Principal, what: str) -> dict[str, Any]:
    if row is None or (not caller.admin and row["owner"] != caller.name):
        raise HTTPException(404, f"no such {what}")  # another owner's object does not exist for you
    return row


async def _base(svc: Services, base_id: str, caller: Principal) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        return _visible(await catalog.get_base(conn, base_id), caller, "base")


def _invalid(field: str, message: str, where: str = "body") -> HTTPException:
    # FastAPI's own validation-error shape, so clients handle one format.
    return HTTPException(422, [{"loc": [where, field], "msg": message, "type": "value_error"}])


def _refused(exc: InvalidTask) -> HTTPException:
    """A refused submission: 429 over the owner's pending quota, else 422 (nothing was stored)."""
    if exc.status == 422:
        return _invalid(exc.field, exc.message)
    return HTTPException(exc.status, exc.message)


def _base_view(row: dict[str, Any], counts: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "embedder": row["embedder"],
        "dimension": row["dimension"],
        "created_at": row["created_at"],
        "file_counts": counts if counts is not None else row.get("file_counts") or {},
    }


def _file_view(row: dict[str, Any], registry: Registry) -> dict[str, Any]:
    attempt = attempt_of(row, registry)
    return {
        "id": row["file_id"],
        "base_id": row["kb_id"],
        "filename": row["filename"],
        "file_type": row["file_type"],
        "size_bytes": row["size_bytes"],
        "status": row["status"],
        "error_message": row["error_message"],
        "chunk_count": row["chunk_count"],
        "task_id": row["task_id"],
        "attempt": attempt[0] if attempt else None,
        "max_attempts": attempt[1] if attempt else None,
        "content_hash": row["content_hash"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }


def _ref(file_id: str, task_id: uuid.UUID | None, status: str, filename: str) -> dict[str, Any]:
    return {"id": file_id, "task_id": task_id, "status": status, "filename": filename}


def _conflict(detail: str, task_id: uuid.UUID | None) -> JSONResponse:
    return JSONResponse(
        status_code=409, content={"detail": detail, "task_id": str(task_id) if task_id else None}
    )


# ------------------------------------------------------------------------------------------------ bases


@router.post(
    "/bases",
    status_code=201,
    response_model=BaseOut,
    responses={**AUTH, **UNAVAILABLE, 409: _err("You already have a base of that name")},
)
async def create_base(body: BaseIn, caller: Caller, svc: Svc, stores: Stores) -> Any:
    """A base and its Milvus collection (one per base)."""
    embedder = stores.embedder
    async with svc.engine.begin() as conn:
        row = await catalog.insert_base(conn, caller.name, body.name, embedder.name, embedder.dimension)
    if not row:
        raise HTTPException(409, f"you already have a base named {body.name!r}")
    # The collection after the row's commit, never inside its transaction: a stalled Milvus must not
    # hold a pooled connection (and a row lock) for its deadline. If Milvus does not answer, the
    # base is taken back (503); a collection it still makes later belongs to no base, and the
    # verifier drops it. A base whose take-back fails too is whole anyway: ingest makes its
    # collection on first use.
    try:
        await stores.index(row["id"], embedder.dimension)
    except StoreError:
        async with svc.engine.begin() as conn:
            await catalog.delete_base(conn, row["id"])
        raise
    return _base_view(row, {})


@router.get("/bases", response_model=BaseList, responses={**AUTH, **UNAVAILABLE})
async def list_bases(caller: Caller, svc: Svc) -> Any:
    """Your bases (every base with an admin key), with their files counted by status."""
    async with svc.engine.connect() as conn:
        rows = await catalog.list_bases(conn, caller.owner_filter())
    return {"items": [_base_view(r) for r in rows]}


@router.get("/bases/{base_id}", response_model=BaseOut, responses=COMMON)
async def get_base(base_id: BaseId, caller: Caller, svc: Svc) -> Any:
    """One base, with its files counted by status."""
    row = await _base(svc, base_id, caller)
    async with svc.engine.connect() as conn:
        return _base_view(row, await catalog.file_counts(conn, base_id))


async def _cancel(svc: Services, task_ids: list[uuid.UUID]) -> None:
    # Pending tasks end at once (their hook marks the files); running ones stop at their next
    # control point and find their file gone.
    for task_id in task_ids:
        await svc.repo.request_cancel(task_id, svc.registry)


@router.delete("/bases/{base_id}", status_code=204, response_class=Response, responses=COMMON)
async def delete_base(base_id: BaseId, caller: Caller, svc: Svc, stores: Stores) -> Response:
    """The base, its files and chunks, its collection and its objects. What is already gone is fine."""
    await _base(svc, base_id, caller)
    async with svc.engine.connect() as conn:
        await _cancel(svc, await catalog.active_tasks_of_base(conn, base_id))
    # Outside stores first: if one is down the base stays (503) and a retry finishes the job.
    await stores.drop(base_id)
    await (await stores.objects()).delete_prefix(f"{base_id}/")
    async with svc.engine.begin() as conn:
        await catalog.delete_base(conn, base_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------------------------------ files


async def _multipart(request: Request) -> None:
    """Before the body is looked at: an upload that is not multipart is refused as a whole."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise HTTPException(415, "send the files as multipart/form-data, in the field `files`")


@router.post(
    "/bases/{base_id}/files",
    status_code=202,
    response_model=UploadOut,
    dependencies=[Depends(_multipart)],
    responses={
        **COMMON,
        413: _err("The whole request is over DTASK_MAX_UPLOAD_REQUEST_BYTES"),
        415: _err("The request is not multipart/form-data"),
        **QUOTA,
    },
)
async def upload_files(
    base_id: BaseId,
    caller: Caller,
    svc: Svc,
    stores: Stores,
    files: Annotated[
        list[UploadFile],
        File(description="One or many documents (" + ", ".join(f".{t}" for t in SUPPORTED) + ")"),
    ],
) -> Any:
    """Keep every file: each new content gets its `knowledge.ingest` task (all in one transaction,
    one publish); content the base already has answers with that file (`duplicate_of`); a file of
    no supported type, an empty one or one over the per-file limit ends `error_parsing` at once,
    saying why. Only the request itself is refused: not multipart, no or too many files, a nameless
    one, over quota."""
    base = await _base(svc, base_id, caller)
    limits: Settings = svc.settings
    if len(files) > limits.max_upload_files:
        raise _invalid("files", f"at most {limits.max_upload_files} files per request, got {len(files)}")
    if not files:
        raise _invalid("files", "no files")
    entries: list[_Entry] = []
    for upload in files:
        name = (upload.filename or "").translate(BIDI_CONTROLS).replace("\\", "/").rsplit("/", 1)[-1]
        if not name or len(name) > 255 or "\x00" in name:
            raise _invalid("files", "every file needs a name of 1-255 characters")
        size = upload.size or 0  # the multipart parser counts every byte it spools
        file_type = file_type_of(name)
        entry = _Entry(catalog.new_id(), name, file_type or OTHER, size, upload.file)
        entry.refused = _refusal(name, file_type, size, limits.max_upload_bytes)
        entries.append(entry)
    kept = [e for e in entries if e.refused is None]
    objects = await stores.objects()
    keys = [object_key(base_id, e.file_id) for e in kept]
    gate = asyncio.Semaphore(PUT_CONCURRENCY)

    async def put(entry: _Entry) -> None:
        async with gate:  # from the spool file, in parts, hashed as it goes: never a whole file in memory
            content_type = CONTENT_TYPES.get(entry.file_type, "application/octet-stream")
            entry.content_hash = await objects.put(
                object_key(base_id, entry.file_id), entry.stream, entry.size, content_type
            )

    try:
        # Originals first: a task must never run before its object exists.
        await asyncio.gather(*(put(e) for e in kept))
        async with Submitter(svc).transaction(owner=base["owner"]) as tx:
            await _record(tx, base_id, entries)
    except BaseException as exc:
        await _forget_objects(objects, keys)
        if isinstance(exc, InvalidTask):
            raise _refused(exc) from None
        raise
    # The originals of duplicates are not kept: the file they duplicate has its own.
    await _forget_objects(objects, [object_key(base_id, e.file_id) for e in kept if e.duplicate_of])
    # Capacity decides how many are sent now; the rest wait for the relay. False only when the
    # broker could not be reached (the publisher sends them later).
    published = all(r.publish_error is None for r in tx.results)
    return {"files": [e.ref() for e in entries], "published": published}


@dataclass(eq=False)
class _Entry:
    """One uploaded file on its way to a row, or to the row it duplicates."""

    file_id: str  # its own id: of its row, or only of the object it was put as (a duplicate)
    filename: str
    file_type: str
    size: int
    stream: BinaryIO
    refused: str | None = None  # why it ends error_parsing at once (no original is kept)
    content_hash: str | None = None
    # A duplicate is answered with the file it duplicates: that file's id, task and status.
    duplicate_of: str | None = None
    task_id: uuid.UUID | None = None
    status: str = "uploaded"

    def ref(self) -> dict[str, Any]:
        out = _ref(self.duplicate_of or self.file_id, self.task_id, self.status, self.filename)
        if self.refused is not None:
            out["error_message"] = self.refused
        if self.duplicate_of is not None:
            out["duplicate_of"] = self.duplicate_of
        return out


def _refusal(name: str, file_type: str | None, size: int, max_bytes: int) -> str | None:
    if file_type is None:
        dot = name.rfind(".")
        kind = f"{name[dot:].lower()} files are" if dot > 0 else "a file with no extension is"
        supported = ", ".join(f".{t}" for t in SUPPORTED)
        return f"not a supported file type: {kind} not read (use {supported})"
    if size == 0:
        return "the file is empty"
    if size > max_bytes:
        return f"the file is over the {max_bytes:,}-byte limit per file (DTASK_MAX_UPLOAD_BYTES)"
    return None


def _row(base_id: str, e: _Entry, **values: Any) -> dict[str, Any]:
    return {
        "file_id": e.file_id,
        "kb_id": base_id,
        "filename": e.filename,
        "file_type": e.file_type,
        "size_bytes": e.size,
        **values,
    }


async def _record(tx: Any, base_id: str, entries: list[_Entry]) -> None:
    """The rows of one upload, in its submission transaction: refused files as ``error_parsing``,
    each new content with its ingest task, and duplicates answered with the file they duplicate."""
    conn = tx.conn
    refused = [e for e in entries if e.refused is not None]
    for e in refused:
        e.status = "error_parsing"
    await catalog.insert_files(
        conn,
        [
            _row(base_id, e, status=e.status, error_message=e.refused, task_id=None, refused_at_upload=True)
            for e in refused
        ],
    )
    # The same bytes twice in one request: the first is the file, the others its duplicates.
    first: dict[str, _Entry] = {}
    for e in entries:
        if e.content_hash is not None:
            first.setdefault(e.content_hash, e)
    waiting = list(first.values())
    new: set[str] = set()
    for _ in range(CONTENT_RACE_TRIES):
        inserted = await catalog.insert_new_contents(
            conn, [_row(base_id, e, content_hash=e.content_hash) for e in waiting]
        )
        new |= inserted
        waiting = [e for e in waiting if e.file_id not in inserted]
        if not waiting:
            break
        held = await catalog.files_by_hash(conn, base_id, [str(e.content_hash) for e in waiting])
        for e in waiting:
            if (row := held.get(str(e.content_hash))) is not None:
                e.duplicate_of, e.task_id, e.status = row["file_id"], row["task_id"], row["status"]
        # A file gone between our insert and our look was deleted meanwhile: ours is new after all.
        waiting = [e for e in waiting if e.duplicate_of is None]
        if not waiting:
            break
    else:
        raise HTTPException(503, "the base changed under this upload; try again", headers=RETRY_AFTER)
    tasks: dict[str, uuid.UUID] = {}
    fresh = [e for e in entries if e.file_id in new]  # in the order the files came
    groups = [[fresh[i] for i in positions] for positions in _groups(tx, [e.size for e in fresh])]
    intents = [
        TaskIntent(INGEST, {"file_id": g[0].file_id} if len(g) == 1 else {"file_ids": [e.file_id for e in g]})
        for g in groups
    ]
    for members, added in zip(groups, await tx.add_many(intents), strict=True):
        if isinstance(added, InvalidTask):
            raise added
        for e in members:
            e.task_id = tasks[e.file_id] = added.task_id
    await catalog.hand_to_tasks(conn, tasks)
    for e in entries:
        twin = first.get(e.content_hash) if e.content_hash is not None else None
        if twin is not None and twin is not e:
            e.duplicate_of = twin.duplicate_of or twin.file_id
            e.task_id, e.status = twin.task_id, twin.status


def _groups(tx: Any, sizes: list[int]) -> list[list[int]]:
    """The new files' ingest tasks (see ``grouping``), spread over what the owner may run at once."""
    settings: Settings = tx.submitter.services.settings
    chosen = GroupingSettings()
    slots = settings.owner_running_limit or settings.capacity
    return group(sizes, slots, chosen.knowledge_files_per_task, chosen.knowledge_bytes_per_task)


async def _forget_objects(objects: Any, keys: list[str]) -> None:
    """Best effort: nothing references these objects (the transaction did not commit)."""
    for key in keys:
        try:
            await objects.delete(key)
        except Exception:  # the store may be the very thing that failed
            break


@router.get("/bases/{base_id}/files", response_model=FilePage, responses=COMMON)
async def list_files(
    base_id: BaseId,
    caller: Caller,
    svc: Svc,
    status: Annotated[FileStatus | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=500, pattern=r"^[A-Za-z0-9_-]*$")] = None,
) -> Any:
    """Newest first, keyset-paged: pass `next_cursor` back as `cursor`."""
    await _base(svc, base_id, caller)
    async with svc.engine.connect() as conn:
        try:
            rows, nxt = await catalog.list_files(conn, base_id, status=status, limit=limit, cursor=cursor)
        except ValueError as exc:
            raise _invalid("cursor", str(exc), "query") from None
    return {"items": [_file_view(r, svc.registry) for r in rows], "next_cursor": nxt}


@router.get("/files/{file_id}", response_model=FileOut, responses=COMMON)
async def get_file(file_id: FileId, caller: Caller, svc: Svc) -> Any:
    """One file: its status, error_message, chunk_count and the task that owns it."""
    async with svc.engine.connect() as conn:
        row = _visible(await catalog.get_file(conn, file_id), caller, "file")
    return _file_view(row, svc.registry)


@router.delete("/files/{file_id}", status_code=204, response_class=Response, responses=COMMON)
async def delete_file(file_id: FileId, caller: Caller, svc: Svc, stores: Stores) -> Response:
    """The file, its chunks, its vectors and its original. What is already gone is fine."""
    async with svc.engine.connect() as conn:
        row = _visible(await catalog.get_file(conn, file_id), caller, "file")
    if row["task_active"]:
        async with svc.engine.connect() as conn:
            shared = await catalog.others_in_progress(conn, row["task_id"], file_id)
        # A task that holds other files goes on with them: it skips a file deleted under it.
        if not shared:
            await _cancel(svc, [row["task_id"]])
    index = await stores.index(row["kb_id"], row["dimension"])
    try:
        await index.delete_file(file_id)
    except CollectionMissing:
        stores.indexes.forget(row["kb_id"])  # no collection, no vectors
    await (await stores.objects()).delete(object_key(row["kb_id"], file_id))
    async with svc.engine.begin() as conn:
        await catalog.delete_file(conn, file_id)
    return Response(status_code=204)


@router.post(
    "/files/{file_id}/reindex",
    status_code=202,
    response_model=FileRef,
    responses={**COMMON, **QUOTA, 409: _err("The file's task is still active", KnowledgeConflict)},
)
async def reindex_file(file_id: FileId, caller: Caller, svc: Svc) -> Any:
    """Parse and index the file again under a new `knowledge.reindex` task."""
    async with svc.engine.connect() as conn:
        owner = _visible(await catalog.get_file(conn, file_id), caller, "file")["owner"]
    try:
        outcome = await reindexing.reindex_file(svc, file_id, owner)
    except InvalidTask as exc:
        raise _refused(exc) from None
    if outcome is None:
        raise HTTPException(404, "no such file")  # deleted meanwhile
    if outcome.task_id is None:
        return _conflict(outcome.conflict or "", outcome.active)
    return _ref(file_id, outcome.task_id, "uploaded", outcome.filename)


@router.post(
    "/bases/{base_id}/reindex-pending",
    status_code=202,
    response_model=ReindexOut,
    responses={
        **COMMON,
        200: {"model": ReindexOut, "description": "No file needed it"},
        409: _err("A reindex of this base is already active", KnowledgeConflict),
        **QUOTA,
    },
)
async def reindex_pending(base_id: BaseId, caller: Caller, svc: Svc, response: Response) -> Any:
    """One task for every errored (or stranded uploaded) file of the base; one at a time per base."""
    base = await _base(svc, base_id, caller)
    try:
        outcome = await reindexing.reindex_base(svc, base_id, base["owner"])
    except InvalidTask as exc:
        raise _refused(exc) from None
    if outcome.active is not None:
        return _conflict("a reindex of this base is already active", outcome.active)
    if outcome.task_id is None:
        response.status_code = 200
        return {"task_id": None, "files": []}
    return {
        "task_id": outcome.task_id,
        "files": [_ref(r["file_id"], outcome.task_id, "uploaded", r["filename"]) for r in outcome.files],
    }


# ------------------------------------------------------------------------------------------------ search


@router.post("/bases/{base_id}/search", response_model=SearchOut, responses=COMMON)
async def search(base_id: BaseId, body: SearchIn, caller: Caller, svc: Svc, stores: Stores) -> Any:
    """The `top_k` chunks most similar to the query (at least `min_score`), among the base's indexed
    files, each text once."""
    base = await _base(svc, base_id, caller)
    embedder = stores.embedder
    refused = mismatch(embedder, base["embedder"], base["dimension"], who="this api")
    if refused:
        raise HTTPException(503, refused, headers=RETRY_AFTER)
    [vector] = await embed_texts(embedder, [body.query])
    # More than top_k: vectors of files being reindexed or deleted are filtered out below, and a
    # text several files hold is shown once.
    limit = min(4 * body.top_k + SEARCH_SLACK, MAX_SEARCH_FETCH)
    try:
        hits = await (await stores.index(base_id, base["dimension"])).search(vector, limit)
    except CollectionMissing:
        # Dropped or released since this process cached it (say Milvus restarted): rebuilt once,
        # which creates or loads it.
        stores.indexes.forget(base_id)
        hits = await (await stores.index(base_id, base["dimension"])).search(vector, limit)
    if body.min_score is not None:
        hits = [h for h in hits if h.score >= body.min_score]
    async with svc.engine.connect() as conn:
        texts = await catalog.indexed_chunks(conn, base_id, [h.chunk_id for h in hits])
    found: list[dict[str, Any]] = []
    shown: set[str] = set()
    for h in sorted(hits, key=lambda h: -h.score):  # best first, so the score kept is the best
        chunk = texts.get(h.chunk_id)
        if chunk is None or chunk["text"] in shown:
            continue
        shown.add(chunk["text"])
        found.append(
            {
                "chunk_id": h.chunk_id,
                "file_id": h.file_id,
                "filename": chunk["filename"],
                "text": chunk["text"],
                "score": h.score,
            }
        )
        if len(found) == body.top_k:
            break
    return {"hits": found}


# ------------------------------------------------------------------------------------------------ wiring


async def unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The api's answer to an unreachable (or unconfigured) store: 503, try again shortly."""
    detail = str(exc) if isinstance(exc, StoreError) else "knowledge stores unavailable"
    return JSONResponse(status_code=503, content={"detail": detail}, headers=RETRY_AFTER)


async def milvus_ready(svc: Services) -> tuple[bool, str | None]:
    result: tuple[bool, str | None] = await milvus_fact(stores_for(svc.settings))
    return result


async def object_store_ready(svc: Services) -> tuple[bool, str | None]:
    result: tuple[bool, str | None] = await object_store_fact(stores_for(svc.settings))
    return result


def api_router() -> APIRouter:
    """The /knowledge routes, for the api (declared in domains/knowledge/domain.py)."""
    # The clients' libraries take about a second to import (pymilvus brings pandas and numpy).
    # Loaded with the app, so no readiness check or first request pays for it within its deadline.
    importlib.import_module("pymilvus")
    importlib.import_module("minio")
    return router


def body_routes(settings: Settings) -> list[BodyRoute]:
    """Guard's rule for the upload route alone (every other route keeps DTASK_MAX_REQUEST_BYTES):
    the whole multipart request's limit, and how many uploads one process reads at once."""
    upload = next(r for r in router.routes if isinstance(r, APIRoute) and r.endpoint is upload_files)
    return [
        BodyRoute(
            "POST",
            upload.path_regex,
            settings.max_upload_request_bytes + MULTIPART_OVERHEAD,
            slots=settings.max_concurrent_uploads,
            wait_seconds=settings.upload_wait_seconds,
        )
    ]
