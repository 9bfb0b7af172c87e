"""The evaluation domain's dashboard pages (/ui/evaluation): datasets with their generation state and
runs with their metrics, each linked to the task that owns it, a dataset's items and a run's
per-item outcomes a page at a time, and a form to resume a stopped dataset. Declared as
the domain's ``ui`` in its ``domain.py``.

Everything shown comes from PostgreSQL through the domain's store, with the API's owner rules: a
key sees its own datasets and runs (an admin key all); another owner's does not exist (404).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated, Any
from urllib.parse import urlencode

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
    page_size,
    redirect,
    render,
    services,
    status_page,
)
from domains.evaluation import store
from domains.evaluation.domain import DOMAIN
from domains.evaluation.model import CANCELLED, DATASET_STATUSES, FAILED, RUN_STATUSES
from domains.evaluation.routes import resume
from domains.knowledge import catalog
from tasks_core.db import db_now
from tasks_core.services import Services
from tasks_core.submission import InvalidTask

PREFIX = "/ui/evaluation"
LIST_LIMIT = 200  # newest runs on a dataset's page
ID = re.compile(r"[0-9a-f]{32}")
STOPPED = (FAILED, CANCELLED)  # a dataset that may be resumed
# Notices after the resume form, by code: fixed words, nothing from the request is reflected.
NOTICES = {
    "resumed": "Resume submitted: the dataset now links to its new task.",
    "active": "A generation of this dataset is already active; the dataset links to it.",
    "complete": "The dataset is already complete.",
}

router = APIRouter(prefix=PREFIX)


@dataclass(frozen=True)
class Paging:
    """A keyset page of items or outcomes: those after position ``after``, in order."""

    after: int | None = None
    limit: int = DEFAULT_PAGE_SIZE

    def query(self, **changes: Any) -> str:
        p = replace(self, **changes)
        params = {"cursor": None if p.after is None else str(p.after)}
        params["limit"] = None if p.limit == DEFAULT_PAGE_SIZE else str(p.limit)
        return urlencode({k: v for k, v in params.items() if v})


async def paging(cursor: Annotated[str, Query(max_length=12)] = "", limit: int = DEFAULT_PAGE_SIZE) -> Paging:
    if not re.fullmatch(r"[0-9]{0,9}", cursor):  # a position (an int4 column)
        raise UiError(400, "That page link is not valid; start again from the first item.")
    return Paging(int(cursor) if cursor else None, page_size(limit))


Pages = Annotated[Paging, Depends(paging)]


async def dataset_filters(
    status: str = "", cursor: Annotated[str, Query(max_length=500)] = "", limit: int = DEFAULT_PAGE_SIZE
) -> StatusPage:
    return status_page(DATASET_STATUSES, status, cursor, limit)


async def run_filters(
    status: str = "", cursor: Annotated[str, Query(max_length=500)] = "", limit: int = DEFAULT_PAGE_SIZE
) -> StatusPage:
    return status_page(RUN_STATUSES, status, cursor, limit)


DatasetFilters = Annotated[StatusPage, Depends(dataset_filters)]
RunFilters = Annotated[StatusPage, Depends(run_filters)]


def _mine(viewer: Viewer, row: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """The row if this key may see it: the API's rule (its owner, or an admin key), else 404."""
    owner = viewer.principal.owner_filter()
    if row is None or (owner is not None and row["owner"] != owner):
        raise UiError(404, f"No such {what} (or not yours).")
    return row


async def _dataset(svc: Services, viewer: Viewer, dataset_id: str) -> dict[str, Any]:
    row = None
    if ID.fullmatch(dataset_id):
        async with svc.engine.connect() as conn:
            row = await store.get_dataset(conn, dataset_id)
    return _mine(viewer, row, "dataset")


async def _run(svc: Services, viewer: Viewer, run_id: str) -> dict[str, Any]:
    row = None
    if ID.fullmatch(run_id):
        async with svc.engine.connect() as conn:
            row = await store.get_run(conn, run_id)
    return _mine(viewer, row, "evaluation run")


async def _task_status(svc: Services, row: dict[str, Any]) -> str | None:
    """The status of the task the dataset or run links to (None once the task was pruned)."""
    task = await svc.repo.get(row["task_id"]) if row["task_id"] else None
    return None if task is None else str(task["status"])


async def _dataset_live(svc: Services, viewer: Viewer, dataset_id: str) -> dict[str, Any]:
    dataset = await _dataset(svc, viewer, dataset_id)
    return {
        "viewer": viewer,
        "d": dataset,
        "task_status": await _task_status(svc, dataset),
        "resumable": dataset["status"] in STOPPED,  # its terminal hook ended it: no task is active
        "now": await db_now(svc.engine),
    }


async def _run_live(svc: Services, viewer: Viewer, run_id: str) -> dict[str, Any]:
    run = await _run(svc, viewer, run_id)
    return {
        "viewer": viewer,
        "r": run,
        "task_status": await _task_status(svc, run),
        "now": await db_now(svc.engine),
    }


def _next(rows: list[dict[str, Any]], p: Paging) -> tuple[list[dict[str, Any]], int | None]:
    """The page, and the cursor of the next one (rows were fetched one past the page)."""
    page = rows[: p.limit]
    return page, (page[-1]["seq"] if len(rows) > p.limit else None)


async def _datasets(svc: Services, viewer: Viewer, f: StatusPage) -> dict[str, Any]:
    owner = viewer.principal.owner_filter()
    async with svc.engine.connect() as conn:
        counts = await store.dataset_counts(conn, owner)
        try:
            rows, next_cursor = await store.list_datasets(
                conn, owner, status=f.status, limit=f.limit, cursor=f.cursor
            )
        except ValueError:  # a cursor we did not make
            raise UiError(400, "That page link is not valid; start again from the newest.") from None
    return {
        "viewer": viewer,
        "datasets": rows,
        "counts": counts,
        "total": sum(counts.values()),
        "next_cursor": next_cursor,
        "filters": f,
    }


async def _runs(svc: Services, viewer: Viewer, f: StatusPage) -> dict[str, Any]:
    owner = viewer.principal.owner_filter()
    async with svc.engine.connect() as conn:
        counts = await store.run_counts(conn, owner)
        try:
            rows, next_cursor = await store.list_runs(
                conn, owner, status=f.status, limit=f.limit, cursor=f.cursor
            )
        except ValueError:
            raise UiError(400, "That page link is not valid; start again from the newest.") from None
    return {
        "viewer": viewer,
        "runs": rows,
        "counts": counts,
        "total": sum(counts.values()),
        "next_cursor": next_cursor,
        "filters": f,
    }


@router.get("")
async def datasets(request: Request, viewer: Signed, f: DatasetFilters) -> Response:
    context = await _datasets(services(request), viewer, f)
    context.update(statuses=DATASET_STATUSES, page_sizes=PAGE_SIZES)
    return render(request, "evaluation/datasets.html", context)


@router.get("/fragments/datasets")
async def datasets_table(request: Request, viewer: Signed, f: DatasetFilters) -> Response:
    """The datasets table alone: what the datasets page polls every 2 s."""
    return render(request, "evaluation/_datasets_table.html", await _datasets(services(request), viewer, f))


@router.get("/runs")
async def runs(request: Request, viewer: Signed, f: RunFilters) -> Response:
    context = await _runs(services(request), viewer, f)
    context.update(statuses=RUN_STATUSES, page_sizes=PAGE_SIZES)
    return render(request, "evaluation/runs.html", context)


@router.get("/fragments/runs")
async def runs_table(request: Request, viewer: Signed, f: RunFilters) -> Response:
    """The runs table alone: what the runs page polls every 2 s."""
    return render(request, "evaluation/_runs_list.html", await _runs(services(request), viewer, f))


@router.get("/datasets/{dataset_id}")
async def dataset_page(
    request: Request, dataset_id: str, viewer: Signed, p: Pages, notice: str | None = None
) -> Response:
    svc = services(request)
    live = await _dataset_live(svc, viewer, dataset_id)
    async with svc.engine.connect() as conn:
        base = await catalog.get_base(conn, live["d"]["base_id"])
        rows = await store.list_items(conn, dataset_id, -1 if p.after is None else p.after, p.limit + 1)
        runs, more_runs = await store.list_runs(
            conn, viewer.principal.owner_filter(), limit=LIST_LIMIT, dataset_id=dataset_id
        )
    items, next_cursor = _next(rows, p)
    context = {
        **live,
        "base": base,
        "items": items,
        "next_cursor": next_cursor,
        "paging": p,
        "page_sizes": PAGE_SIZES,
        "runs": runs,
        "more_runs": more_runs is not None,
        "notice": NOTICES.get(notice or ""),
    }
    return render(request, "evaluation/dataset.html", context)


@router.get("/datasets/{dataset_id}/live")
async def dataset_live(request: Request, dataset_id: str, viewer: Signed) -> Response:
    """The dataset's state alone: what its page polls every 2 s while it is generating."""
    return render(
        request, "evaluation/_dataset_live.html", await _dataset_live(services(request), viewer, dataset_id)
    )


@router.post("/datasets/{dataset_id}/resume")
async def resume_dataset(request: Request, dataset_id: str, viewer: Checked) -> Response:
    """The API's POST /evaluation/datasets/{id}/resume: a new task continues from the items kept."""
    svc = services(request)
    dataset = await _dataset(svc, viewer, dataset_id)
    try:
        outcome = await resume(svc, dataset["id"], dataset["owner"])
    except InvalidTask as exc:
        raise UiError(exc.status, exc.message) from None
    if outcome.gone:
        raise UiError(404, "No such dataset (or not yours).")
    code = "resumed" if outcome.task_id else "complete" if outcome.complete is not None else "active"
    return redirect(f"{PREFIX}/datasets/{dataset['id']}?notice={code}")


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str, viewer: Signed, p: Pages) -> Response:
    svc = services(request)
    live = await _run_live(svc, viewer, run_id)
    async with svc.engine.connect() as conn:
        base = await catalog.get_base(conn, live["r"]["base_id"])
        rows = await store.list_run_items(conn, run_id, -1 if p.after is None else p.after, p.limit + 1)
    outcomes, next_cursor = _next(rows, p)
    context = {
        **live,
        "base": base,
        "outcomes": outcomes,
        "next_cursor": next_cursor,
        "paging": p,
        "page_sizes": PAGE_SIZES,
    }
    return render(request, "evaluation/run.html", context)


@router.get("/runs/{run_id}/live")
async def run_live(request: Request, run_id: str, viewer: Signed) -> Response:
    """The run's state alone: what its page polls every 2 s while it is running."""
    return render(request, "evaluation/_run_live.html", await _run_live(services(request), viewer, run_id))


UI = UiExtension(
    router,
    nav=(NavEntry("Evaluation", PREFIX),),
    templates=DOMAIN.templates,
)
