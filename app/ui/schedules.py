"""The dashboard's schedules: the list, one schedule (its next slots and last tasks), and the
pause and resume forms (CSRF-checked, like cancel).

A schedule's page is addressed by owner and name, so an admin never has to guess between two
owners' schedules of the same name; any other key finds only its own (another owner's is 404).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

from app.schedule_actions import owned_schedule, schedule_detail, schedule_view
from app.ui.data import services
from app.ui.extensions import NavEntry, UiExtension
from app.ui.render import redirect, render
from app.ui.session import Checked, Signed, UiError, Viewer
from tasks_core.store.schedules import ScheduleStore

router = APIRouter(prefix="/ui")
NOTICES = {
    "paused": "Paused: no slot fires until you resume it.",
    "resumed": "Resumed: the next slot is the first after now.",
}


async def _schedule(request: Request, viewer: Viewer, owner: str, name: str) -> dict[str, Any]:
    if not viewer.principal.admin and owner != viewer.principal.name:
        raise UiError(404, "No such schedule (or not yours).")
    svc = services(request)
    try:
        row = await owned_schedule(svc, name, viewer.principal, owner)
    except HTTPException:
        raise UiError(404, "No such schedule (or not yours).") from None
    return {"viewer": viewer, "schedule": await schedule_detail(svc, row), "row": row}


@router.get("/schedules")
async def schedule_list(request: Request, viewer: Signed) -> Response:
    rows = await ScheduleStore.of(services(request)).listed(viewer.principal.owner_filter())
    return render(
        request, "schedules.html", {"viewer": viewer, "schedules": [schedule_view(r) for r in rows]}
    )


@router.get("/schedules/{owner}/{name}")
async def schedule_page(
    request: Request, owner: str, name: str, viewer: Signed, notice: str | None = None
) -> Response:
    context = await _schedule(request, viewer, owner, name)
    return render(request, "schedule.html", {**context, "notice": NOTICES.get(notice or "")})


async def _act(request: Request, viewer: Viewer, owner: str, name: str, action: str) -> Response:
    context = await _schedule(request, viewer, owner, name)
    store = ScheduleStore.of(services(request))
    await (store.pause if action == "paused" else store.resume)(context["row"]["id"])
    return redirect(f"/ui/schedules/{owner}/{name}?notice={action}")


@router.post("/schedules/{owner}/{name}/pause")
async def pause(request: Request, owner: str, name: str, viewer: Checked) -> Response:
    return await _act(request, viewer, owner, name, "paused")


@router.post("/schedules/{owner}/{name}/resume")
async def resume(request: Request, owner: str, name: str, viewer: Checked) -> Response:
    return await _act(request, viewer, owner, name, "resumed")


SCHEDULES_UI = UiExtension(router, nav=(NavEntry("Schedules", "/ui/schedules"),))
