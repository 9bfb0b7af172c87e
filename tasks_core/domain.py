"""How a domain plugs in: one ``Domain`` value per domain, and the one list of them.

Each domain declares itself in ``domains/<name>/domain.py`` (a module that imports nothing but this
one, so reading it costs nothing). Everything else names the domain's parts by ``"module:attribute"``
or module strings, imported only by whoever needs that part: the registry its task specs, Alembic its
tables and migrations, the api its routes, pages, readiness facts and upload limits, ``dtask`` its
command group, the settings table its settings. ``tasks_core`` never imports a domain by name, so
``DOMAINS`` holds strings too.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

# "module:attribute" of each domain's Domain, in the order its routes, pages and commands are added.
DOMAINS: tuple[str, ...] = (
    "domains.diagnostics.domain:DOMAIN",
    "domains.knowledge.domain:DOMAIN",
    "domains.evaluation.domain:DOMAIN",
    "domains.graph.domain:DOMAIN",
)


@dataclass(frozen=True)
class Domain:
    name: str
    # The domain's package directory: its templates and migrations are found under it.
    root: Path
    # Modules that each define SPECS (a sequence of TaskSpec), and DUTIES if it has periodic upkeep.
    tasks: tuple[str, ...] = ()
    # A command group mounted under `dtask` by name ("kb" -> `dtask kb ...`): (name, "module:attribute").
    cli: tuple[str, str] | None = None
    # "module:attribute" of a function returning the domain's APIRouter (called once per app).
    api: str | None = None
    # Exception class -> the api's handler for it, both "module:attribute" (a store outage -> 503).
    api_errors: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # "module:attribute" of the domain's dashboard UiExtension.
    ui: str | None = None
    # Module whose import registers the domain's tables on the runtime's MetaData.
    metadata: str | None = None
    # "module:attribute" of each of the domain's settings classes (pydantic BaseSettings): the
    # README's settings table lists their fields.
    settings: tuple[str, ...] = ()
    # Readiness fact name -> "module:attribute" of ``async check(services) -> (ok, detail)``.
    readiness: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # "module:attribute" of ``function(settings) -> list[BodyRoute]``: the routes whose request
    # bodies may exceed the api's default limit (uploads), with their own limits.
    path_limits: str | None = None
    # "module:attribute" of each ``tasks_core.metrics`` Counter or Histogram the domain records:
    # recorded and flushed like the runtime's own, rendered beside them at /metrics.
    metrics: tuple[str, ...] = ()

    @property
    def migrations(self) -> Path | None:
        """Its Alembic versions directory (domains/<name>/migrations), if it has tables."""
        path = self.root / "migrations"
        return path if path.is_dir() else None

    @property
    def templates(self) -> Path | None:
        """Its dashboard templates (domains/<name>/templates), if it has pages."""
        path = self.root / "templates"
        return path if path.is_dir() else None


def _load(path: str) -> Domain:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"{path!r} is not 'module:attribute'")
    domain = getattr(importlib.import_module(module), attr)
    if not isinstance(domain, Domain):
        raise TypeError(f"{path} is not a Domain")
    return domain


@functools.cache
def load_domains(paths: tuple[str, ...] = DOMAINS) -> tuple[Domain, ...]:
    """Each domain's declaration (its domain.py is imported; none of its other modules is)."""
    found = tuple(_load(path) for path in paths)
    names = [d.name for d in found]
    if len(set(names)) != len(names):
        raise ValueError(f"a domain is declared twice: {names}")
    return found
