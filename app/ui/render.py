"""Templates, their filters, and the headers every dashboard page carries."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from app.ui.extensions import NavEntry, UiExtension
from app.ui.session import Viewer

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
# A page shows at most this much of a payload or result; the API serves the whole object.
MAX_JSON_CHARS = 100_000
UNITS = (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1))

HEADERS = {
    # Task data is per key: never keep it in a shared or browser cache.
    "Cache-Control": "no-store",
    # Only our own script and stylesheet run: an injected tag in a payload could do nothing.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def duration(seconds: float | None) -> str:
    """3 s, 4 min 10 s, 2 h 5 min, 3 d 4 h: two units are enough to read at a glance."""
    if seconds is None:
        return ""
    sign, s = ("-" if seconds < 0 else ""), int(abs(seconds))
    for big, big_size, small, small_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if s >= big_size:
            rest = (s % big_size) // small_size
            return f"{sign}{s // big_size} {big}" + (f" {rest} {small}" if rest else "")
    return f"{sign}{s} s"


def stamp(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty(value: Any) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    if len(text) > MAX_JSON_CHARS:
        return text[:MAX_JSON_CHARS] + f"\n… ({len(text) - MAX_JSON_CHARS:,} more characters: see the API)"
    return text


class Ui:
    """The dashboard's per-app state (``app.state.ui``): templates, navigation, links."""

    def __init__(self, *, flower_url: str, extensions: Sequence[UiExtension]) -> None:
        loaders = [FileSystemLoader(HERE / "templates")]
        loaders += [FileSystemLoader(e.templates) for e in extensions if e.templates is not None]
        env = Environment(
            loader=ChoiceLoader(loaders),
            autoescape=select_autoescape(default=True),
            undefined=StrictUndefined,
        )
        env.filters.update(duration=duration, stamp=stamp, pretty=pretty)
        self.templates = Jinja2Templates(env=env)
        self.nav = (NavEntry("Tasks", "/ui"), *(entry for e in extensions for entry in e.nav))
        self.flower_url = flower_url

    def nav_for(self, viewer: Viewer) -> list[NavEntry]:
        return [e for e in self.nav if viewer.principal.admin or not e.admin_only]


def render(request: Request, template: str, context: dict[str, Any], status_code: int = 200) -> Response:
    """A dashboard page or fragment; ``context`` needs ``viewer`` (None on the sign-in page)."""
    ui: Ui = request.app.state.ui
    response = ui.templates.TemplateResponse(
        request, template, {"ui": ui, "active": request.url.path, **context}, status_code=status_code
    )
    response.headers.update(HEADERS)
    return response


def redirect(location: str) -> Response:
    return Response(status_code=303, headers={"Location": location, "Cache-Control": "no-store"})
