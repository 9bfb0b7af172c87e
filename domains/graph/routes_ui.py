"""The graph domain's dashboard pages (/ui/graph): each knowledge base's latest graph build with its
state and a link to the task that builds it, and the built graph's most mentioned entities.
Declared as the domain's ``ui`` in its ``domain.py``.

What they show comes from PostgreSQL, with the API's owner rules: a key sees its own bases (an
admin key all); another owner's base does not exist (404).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.ui import NavEntry, Signed, UiError, UiExtension, Viewer, render, services
from domains.graph import store
from domains.graph.domain import DOMAIN
from domains.graph.model import BUILT
from domains.knowledge import catalog
from tasks_core.services import Services

PREFIX = "/ui/graph"
TOP_SIZES = (25, 50, 100, 200)
DEFAULT_TOP = 50
BASE_ID = re.compile(r"[0-9a-f]{32}")

router = APIRouter(prefix=PREFIX)



async def _graph(svc: Services, viewer: Viewer, base_id: str, top: int) -> dict[str, Any]:
    """The base if this key may see it (the API's rule, else 404), its newest build of any status
    and the built graph readers see, with its ``top`` most mentioned entities."""
    base = None
    if BASE_ID.fullmatch(base_id):
        async with svc.engine.connect() as conn:
            base = await catalog.get_base(conn, base_id)
    owner = viewer.principal.owner_filter()
    if base is None or (owner is not None and base["owner"] != owner):
        raise UiError(404, "No such knowledge base (or not yours).")
    async with svc.engine.connect() as conn:
        latest = (await store.latest_builds(conn, [base_id])).get(base_id)
        built = await store.latest_build(conn, base_id, BUILT)
        entities = await store.entities_page(conn, built["id"], top, None) if built else []
    top_query = "" if top == DEFAULT_TOP else f"?top={top}"
    context = {"base": base, "latest": latest, "built": built, "entities": entities, "top_query": top_query}
    return {"viewer": viewer, **context}


def _top(top: int) -> int:
    return top if top in TOP_SIZES else DEFAULT_TOP


@router.get("")
async def bases(request: Request, viewer: Signed) -> Response:
    svc = services(request)
    async with svc.engine.connect() as conn:
        rows = await catalog.list_bases(conn, viewer.principal.owner_filter())
        builds = await store.latest_builds(conn, [r["id"] for r in rows])
    return render(request, "graph/bases.html", {"viewer": viewer, "bases": rows, "builds": builds})


@router.get("/{base_id}")
async def base_page(request: Request, base_id: str, viewer: Signed, top: int = DEFAULT_TOP) -> Response:
    context = await _graph(services(request), viewer, base_id, _top(top))
    return render(request, "graph/base.html", {**context, "top_sizes": TOP_SIZES, "top": _top(top)})


@router.get("/{base_id}/live")
async def live(request: Request, base_id: str, viewer: Signed, top: int = DEFAULT_TOP) -> Response:
    """The build's state and the graph alone: what the page polls every 2 s while a build runs."""
    return render(request, "graph/_live.html", await _graph(services(request), viewer, base_id, _top(top)))


UI = UiExtension(
    router,
    nav=(NavEntry("Graph", PREFIX),),
    templates=DOMAIN.templates,
)
