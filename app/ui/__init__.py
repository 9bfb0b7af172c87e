"""The dashboard served at /ui: PostgreSQL's view of the tasks, for people.

``install(app, settings)`` adds it to the api. Domains add pages of their own through
``UiExtension`` (see ``app/ui/extensions.py``) using the names exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from app.ui.data import DEFAULT_PAGE_SIZE, PAGE_SIZES, StatusPage, page_size, services, status_page
from app.ui.extensions import NavEntry, UiExtension, load_extensions
from app.ui.render import STATIC_DIR, Ui, redirect, render
from app.ui.routes import router
from app.ui.schedules import SCHEDULES_UI
from app.ui.session import Checked, Signed, SignInRequired, UiError, Viewer
from tasks_core.settings import Settings

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "PAGE_SIZES",
    "Checked",
    "NavEntry",
    "Signed",
    "StatusPage",
    "UiError",
    "UiExtension",
    "Viewer",
    "install",
    "page_size",
    "redirect",
    "render",
    "services",
    "status_page",
]


def install(app: FastAPI, settings: Settings, extensions: Sequence[UiExtension] | None = None) -> None:
    """Mount the dashboard and the domains' pages (``extensions``; default: EXTENSION_MODULES)."""
    found = [SCHEDULES_UI, *(load_extensions() if extensions is None else extensions)]
    app.state.ui = Ui(flower_url=settings.flower_url, extensions=found)
    app.include_router(router)
    for extension in found:
        app.include_router(extension.router, include_in_schema=False)
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    app.add_exception_handler(SignInRequired, _sign_in_required)
    app.add_exception_handler(UiError, _ui_error)


async def _sign_in_required(request: Request, exc: Exception) -> Response:
    if request.headers.get("hx-request"):
        # A poll from a page whose session ended (signed out in another tab, key removed):
        # htmx turns HX-Redirect into a full navigation to the sign-in page.
        return Response(status_code=401, headers={"HX-Redirect": "/ui/sign-in", "Cache-Control": "no-store"})
    if request.method in ("GET", "HEAD"):
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return redirect(f"/ui/sign-in?next={quote(here, safe='')}")
    return Response("sign in at /ui/sign-in", status_code=401, headers={"Cache-Control": "no-store"})


async def _ui_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UiError)
    # The viewer as found earlier in this request, if it got that far: no second lookup here.
    viewer = getattr(request.state, "ui_viewer", None)
    context = {"viewer": viewer, "status": exc.status, "message": exc.message}
    return render(request, "error.html", context, exc.status)
