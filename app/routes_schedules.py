"""/schedules: durable periodic tasks (create, list, read, delete, pause, resume)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, HTTPException, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from app import task_actions
from app.dependencies import Caller, Svc
from app.schedule_actions import owned_schedule, schedule_detail, schedule_view
from app.schemas import NO_NUL, Message, Status
from tasks_core.schedules import NAME_RULE, ScheduleIntent, validate_schedule
from tasks_core.store.schedules import ScheduleStore
from tasks_core.submission import InvalidTask

router = APIRouter(prefix="/schedules", tags=["schedules"])
AUTH = {401: {"model": Message, "description": "Missing or invalid API key"}}
NOT_FOUND = {404: {"model": Message, "description": "No such schedule (or not yours)"}}
OwnerQuery = Annotated[
    str | None,
    Query(
        max_length=200, pattern=NO_NUL, description="Admin keys: whose schedule, when two owners share a name"
    ),
]


class ScheduleIn(BaseModel):
    """A task to create on a schedule: a cron expression (in `timezone`, default UTC) or a fixed
    interval, never both. The payload is checked against the type's schema now, as a submission's."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(description=f"Yours to choose: {NAME_RULE}", examples=["nightly-report"])]
    task_type: Annotated[
        str,
        Field(
            description="A registered task type (`GET /task-types`)",
            min_length=1,
            max_length=200,
            pattern=NO_NUL,
            examples=["diagnostics.noop"],
        ),
    ]
    payload: Annotated[
        dict[str, Any],
        Field(default_factory=dict, description="Each task's payload, checked against the type's schema"),
    ]
    cron: Annotated[
        str | None,
        Field(description="Five fields: minute hour day-of-month month day-of-week", examples=["30 2 * * *"]),
    ] = None
    every_seconds: Annotated[
        float | None, Field(description="A fixed interval (at least 1 s)", examples=[60])
    ] = None
    timezone: Annotated[
        str | None,
        Field(
            description="IANA zone the cron expression is read in (default UTC)", examples=["Europe/Paris"]
        ),
    ] = None
    priority: Annotated[int, Field(strict=True, description="Its tasks' priority (-100..100)")] = 0


class LastTask(BaseModel):
    task_id: UUID = Field(description="The task the slot made")
    slot_at: datetime = Field(description="The slot's instant: the task's run_at")
    status: Status | None = Field(description="None: the task was pruned since")


class ScheduleOut(BaseModel):
    name: str = Field(description="Its name, unique among its owner's schedules")
    owner: str = Field(description="The key that created it, and owns its tasks")
    task_type: str = Field(description="The type of the tasks it creates")
    payload: dict[str, Any] = Field(description="Their payload")
    cron: str | None = Field(description="Its cron expression, or None for every_seconds")
    every_seconds: float | None = Field(description="Its interval, or None for cron")
    timezone: str | None = Field(description="The IANA zone its cron expression is read in")
    priority: int = Field(description="Its tasks' priority")
    paused: bool = Field(description="Paused: it creates no task until resumed")
    paused_at: datetime | None = Field(description="When it was paused")
    next_run_at: datetime | None = Field(description="The next slot; None while paused")
    created_at: datetime = Field(description="When it was created (PostgreSQL's clock)")
    last_fired_at: datetime | None = Field(description="The instant of the last slot that made a task")
    last_error: str | None = Field(
        description="Why the last due slot made no task (type gone, payload no longer valid)"
    )


class ScheduleDetail(ScheduleOut):
    upcoming: list[datetime] = Field(description="The next few slots")
    last_tasks: list[LastTask] = Field(description="The last tasks it created, newest first")


class ScheduleList(BaseModel):
    items: list[ScheduleOut] = Field(description="Your schedules (every owner's with an admin key)")



@router.post(
    "",
    status_code=201,
    response_model=ScheduleDetail,
    responses={
        **AUTH,
        403: {"model": Message, "description": "This key may not submit the type (diagnostics types)"},
        409: {"model": Message, "description": "You already have a schedule of that name"},
        422: {"description": "Bad type or payload (as a submission), bad cron, zone or interval"},
    },
)
async def create_schedule(body: ScheduleIn, caller: Caller, svc: Svc) -> Any:
    """Create a schedule: from its first slot on, each slot creates one pending task of yours
    (`run_at` = the slot), however many beat processes run. Slots missed while nothing ran create
    one catch-up task, for the latest of them."""
    intent = ScheduleIntent(
        body.name, body.task_type, body.payload, body.cron, body.every_seconds, body.timezone, body.priority
    )
    try:
        new = validate_schedule(intent, svc.registry, svc.settings, caller.name, admin=caller.admin)
    except InvalidTask as exc:
        raise task_actions.invalid(exc) from None
    row = await ScheduleStore.of(svc).create(new)
    if row is None:
        raise HTTPException(409, f"you already have a schedule named {new.name!r}")
    return await schedule_detail(svc, row)


@router.get("", response_model=ScheduleList, responses={**AUTH})
async def list_schedules(caller: Caller, svc: Svc) -> Any:
    """Your schedules (every owner's with an admin key), by owner and name."""
    rows = await ScheduleStore.of(svc).listed(caller.owner_filter())
    return {"items": [schedule_view(r) for r in rows]}


@router.get("/{name}", response_model=ScheduleDetail, responses={**AUTH, **NOT_FOUND})
async def get_schedule(name: str, caller: Caller, svc: Svc, owner: OwnerQuery = None) -> Any:
    """The schedule, its next slots and the last tasks it created."""
    return await schedule_detail(svc, await owned_schedule(svc, name, caller, owner))


@router.delete("/{name}", status_code=204, response_class=Response, responses={**AUTH, **NOT_FOUND})
async def delete_schedule(name: str, caller: Caller, svc: Svc, owner: OwnerQuery = None) -> Response:
    """No more slots; the tasks it already created stay."""
    row = await owned_schedule(svc, name, caller, owner)
    await ScheduleStore.of(svc).delete(row["id"])
    return Response(status_code=204)


@router.post("/{name}/pause", response_model=ScheduleDetail, responses={**AUTH, **NOT_FOUND})
async def pause_schedule(name: str, caller: Caller, svc: Svc, owner: OwnerQuery = None) -> Any:
    """No slot fires while paused (pausing a paused schedule changes nothing)."""
    row = await owned_schedule(svc, name, caller, owner)
    paused = await ScheduleStore.of(svc).pause(row["id"])
    return await schedule_detail(svc, paused or row)


@router.post("/{name}/resume", response_model=ScheduleDetail, responses={**AUTH, **NOT_FOUND})
async def resume_schedule(name: str, caller: Caller, svc: Svc, owner: OwnerQuery = None) -> Any:
    """Active again from now: the next slot is the first after now, nothing missed while paused fires."""
    row = await owned_schedule(svc, name, caller, owner)
    resumed = await ScheduleStore.of(svc).resume(row["id"])
    return await schedule_detail(svc, resumed or row)
