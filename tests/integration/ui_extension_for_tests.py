"""A domain's dashboard page, as a domain would add one (see app/ui/extensions.py).

Imported by module path (``ui_extension_for_tests:UI``) like any extension; pytest puts this
directory on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.ui import Checked, NavEntry, Signed, UiExtension, redirect, render

router = APIRouter(prefix="/ui/demo")


@router.get("")
async def demo_page(request: Request, viewer: Signed) -> Response:
    return render(request, "demo/page.html", {"viewer": viewer, "owner": viewer.principal.owner_filter()})


@router.post("/poke")
async def poke(viewer: Checked) -> Response:
    return redirect("/ui/demo")


UI = UiExtension(
    router,
    nav=(NavEntry("Demo", "/ui/demo"), NavEntry("Demo admin", "/ui/demo?admin=1", admin_only=True)),
    templates=Path(__file__).parent / "ui_extension_templates",
)
