"""/evaluation: datasets generated from a knowledge base (each a durable task), their items, resume,
and retrieval evaluation runs with their metrics and per-item outcomes.

A key sees only its own datasets, runs and bases (an admin key sees all); anything else answers
404. A dataset or run is created with its task in one transaction, then the task id is published.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse

from app.auth import Principal
from app.dependencies import Caller, Svc
from domains.evaluation import store
from domains.evaluation.generation import capacity, load_generator
from domains.evaluation.model import COMPLETED, GENERATING, RUNNING
from domains.evaluation.schemas import (
    ID,
    DatasetIn,
    DatasetOut,
    DatasetRef,
    EvaluationConflict,
    EvaluationError,
    ItemPage,
    OutcomePage,
    RunIn,
    RunOut,
    RunRef,
)
from domains.evaluation.settings import EvaluationSettings
from domains.evaluation.tasks import GENERATE, RUN
from domains.knowledge import catalog
from tasks_core.services import Services
from tasks_core.submission import InvalidTask, Submitter, TaskIntent

PREFIX = "/evaluation"


def _err(description: str, model: type = EvaluationError) -> dict[str, Any]:
    return {"model": model, "description": description}


Responses = dict[int | str, dict[str, Any]]
COMMON: Responses = {401: _err("Missing or invalid API key"), 404: _err("No such object (or not yours)")}
QUOTA: Responses = {429: _err("You already have DTASK_OWNER_MAX_PENDING pending tasks")}


router = APIRouter(prefix=PREFIX, tags=["evaluation"])
DatasetId = Annotated[str, Path(pattern=ID, description="A dataset id (32 hex digits)")]
RunId = Annotated[str, Path(pattern=ID, description="A run id (32 hex digits)")]
Limit = Annotated[int, Query(ge=1, le=1000)]
Cursor = Annotated[
    str | None, Query(max_length=12, pattern=r"^[0-9]+$", description="`next_cursor` of the last page")
]


def _visible(row: dict[str, Any] | None, caller: Principal, what: str) -> dict[str, Any]:
    if row is None or (not caller.admin and row["owner"] != caller.name):
        raise HTTPException(404, f"no such {what}")  # another owner's object does not exist for you
    return row


def _invalid(field: str, message: str) -> HTTPException:
    # FastAPI's own validation-error shape, so clients handle one format.
    return HTTPException(422, [{"loc": ["body", field], "msg": message, "type": "value_error"}])


def _refused(exc: InvalidTask) -> HTTPException:
    return _invalid(exc.field, exc.message) if exc.status == 422 else HTTPException(exc.status, exc.message)


def _conflict(detail: str, task_id: uuid.UUID | None) -> JSONResponse:
    return JSONResponse(
        status_code=409, content={"detail": detail, "task_id": str(task_id) if task_id else None}
    )


def _page(rows: list[dict[str, Any]], limit: int) -> str | None:
    return str(rows[-1]["seq"]) if len(rows) == limit else None


# ------------------------------------------------------------------------------------------------ datasets


@router.post(
    "/datasets",
    status_code=202,
    response_model=DatasetRef,
    responses={**COMMON, 422: _err("Bad size, or more items than the base's chunks give"), **QUOTA},
)
async def create_dataset(body: DatasetIn, caller: Caller, svc: Svc) -> Any:
    """A dataset of `size` question/answer items drawn from the base, and its
    `evaluation.generate_dataset` task, in one transaction."""
    async with svc.engine.connect() as conn:
        base = _visible(await catalog.get_base(conn, body.base_id), caller, "base")
        chunks = await store.chunk_count(conn, body.base_id)
    try:
        per_chunk = load_generator(EvaluationSettings().generator).per_chunk
    except ValueError as exc:  # a DTASK_EVAL_* setting is out of range, or names nothing usable
        raise HTTPException(503, str(exc)[:500]) from None
    if chunks == 0:
        raise _invalid("base_id", "the base has no indexed chunks to draw items from")
    if body.size > capacity(chunks, per_chunk):
        raise _invalid(
            "size",
            f"the base's {chunks} indexed chunks give at most {capacity(chunks, per_chunk)} items, "
            f"asked for {body.size}",
        )
    dataset_id = store.new_id()
    try:
        async with Submitter(svc).transaction(owner=base["owner"]) as tx:
            submitted = await tx.add(
                TaskIntent(GENERATE, {"dataset_id": dataset_id}, dedupe_key=f"dataset:{dataset_id}")
            )
            await store.insert_dataset(
                tx.conn, base["owner"], body.base_id, body.size, submitted.task_id, dataset_id
            )
    except InvalidTask as exc:
        raise _refused(exc) from None
    return {"id": dataset_id, "task_id": submitted.task_id, "status": GENERATING}


def _dataset_view(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("id", "base_id", "status", "item_count", "target", "task_id", "error_message", "generator")
    return {**{k: row[k] for k in keys}, "created_at": row["created_at"], "updated_at": row["updated_at"]}


@router.get("/datasets/{dataset_id}", response_model=DatasetOut, responses=COMMON)
async def get_dataset(dataset_id: DatasetId, caller: Caller, svc: Svc) -> Any:
    """Status, item_count of target, the generating task and, when it stopped, why."""
    async with svc.engine.connect() as conn:
        return _dataset_view(_visible(await store.get_dataset(conn, dataset_id), caller, "dataset"))


@router.get("/datasets/{dataset_id}/items", response_model=ItemPage, responses=COMMON)
async def list_items(
    dataset_id: DatasetId, caller: Caller, svc: Svc, limit: Limit = 100, cursor: Cursor = None
) -> Any:
    """The items persisted so far, in order (keyset pages: pass `next_cursor` back as `cursor`)."""
    async with svc.engine.connect() as conn:
        _visible(await store.get_dataset(conn, dataset_id), caller, "dataset")
        rows = await store.list_items(conn, dataset_id, int(cursor) if cursor else -1, limit)
    return {"items": rows, "next_cursor": _page(rows, limit)}


@router.post(
    "/datasets/{dataset_id}/resume",
    status_code=202,
    response_model=DatasetRef,
    responses={
        **COMMON,
        409: _err("Already completed, or a generation of it is active (named)", EvaluationConflict),
        **QUOTA,
    },
)
async def resume_dataset(dataset_id: DatasetId, caller: Caller, svc: Svc) -> Any:
    """A new task that continues a failed or cancelled dataset from its persisted items."""
    async with svc.engine.connect() as conn:
        owner = _visible(await store.get_dataset(conn, dataset_id), caller, "dataset")["owner"]
    try:
        outcome = await resume(svc, dataset_id, owner)
    except InvalidTask as exc:
        raise _refused(exc) from None
    if outcome.gone:
        raise HTTPException(404, "no such dataset")  # deleted meanwhile
    if outcome.complete is not None:
        return _conflict(f"the dataset is already complete ({outcome.complete} items)", None)
    if outcome.task_id is None:
        return _conflict("a generation of this dataset is active", outcome.active)
    return {"id": dataset_id, "task_id": outcome.task_id, "status": GENERATING}


@dataclass(frozen=True)
class DatasetResume:
    task_id: uuid.UUID | None = None  # the new generating task
    active: uuid.UUID | None = None  # the generation already active (no new task)
    complete: int | None = None  # already completed, with this many items (no new task)
    gone: bool = False  # deleted meanwhile


async def resume(svc: Services, dataset_id: str, owner: str) -> DatasetResume:
    """Hand a failed or cancelled dataset to a new generating task, one at a time. Raises
    InvalidTask when the owner's quota refuses it. The API and the dashboard both use it."""
    async with Submitter(svc).transaction(owner=owner) as tx:
        # Locked: concurrent resumes queue here, and the later ones find the first one's task.
        row = await store.get_dataset(tx.conn, dataset_id, lock=True)
        if row is None:
            return DatasetResume(gone=True)
        if row["status"] == COMPLETED:
            return DatasetResume(complete=row["item_count"])
        if row["task_active"]:
            return DatasetResume(active=row["task_id"])
        submitted = await tx.add(
            TaskIntent(GENERATE, {"dataset_id": dataset_id}, dedupe_key=f"dataset:{dataset_id}")
        )
        if submitted.duplicate_of is not None:
            return DatasetResume(active=submitted.duplicate_of)
        await store.resume_dataset(tx.conn, dataset_id, submitted.task_id)
    return DatasetResume(task_id=submitted.task_id)


# ------------------------------------------------------------------------------------------------ runs


@router.post(
    "/runs",
    status_code=202,
    response_model=RunRef,
    responses={**COMMON, 409: _err("The dataset is not completed", EvaluationConflict), **QUOTA},
)
async def create_run(body: RunIn, caller: Caller, svc: Svc) -> Any:
    """Evaluate retrieval on the base's index with the dataset's questions: an `evaluation.run` task."""
    async with svc.engine.connect() as conn:
        dataset = _visible(await store.get_dataset(conn, body.dataset_id), caller, "dataset")
        base = _visible(await catalog.get_base(conn, body.base_id), caller, "base")
    if dataset["status"] != COMPLETED:
        return _conflict(
            f"the dataset is {dataset['status']} ({dataset['item_count']} of {dataset['target']} items); "
            "only a completed dataset can be evaluated",
            dataset["task_id"] if dataset["task_active"] else None,
        )
    run_id = store.new_id()
    try:
        async with Submitter(svc).transaction(owner=base["owner"]) as tx:
            submitted = await tx.add(TaskIntent(RUN, {"run_id": run_id}))
            await store.insert_run(
                tx.conn,
                {
                    "id": run_id,
                    "owner": base["owner"],
                    "dataset_id": body.dataset_id,
                    "base_id": body.base_id,
                    "top_k": body.top_k,
                    "items_total": dataset["item_count"],
                    "task_id": submitted.task_id,
                },
            )
    except InvalidTask as exc:
        raise _refused(exc) from None
    return {"id": run_id, "task_id": submitted.task_id, "status": RUNNING}


@router.get("/runs/{run_id}", response_model=RunOut, responses=COMMON)
async def get_run(run_id: RunId, caller: Caller, svc: Svc) -> Any:
    """Status, progress and (once completed) hit@k, recall@k and MRR."""
    async with svc.engine.connect() as conn:
        row = _visible(await store.get_run(conn, run_id), caller, "run")
    done, total = row["items_done"], row["items_total"]
    keys = ("id", "dataset_id", "base_id", "top_k", "status", "metrics", "task_id", "error_message")
    return {
        **{k: row[k] for k in keys},
        "progress": {
            "done": done,
            "total": total,
            "percent": round(100.0 * done / total, 2) if total else 100.0,
        },
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }


@router.get("/runs/{run_id}/items", response_model=OutcomePage, responses=COMMON)
async def list_outcomes(
    run_id: RunId, caller: Caller, svc: Svc, limit: Limit = 100, cursor: Cursor = None
) -> Any:
    """Per-item outcomes checkpointed so far, in dataset order."""
    async with svc.engine.connect() as conn:
        _visible(await store.get_run(conn, run_id), caller, "run")
        rows = await store.list_run_items(conn, run_id, int(cursor) if cursor else -1, limit)
    return {"items": rows, "next_cursor": _page(rows, limit)}
