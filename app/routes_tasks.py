"""/tasks: submit, inspect, list, cancel, delete."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from app import task_actions
from app.cache import TtlCache
from app.dependencies import Caller, Svc
from app.schemas import (
    NO_NUL,
    AttemptList,
    BatchIn,
    BatchOut,
    Conflict,
    Message,
    RetryIn,
    RetryOut,
    Status,
    Summary,
    TaskIn,
    TaskOut,
    TaskPage,
)
from tasks_core.retries import Retried, RetryRefused, retry_tasks
from tasks_core.services import Services
from tasks_core.submission import Idempotency, InvalidTask, Submitted, Submitter, TaskIntent
from tasks_core.views import task_view

router = APIRouter(prefix="/tasks", tags=["tasks"])
NOT_FOUND = {404: {"model": Message, "description": "No such task (or not yours)"}}
AUTH = {401: {"model": Message, "description": "Missing or invalid API key"}}


def _intent(body: TaskIn) -> TaskIntent:
    return TaskIntent(
        body.task_type,
        body.payload,
        body.handler_version,
        body.dedupe_key,
        body.timeout_seconds,
        run_at=body.run_at,
        delay_seconds=body.delay_seconds,
        priority=body.priority,
    )


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=NO_NUL,
        description="Makes a retried request return the original answer (per API key, kept 24 h)",
    ),
]


def _idempotency(key: str | None, route: str, body: BaseModel) -> Idempotency | None:
    if key is None:
        return None
    canonical = json.dumps([route, body.model_dump(mode="json")], sort_keys=True, separators=(",", ":"))
    return Idempotency(key, hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest())



async def _view(svc: Services, row: dict[str, Any]) -> dict[str, Any]:
    reason = await svc.repo.waiting_reason(
        row, svc.settings.capacity, owner_max_running=svc.settings.owner_running_limit
    )
    return task_view(row, reason)


@router.post(
    "",
    status_code=202,
    response_model=TaskOut,
    responses={
        **AUTH,
        403: {"model": Message, "description": "This key may not submit the type (diagnostics types)"},
        409: {"model": Conflict, "description": "An active task of yours holds the dedupe key"},
        422: {"description": "Bad type, version, timeout or payload (checked against the type's schema)"},
        429: {"model": Message, "description": "You already have DTASK_OWNER_MAX_PENDING pending tasks"},
    },
)
async def submit_task(
    body: TaskIn, caller: Caller, svc: Svc, response: Response, idempotency_key: IdempotencyKey = None
) -> Any:
    """Store the intent (pending), then publish its id. A broker failure leaves it pending, with
    `waiting_reason` saying so: the publisher re-sends it.

    With an `Idempotency-Key` header, a retry of the same request (same key, same body, same API
    key, within 24 h) answers 200 with the task the first one created, instead of a second task."""
    try:
        result = await Submitter(svc).submit(
            _intent(body),
            owner=caller.name,
            admin=caller.admin,
            idempotency=_idempotency(idempotency_key, "POST /tasks", body),
            public=True,
        )
    except InvalidTask as exc:
        raise task_actions.invalid(exc) from None
    if result.replayed:
        response.status_code = status.HTTP_200_OK
    if result.duplicate_of is not None:
        return JSONResponse(
            status_code=409,
            content={
                "detail": "an active task already holds this dedupe key",
                "task_id": str(result.duplicate_of),
            },
        )
    return await _submitted_view(svc, result)


@router.post(
    "/batch",
    status_code=202,
    response_model=BatchOut,
    responses={**AUTH, 200: {"model": BatchOut, "description": "A retry: the first request's tasks"}},
)
async def submit_batch(
    body: BatchIn, caller: Caller, svc: Svc, response: Response, idempotency_key: IdempotencyKey = None
) -> Any:
    """Accepted entries commit in one transaction and are published in one pass. An
    `Idempotency-Key` makes a retried batch answer 200 with the first request's tasks."""
    try:
        outcomes = await Submitter(svc).submit_many(
            [_intent(t) for t in body.tasks],
            owner=caller.name,
            admin=caller.admin,
            idempotency=_idempotency(idempotency_key, "POST /tasks/batch", body),
            public=True,
        )
    except InvalidTask as exc:
        raise task_actions.invalid(exc) from None
    if any(isinstance(o, Submitted) and o.replayed for o in outcomes):
        response.status_code = status.HTTP_200_OK
    results: list[dict[str, Any]] = []
    published = True
    for outcome in outcomes:
        if isinstance(outcome, InvalidTask):
            results.append(
                {"error": {"code": outcome.code, "field": outcome.field, "message": outcome.message}}
            )
        elif outcome.duplicate_of is not None:
            results.append(
                {
                    "error": {
                        "code": "duplicate",
                        "message": "an active task holds this dedupe key",
                        "task_id": outcome.duplicate_of,
                    }
                }
            )
        else:
            published = published and outcome.publish_error is None
            results.append({"task": await _submitted_view(svc, outcome)})
    accepted = sum(1 for r in results if "task" in r)
    return {"results": results, "accepted": accepted, "published": published}


async def _submitted_view(svc: Services, outcome: Submitted) -> dict[str, Any]:
    """The task as just submitted, without reading it back (a replay reads the current row)."""
    if outcome.row is not None:
        return task_view(outcome.row, outcome.waiting_reason())
    return await _view(svc, await svc.repo.get(outcome.task_id) or {})


def _refusal(outcome: InvalidTask) -> dict[str, Any]:
    error: dict[str, Any] = {"code": outcome.code, "field": outcome.field, "message": outcome.message}
    if isinstance(outcome, RetryRefused) and outcome.task_id is not None:
        error["task_id"] = outcome.task_id
    return {"error": error}


async def _retry(svc: Services, caller: Any, ids: list[uuid.UUID]) -> list[Retried | InvalidTask]:
    owner = None if caller.admin else caller.name
    return await retry_tasks(Submitter(svc), ids, owner=owner, admin=caller.admin)


@router.post(
    "/retry",
    status_code=202,
    response_model=RetryOut,
    responses={**AUTH},
)
async def retry_many(body: RetryIn, caller: Caller, svc: Svc) -> Any:
    """Retry up to 1,000 failed or cancelled tasks, each as a new task; the accepted ones commit
    together. Each entry answers its new task, or why not (as `POST /tasks/{id}/retry` would)."""
    outcomes = await _retry(svc, caller, body.ids)
    results = [
        _refusal(o) if isinstance(o, InvalidTask) else {"task": await _submitted_view(svc, o.new)}
        for o in outcomes
    ]
    return {"results": results, "accepted": sum(1 for r in results if "task" in r)}


@router.post(
    "/{task_id}/retry",
    status_code=202,
    response_model=TaskOut,
    responses={
        **AUTH,
        **NOT_FOUND,
        403: {
            "model": Message,
            "description": "A domain's type (retry it through the domain) or not allowed",
        },
        409: {
            "model": Conflict,
            "description": "Not failed or cancelled, retried already, or its dedupe key held",
        },
        429: {"model": Message, "description": "You already have DTASK_OWNER_MAX_PENDING pending tasks"},
    },
)
async def retry_one(task_id: uuid.UUID, caller: Caller, svc: Svc) -> Any:
    """Submit a failed or cancelled task again as a new task: same type, payload, owner, timeout,
    priority and dedupe key, the type's current handler version; `retry_of` names the old task,
    whose `retried_by` names the new one. A task is retried once: again answers 409 with its retry."""
    [outcome] = await _retry(svc, caller, [task_id])
    if isinstance(outcome, RetryRefused) and outcome.status == 409:
        content = {"detail": outcome.message}
        if outcome.task_id is not None:
            content["task_id"] = str(outcome.task_id)
        return JSONResponse(status_code=409, content=content)
    if isinstance(outcome, RetryRefused):
        raise HTTPException(outcome.status, outcome.message)
    if isinstance(outcome, InvalidTask):
        raise task_actions.invalid(outcome)
    return await _submitted_view(svc, outcome.new)


@router.get("/summary", response_model=Summary, responses={**AUTH})
async def summary(caller: Caller, svc: Svc, request: Request) -> Any:
    """Exact counts by status and by type (your own tasks unless you hold an admin key), as of
    `age_seconds` ago: they are counted at most every DTASK_METRICS_CACHE_SECONDS."""
    owner = caller.owner_filter()
    cache: TtlCache[dict[str, Any]] = request.app.state.summary_cache
    counts, age = await cache.get(owner, lambda: svc.repo.summary(owner=owner))
    return {**counts, "age_seconds": round(age, 3)}


@router.get("", response_model=TaskPage, responses={**AUTH})
async def list_tasks(
    caller: Caller,
    svc: Svc,
    status_: Annotated[Status | None, Query(alias="status")] = None,
    task_type: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=500, pattern=NO_NUL)] = None,
) -> Any:
    """Newest first, keyset-paged: pass `next_cursor` back as `cursor`."""
    try:
        rows, nxt = await svc.repo.list(
            status=status_, task_type=task_type, owner=caller.owner_filter(), limit=limit, cursor=cursor
        )
    except ValueError as exc:
        raise task_actions.invalid(InvalidTask("cursor", str(exc)), ("query",)) from None
    return {"items": [task_view(r) for r in rows], "next_cursor": nxt}


@router.get("/{task_id}", response_model=TaskOut, responses={**AUTH, **NOT_FOUND})
async def get_task(task_id: uuid.UUID, caller: Caller, svc: Svc) -> Any:
    """One of your tasks (any task with an admin key), with `waiting_reason` while pending."""
    return await _view(svc, await task_actions.owned_task(svc, task_id, caller))


@router.get("/{task_id}/attempts", response_model=AttemptList, responses={**AUTH, **NOT_FOUND})
async def task_attempts(task_id: uuid.UUID, caller: Caller, svc: Svc) -> Any:
    """Every attempt of the task: who claimed it, when, and how it ended, with its error (each
    attempt's error is kept, also when a later attempt succeeded)."""
    await task_actions.owned_task(svc, task_id, caller)
    return {
        "items": [task_actions.attempt_view(a, full=caller.admin) for a in await svc.repo.attempts(task_id)]
    }


@router.post(
    "/{task_id}/cancel",
    response_model=TaskOut,
    responses={
        **AUTH,
        **NOT_FOUND,
        202: {"model": TaskOut, "description": "Running: cancel requested"},
        409: {"model": Message, "description": "Already finished"},
    },
)
async def cancel_task(task_id: uuid.UUID, caller: Caller, svc: Svc, response: Response) -> Any:
    """Pending: cancelled now (200). Running: cancel requested, it stops at its next heartbeat (202)."""
    outcome = await task_actions.cancel_task(svc, task_id, caller)
    response.status_code = status.HTTP_200_OK if outcome == "cancelled" else status.HTTP_202_ACCEPTED
    return await _view(svc, await task_actions.owned_task(svc, task_id, caller))


@router.delete(
    "/{task_id}",
    status_code=204,
    response_class=Response,
    responses={**AUTH, **NOT_FOUND, 409: {"model": Message, "description": "Task not finished"}},
)
async def delete_task(task_id: uuid.UUID, caller: Caller, svc: Svc) -> Response:
    """Delete a finished task and its attempt records (cancel an active one first)."""
    await task_actions.delete_task(svc, task_id, caller)
    return Response(status_code=204)
