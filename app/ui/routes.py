"""The dashboard's pages: sign-in, the task list, a task, and the forms that act on tasks.

Pages render whole; the parts that change (summary, table, a task's state) are fragments that
htmx polls and swaps in place, so the page stays live without reloading.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, HTTPException, Query, Request
from starlette.responses import Response

from app import task_actions
from app.routes_health import readiness_facts
from app.ui import data
from app.ui.data import Filters
from app.ui.render import redirect, render
from app.ui.session import (
    Checked,
    Signed,
    UiError,
    Viewer,
    authenticate,
    current_viewer,
    end_session,
    remember_sign_in_token,
    sign_in_token,
    sign_in_token_ok,
    start_session,
)
from tasks_core.db import db_now
from tasks_core.duties.relay import relay
from tasks_core.retries import Retried, RetryRefused, retry_tasks
from tasks_core.submission import InvalidTask, Submitter

router = APIRouter(prefix="/ui", include_in_schema=False)

# Notices after a form, by code: fixed words, nothing from the request is reflected.
NOTICES = {
    "cancelled": "Cancelled: it had not started.",
    "cancel_requested": "Cancel requested: the task stops at its next heartbeat.",
    "finished": "The task had already finished.",
    "deleted": "Task deleted.",
    "active": "Only finished tasks can be deleted; cancel it first.",
    "retried": "Retried: this is the new task.",
    "not_retried": "Not retried: only a failed or cancelled task is, once (see Retried by).",
    "retried_many": "The failed tasks shown were retried, each as a new task.",
    "paused": "Paused: its pending tasks wait; running ones finish.",
    "resumed": "Resumed: its waiting tasks are sent as capacity frees.",
}
# Where sign-in may send you back to: a dashboard path of ours, never another site.
NEXT = re.compile(r"/ui(?:[/?][^\s\\]*)?")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def _notice(code: str | None) -> str | None:
    return NOTICES.get(code or "")


# ------------------------------------------------------------------ sign-in


@router.get("/sign-in")
async def sign_in_page(request: Request, next_path: Annotated[str, Query(alias="next")] = "/ui") -> Response:
    if await current_viewer(request) is not None:
        return redirect(_next(next_path))
    return _sign_in_form(request, next_path)


def _next(path: str) -> str:
    return path if NEXT.fullmatch(path) else "/ui"


def _sign_in_form(
    request: Request, next_path: str, error: str | None = None, status_code: int = 200
) -> Response:
    token = sign_in_token()
    # Browsers drop a Secure cookie over plain HTTP (loopback aside): say so instead of looping.
    insecure = request.url.scheme == "http" and request.url.hostname not in LOOPBACK
    context = {"viewer": None, "next": _next(next_path), "error": error, "token": token, "insecure": insecure}
    response = render(request, "sign_in.html", context, status_code)
    remember_sign_in_token(response, token)
    return response


@router.post("/sign-in")
async def sign_in(
    request: Request,
    # No constraints on these: a refused field is echoed in the 422, and `key` is a secret.
    key: Annotated[str, Form()] = "",
    token: Annotated[str, Form()] = "",
    next_path: Annotated[str, Form(alias="next")] = "/ui",
) -> Response:
    if not sign_in_token_ok(request, token):
        return _sign_in_form(request, next_path, "The sign-in form expired; please try again.", 403)
    principal = authenticate(request, key.strip())
    if principal is None:
        return _sign_in_form(request, next_path, "That is not a valid API key.", 401)
    response = redirect(_next(next_path))
    await start_session(request, response, principal)
    return response


@router.post("/sign-out")
async def sign_out(request: Request, viewer: Checked) -> Response:
    response = redirect("/ui/sign-in")
    await end_session(request, response)
    return response


# ------------------------------------------------------------------ the task list


async def filters(
    status: str = "",
    task_type: Annotated[str, Query(max_length=200)] = "",
    cursor: Annotated[str, Query(max_length=500)] = "",
    limit: int = data.DEFAULT_PAGE_SIZE,
) -> Filters:
    """The list's query (an empty field from the filter form means "any")."""
    if status and status not in data.STATUSES:
        raise UiError(400, "Unknown status filter.")
    if "\x00" in task_type or "\x00" in cursor:
        raise UiError(400, "Bad filter.")
    return Filters(
        status or None,
        task_type or None,
        cursor or None,
        data.page_size(limit),
    )


async def _table(request: Request, viewer: Viewer, f: Filters) -> dict[str, Any]:
    try:
        rows, next_cursor = await data.task_page(data.services(request), f, viewer.principal.owner_filter())
    except ValueError:  # a cursor we did not make
        raise UiError(400, "That page link is not valid; start again from the newest tasks.") from None
    return {"viewer": viewer, "filters": f, "tasks": rows, "next_cursor": next_cursor}


async def _overview(request: Request, viewer: Viewer) -> dict[str, Any]:
    counts, age = await data.summary(request, viewer.principal.owner_filter())
    return {
        "viewer": viewer,
        "summary": counts,
        "counted_ago": age,
        "facts": await readiness_facts(data.services(request)),
        "paused": [row["task_type"] for row in await data.services(request).repo.paused_types()],
    }


@router.get("")
async def task_list(
    request: Request, viewer: Signed, f: Annotated[Filters, Depends(filters)], notice: str | None = None
) -> Response:
    overview = await _overview(request, viewer)
    types = sorted(set(overview["summary"]["by_type"]) | ({f.task_type} if f.task_type else set()))
    context = {
        **overview,
        **await _table(request, viewer, f),
        "types": types,
        # The type the list is filtered to, if it is one this deployment runs: an admin may pause it.
        "pausable": f.task_type if f.task_type and data.services(request).registry.get(f.task_type) else None,
        "statuses": data.STATUSES,
        "page_sizes": data.PAGE_SIZES,
        "notice": _notice(notice),
    }
    return render(request, "tasks.html", context)


@router.get("/fragments/tasks")
async def task_table(request: Request, viewer: Signed, f: Annotated[Filters, Depends(filters)]) -> Response:
    return render(request, "_tasks_table.html", await _table(request, viewer, f))


@router.get("/fragments/overview")
async def overview(request: Request, viewer: Signed) -> Response:
    return render(request, "_overview.html", await _overview(request, viewer))


# ------------------------------------------------------------------ one task


async def _task(request: Request, viewer: Viewer, task_id: str) -> dict[str, Any]:
    svc = data.services(request)
    try:
        tid = uuid.UUID(task_id)
        row = await task_actions.owned_task(svc, tid, viewer.principal)
    except (ValueError, HTTPException):
        raise UiError(404, "No such task (or not yours).") from None
    now = await db_now(svc.engine)
    return {
        "viewer": viewer,
        "task": data.describe(row, now, await data.waiting_reason(svc, row)),
        "payload": row["payload"],
        "attempts": await data.attempts(svc, tid, admin=viewer.principal.admin),
    }


@router.get("/tasks/{task_id}")
async def task_page(request: Request, task_id: str, viewer: Signed, notice: str | None = None) -> Response:
    return render(request, "task.html", {**await _task(request, viewer, task_id), "notice": _notice(notice)})


@router.get("/tasks/{task_id}/live")
async def task_live(request: Request, task_id: str, viewer: Signed) -> Response:
    try:
        context = await _task(request, viewer, task_id)
    except UiError:  # deleted meanwhile: say so, and the fragment stops polling
        return render(request, "_task_gone.html", {"viewer": viewer})
    return render(request, "_task_live.html", context)


@router.post("/tasks/{task_id}/cancel")
async def cancel(request: Request, task_id: uuid.UUID, viewer: Checked) -> Response:
    try:
        outcome = await task_actions.cancel_task(data.services(request), task_id, viewer.principal)
    except HTTPException as exc:
        if exc.status_code != 409:
            raise UiError(404, "No such task (or not yours).") from None
        outcome = "finished"
    code = {"requested": "cancel_requested"}.get(outcome, outcome)
    return redirect(f"/ui/tasks/{task_id}?notice={code}")


@router.post("/tasks/retry")
async def retry_many(
    request: Request, viewer: Checked, ids: Annotated[list[uuid.UUID], Form()]
) -> Response:
    """The list page's bulk retry: the failed tasks it showed (ids the viewer may not see, or that
    were retried meanwhile, are skipped, as POST /tasks/retry answers them)."""
    try:
        await _retry(request, viewer, ids)
    except InvalidTask as exc:  # over the batch limit: no page shows that many
        raise UiError(400, exc.message) from None
    return redirect("/ui?status=failed&notice=retried_many")


@router.post("/tasks/{task_id}/retry")
async def retry(request: Request, task_id: uuid.UUID, viewer: Checked) -> Response:
    [outcome] = await _retry(request, viewer, [task_id])
    if isinstance(outcome, Retried):
        return redirect(f"/ui/tasks/{outcome.new.task_id}?notice=retried")
    if isinstance(outcome, RetryRefused) and outcome.status == 404:
        raise UiError(404, "No such task (or not yours).")
    return redirect(f"/ui/tasks/{task_id}?notice=not_retried")


async def _retry(request: Request, viewer: Viewer, ids: list[uuid.UUID]) -> list[Retried | InvalidTask]:
    principal = viewer.principal
    owner = None if principal.admin else principal.name
    return await retry_tasks(Submitter(data.services(request)), ids, owner=owner, admin=principal.admin)


@router.post("/task-types/{task_type}/{action}")
async def pause_or_resume(request: Request, task_type: str, action: str, viewer: Checked) -> Response:
    """Admin: pause or resume a type from the list filtered to it (the API's rules)."""
    svc = data.services(request)
    if action not in ("pause", "resume"):
        raise UiError(404, "No such page.")
    if not viewer.principal.admin:
        raise UiError(403, "Pausing a task type needs an admin key.")
    if svc.registry.get(task_type) is None:
        raise UiError(404, "No such task type.")
    if action == "pause":
        await svc.repo.pause_type(task_type, by=viewer.principal.name)
    elif await svc.repo.resume_type(task_type):
        await relay(svc, by="resume")
    return redirect(f"/ui?{urlencode({'task_type': task_type, 'notice': action + 'd'})}")


@router.post("/tasks/{task_id}/delete")
async def delete(request: Request, task_id: uuid.UUID, viewer: Checked) -> Response:
    try:
        await task_actions.delete_task(data.services(request), task_id, viewer.principal)
    except HTTPException as exc:
        if exc.status_code != 409:
            raise UiError(404, "No such task (or not yours).") from None
        return redirect(f"/ui/tasks/{task_id}?notice=active")
    return redirect("/ui?notice=deleted")
