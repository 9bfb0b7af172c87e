"""The knowledge domain's dashboard pages (/ui/knowledge): bases, and each base's files with their
states, each linked to the task that owns it. Declared as the domain's ``ui`` in its ``domain.py``.

What they show comes from PostgreSQL through the domain's catalog, with the API's owner rules: a
key sees its own bases (an admin key all); another owner's base does not exist (404). Nothing here
needs Milvus or the object store, so the pages work while they are down; reindexing, like the API's,
needs them configured.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from app.ui import (
    DEFAULT_PAGE_SIZE,
    PAGE_SIZES,
    Checked,
    NavEntry,
    Signed,
    StatusPage,
    UiError,
    UiExtension,
    Viewer,
    redirect,
    render,
    services,
    status_page,
)
from domains.knowledge import catalog
from domains.knowledge.attempts import attempt_of
from domains.knowledge.domain import DOMAIN
from domains.knowledge.model import ERRORS, STATUSES
from domains.knowledge.reindexing import reindex_base
from domains.knowledge.stores import StoreConfig
from tasks_core.db import db_now
from tasks_core.services import Services
from tasks_core.submission import InvalidTask

PREFIX = "/ui/knowledge"
BASE_ID = re.compile(r"[0-9a-f]{32}")
# Notices after the reindex form, by code: fixed words, nothing from the request is reflected.
NOTICES = {
    "reindexing": "Reindex submitted: the files it took now link to its task.",
    "nothing": "No file needed reindexing.",
    "active": "A reindex of this base is already running; its files link to it.",
}

router = APIRouter(prefix=PREFIX)


async def file_filters(
    status: str = "",
    cursor: Annotated[str, Query(max_length=500)] = "",
    limit: int = DEFAULT_PAGE_SIZE,
) -> StatusPage:
    return status_page(STATUSES, status, cursor, limit, noun="file")


Files = Annotated[StatusPage, Depends(file_filters)]


async def _base(svc: Services, viewer: Viewer, base_id: str) -> dict[str, Any]:
    """The base if this key may see it: the API's rule (its owner, or an admin key), else 404."""
    row = None
    if BASE_ID.fullmatch(base_id):
        async with svc.engine.connect() as conn:
            row = await catalog.get_base(conn, base_id)
    owner = viewer.principal.owner_filter()
    if row is None or (owner is not None and row["owner"] != owner):
        raise UiError(404, "No such knowledge base (or not yours).")
    return row


async def _files(svc: Services, viewer: Viewer, base: dict[str, Any], f: StatusPage) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        counts = await catalog.file_counts(conn, base["id"])
        try:
            rows, next_cursor = await catalog.list_files(
                conn, base["id"], status=f.status, limit=f.limit, cursor=f.cursor
            )
        except ValueError:  # a cursor we did not make
            raise UiError(400, "That page link is not valid; start again from the newest files.") from None
    for row in rows:
        row["attempt"] = attempt_of(row, svc.registry)
        row["refused"] = catalog.refused_at_upload(row)
    return {
        "viewer": viewer,
        "base": base,
        "counts": counts,
        "total": sum(counts.values()),
        "failed": sum(counts.get(s, 0) for s in ERRORS),
        "files": rows,
        "next_cursor": next_cursor,
        "filters": f,
        "now": await db_now(svc.engine),
    }


@router.get("")
async def bases(request: Request, viewer: Signed) -> Response:
    svc = services(request)
    async with svc.engine.connect() as conn:
        rows = await catalog.list_bases(conn, viewer.principal.owner_filter())
    context = {"viewer": viewer, "bases": rows, "statuses": STATUSES, "errors": ERRORS}
    return render(request, "knowledge/bases.html", context)


@router.get("/bases/{base_id}")
async def base_page(
    request: Request, base_id: str, viewer: Signed, f: Files, notice: str | None = None
) -> Response:
    svc = services(request)
    base = await _base(svc, viewer, base_id)
    context = {
        **await _files(svc, viewer, base, f),
        "statuses": STATUSES,
        "page_sizes": PAGE_SIZES,
        "notice": NOTICES.get(notice or ""),
    }
    return render(request, "knowledge/base.html", context)


@router.get("/bases/{base_id}/files")
async def files_table(request: Request, base_id: str, viewer: Signed, f: Files) -> Response:
    """The files table alone: what the base page polls every 2 s."""
    svc = services(request)
    base = await _base(svc, viewer, base_id)
    return render(request, "knowledge/_files_table.html", await _files(svc, viewer, base, f))


@router.post("/bases/{base_id}/reindex")
async def reindex(request: Request, base_id: str, viewer: Checked) -> Response:
    """The API's POST /knowledge/bases/{id}/reindex-pending: one task for the base's failed files."""
    svc = services(request)
    base = await _base(svc, viewer, base_id)
    missing = StoreConfig.from_settings(svc.settings).missing()
    if missing:  # the API answers 503 too: no worker of this deployment could index them
        raise UiError(503, f"Knowledge stores are not configured ({', '.join(missing)} unset).")
    try:
        outcome = await reindex_base(svc, base["id"], base["owner"])
    except InvalidTask as exc:
        raise UiError(exc.status, exc.message) from None
    code = "active" if outcome.active else "reindexing" if outcome.task_id else "nothing"
    return redirect(f"{PREFIX}/bases/{base['id']}?notice={code}")


UI = UiExtension(
    router,
    nav=(NavEntry("Knowledge", PREFIX),),
    templates=DOMAIN.templates,
)
