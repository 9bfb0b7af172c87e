"""How a domain adds its own pages to the dashboard.

A domain module defines one ``UiExtension``: a router whose paths all start with ``/ui/``, the
navigation entries that lead to it, and optionally a directory of templates; its
``"module:attribute"`` is the ``ui`` of the domain's ``Domain`` (``domains/<name>/domain.py``), from
which ``EXTENSION_MODULES`` below is derived. ``domains/knowledge/routes_ui.py`` is the
worked example. Pages take ``Signed`` (the dashboard's sign-in) and answer with ``render``; templates
extend ``"base.html"``; forms that change anything take ``Checked`` instead of ``Signed`` (it
verifies the CSRF token the layout puts in ``viewer.csrf``); a task links to ``/ui/tasks/<id>``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from starlette.routing import BaseRoute

from tasks_core.domain import load_domains
from tasks_core.registry import import_path

# "module:attribute" of each domain's UiExtension, imported when the api starts.
EXTENSION_MODULES: tuple[str, ...] = tuple(d.ui for d in load_domains() if d.ui is not None)


@dataclass(frozen=True)
class NavEntry:
    label: str
    path: str
    admin_only: bool = False


@dataclass(frozen=True)
class UiExtension:
    router: APIRouter
    nav: tuple[NavEntry, ...] = ()
    templates: Path | None = None  # searched after the dashboard's own templates

    def __post_init__(self) -> None:
        # Under /ui, a page signs in by the dashboard's cookie (the api's Guard lets /ui through to
        # authenticate itself); anywhere else it would need a bearer header a browser never sends.
        outside = [
            p for p in (*_paths(self.router.routes), *(e.path for e in self.nav)) if not p.startswith("/ui/")
        ]
        if outside:
            raise ValueError(f"dashboard pages must live under /ui/: {outside}")


def _paths(routes: Iterable[BaseRoute]) -> list[str]:
    return [str(getattr(route, "path", "")) for route in routes]


def load_extensions(paths: Iterable[str] | None = None) -> list[UiExtension]:
    found = []
    for path in EXTENSION_MODULES if paths is None else paths:
        extension = import_path(path)
        if not isinstance(extension, UiExtension):
            raise TypeError(f"{path} is not a UiExtension")
        found.append(extension)
    return found
