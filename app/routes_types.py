"""/task-types: what a key may submit, with each type's payload JSON Schema."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.dependencies import Caller
from app.schemas import Message, TaskType
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
            "payload_schema": spec.payload.model_json_schema() if spec.payload else ANY_OBJECT,
        }
        for spec in sorted(svc.registry.specs(), key=lambda sp: sp.task_type)
        if may_submit(spec, s, caller.admin)
    ]
