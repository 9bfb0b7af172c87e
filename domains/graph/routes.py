"""/graph: build a base's knowledge graph (a retry-safe durable task), browse its entities and
an entity's weighted neighbours.

A key sees only its own bases (an admin key sees all); another owner's base answers 404 as if it
did not exist. Only PostgreSQL is needed: the graph is built from the chunk texts stored there.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from app.auth import Principal
from app.dependencies import Caller, Svc
from domains.graph import store
from domains.graph.model import BUILT
from domains.graph.schemas import BuildRef, EntityPage, GraphError, GraphOut, NeighborsOut
from domains.graph.tasks import BUILD
from domains.knowledge import catalog
from tasks_core.services import Services
from tasks_core.submission import InvalidTask, Submitter, TaskIntent

PREFIX = "/graph"
ID = r"^[0-9a-f]{32}$"
MAX_CURSOR = 800
CURSOR = r"^[A-Za-z0-9_-]+$"
NO_NUL = r"^[^\x00]*$"


def _err(description: str) -> dict[str, Any]:
    return {"model": GraphError, "description": description}


COMMON: dict[int | str, dict[str, Any]] = {
    401: _err("Missing or invalid API key"),
    404: _err("No such base (or not yours), no graph built yet, or no such entity"),
}


router = APIRouter(prefix=PREFIX, tags=["graph"])
BaseId = Annotated[str, Path(pattern=ID, description="A knowledge base id (32 hex digits)")]


async def _base(svc: Services, base_id: str, caller: Principal) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        row = await catalog.get_base(conn, base_id)
    if row is None or (not caller.admin and row["owner"] != caller.name):
        raise HTTPException(404, "no such base")  # another owner's base does not exist for you
    return row


async def _graph(svc: Services, base_id: str) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        row = await store.latest_build(conn, base_id, BUILT)
    if row is None:
        raise HTTPException(404, f"the base has no graph yet: POST {PREFIX}/{base_id}/build")
    return row


def _invalid(field: str, message: str) -> HTTPException:
    # FastAPI's own validation-error shape, so clients handle one format.
    return HTTPException(422, [{"loc": ["query", field], "msg": message, "type": "value_error"}])


def _encode(mentions: int, name: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([mentions, name]).encode()).decode().rstrip("=")


def _decode(cursor: str) -> tuple[int, str]:
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise _invalid("cursor", "not a cursor this API gave out") from None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or type(value[0]) is not int
        or not 0 <= value[0] < 2**31  # a count column's range
        or not isinstance(value[1], str)
        or "\x00" in value[1]
        or not _encodable(value[1])
    ):
        raise _invalid("cursor", "not a cursor this API gave out")
    return value[0], value[1]


def _encodable(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # a lone surrogate: no entity can have it
        return False
    return True


def _build_view(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    keys = ("id", "base_id", "status", "task_id", "extractor", "chunks_done", "chunk_total")
    more = ("entity_count", "edge_count", "error_message", "created_at", "finished_at")
    return {k: row[k] for k in (*keys, *more)}


@router.post(
    "/{base_id}/build",
    status_code=202,
    response_model=BuildRef,
    responses={**COMMON, 429: _err("You already have DTASK_OWNER_MAX_PENDING pending tasks")},
)
async def build(base_id: BaseId, caller: Caller, svc: Svc) -> Any:
    """Build the base's graph anew from its indexed files' chunks, as one `graph.build` task.

    One build per base at a time: while one is pending or running, this answers with that build
    and task (`deduplicated: true`). The graph readers see changes only when a build succeeds."""
    base = await _base(svc, base_id, caller)
    try:
        async with Submitter(svc).transaction(owner=base["owner"]) as tx:
            submitted = await tx.add(TaskIntent(BUILD, {"base_id": base_id}, dedupe_key=f"base:{base_id}"))
            if submitted.duplicate_of is not None:
                row = await store.build_of_task(tx.conn, submitted.duplicate_of)
                if row is None:  # the base was deleted meanwhile, and its builds with it
                    raise HTTPException(404, "no such base")
                return {
                    "build_id": row["id"],
                    "task_id": submitted.duplicate_of,
                    "status": row["status"],
                    "deduplicated": True,
                }
            row = await store.create_build(tx.conn, base_id, submitted.task_id)
    except InvalidTask as exc:
        if exc.status == 422:
            raise HTTPException(422, [{"loc": ["body", exc.field], "msg": exc.message}]) from None
        raise HTTPException(exc.status, exc.message) from None
    return {
        "build_id": row["id"],
        "task_id": submitted.task_id,
        "status": row["status"],
        "deduplicated": False,
    }


@router.get("/{base_id}", response_model=GraphOut, responses=COMMON)
async def graph(base_id: BaseId, caller: Caller, svc: Svc) -> Any:
    """The graph readers see (the newest built build) and the newest build of any status."""
    await _base(svc, base_id, caller)
    async with svc.engine.connect() as conn:
        built = await store.latest_build(conn, base_id, BUILT)
        latest = await store.latest_build(conn, base_id)
    return {"base_id": base_id, "graph": _build_view(built), "latest": _build_view(latest)}


@router.get("/{base_id}/entities", response_model=EntityPage, responses=COMMON)
async def entities(
    base_id: BaseId,
    caller: Caller,
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(min_length=1, max_length=MAX_CURSOR, pattern=CURSOR)] = None,
) -> Any:
    """The graph's entities with their counts, most mentioned first; keyset-paged (`next_cursor`)."""
    await _base(svc, base_id, caller)
    after = None if cursor is None else _decode(cursor)
    built = await _graph(svc, base_id)
    async with svc.engine.connect() as conn:
        rows = await store.entities_page(conn, built["id"], limit + 1, after)
    page, more = rows[:limit], len(rows) > limit
    nxt = _encode(page[-1]["mentions"], page[-1]["name"]) if more else None
    return {"build_id": built["id"], "items": page, "next_cursor": nxt}


@router.get("/{base_id}/neighbors", response_model=NeighborsOut, responses=COMMON)
async def neighbors(
    base_id: BaseId,
    caller: Caller,
    svc: Svc,
    entity: Annotated[str, Query(min_length=1, max_length=500, pattern=NO_NUL, description="An entity")],
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> Any:
    """The entities that share chunks with `entity`, weighted by how many they share."""
    await _base(svc, base_id, caller)
    built = await _graph(svc, base_id)
    async with svc.engine.connect() as conn:
        found = await store.entity(conn, built["id"], entity)
        if found is None:
            raise HTTPException(404, f"no entity named {entity[:200]!r} in the base's graph")
        rows = await store.neighbors(conn, built["id"], entity, limit)
    return {"build_id": built["id"], "entity": found, "neighbors": rows}
