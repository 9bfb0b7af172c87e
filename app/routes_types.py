"""/task-types: what a key may submit, with each type's payload JSON Schema."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request

from app.dependencies import Caller, Svc
from app.schemas import Message, TaskType
from tasks_core.duties.relay import relay
from tasks_core.services import Services
from tasks_core.submission import may_submit

router = APIRouter(tags=["tasks"])
# Accepts any JSON object: the schema of a type that declares no payload model.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@router.get(
    "/task-types",
    response_model=list[TaskType],
    responses={401: {"model": Message, "description": "Missing or invalid API key"}},
)
async def task_types(request: Request, caller: Caller) -> Any:
    """Every task type this key may submit, or that a domain's routes create for it (`internal`):
    its handler version, default timeout, retry-safety and the JSON Schema its payload is checked
    against."""
    svc: Services = request.app.state.services
    s = svc.settings
    paused = {row["task_type"] for row in await svc.repo.paused_types()}
    return [
        {
            "task_type": spec.task_type,
            "version": spec.version,
            "default_timeout_seconds": min(
                spec.timeout_seconds or s.default_timeout_seconds, s.max_timeout_seconds
            ),
            "retry_safe": spec.retry_safe,
            "max_attempts": spec.max_attempts,
            "internal": spec.internal,
            "paused": spec.task_type in paused,
            "payload_schema": spec.payload.model_json_schema() if spec.payload else ANY_OBJECT,
        }
        for spec in sorted(svc.registry.specs(), key=lambda sp: sp.task_type)
        if may_submit(spec, s, caller.admin)
    ]


PAUSE_ANSWERS: dict[int | str, dict[str, Any]] = {
    401: {"model": Message, "description": "Missing or invalid API key"},
    403: {"model": Message, "description": "Not an admin key"},
    404: {"model": Message, "description": "No such task type"},
}


def _type_for_admin(svc: Services, caller: Caller, task_type: str) -> str:
    if not caller.admin:
        raise HTTPException(403, "pausing a task type needs an admin key")
    if svc.registry.get(task_type) is None:
        raise HTTPException(404, f"no task type {task_type!r}")
    return task_type


@router.post("/task-types/{task_type}/pause", response_model=Message, responses=PAUSE_ANSWERS)
async def pause_type(task_type: str, caller: Caller, svc: Svc) -> Any:
    """Admin: stop claiming this type's tasks. Pending ones wait (`waiting_reason: type paused`),
    running ones finish; a claim of one is refused (`type_paused`) until it is resumed."""
    first = await svc.repo.pause_type(_type_for_admin(svc, caller, task_type), by=caller.name)
    return {"detail": f"{task_type} paused" if first else f"{task_type} was already paused"}


@router.post("/task-types/{task_type}/resume", response_model=Message, responses=PAUSE_ANSWERS)
async def resume_type(task_type: str, caller: Caller, svc: Svc) -> Any:
    """Admin: claim this type's tasks again; what capacity can take of the waiting ones is
    published at once (the rest as slots free)."""
    was = await svc.repo.resume_type(_type_for_admin(svc, caller, task_type))
    if was:
        await relay(svc, by="resume")
    return {"detail": f"{task_type} resumed" if was else f"{task_type} was not paused"}
