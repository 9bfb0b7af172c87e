"""`python -m domains.graph.cli`: a base's knowledge graph from a shell, through the HTTP API.

    export DTASK_API_URL=http://127.0.0.1:8000 DTASK_API_KEY=<secret>
    python -m domains.graph.cli build <base_id> --wait     # until the build's task ends
    python -m domains.graph.cli entities <base_id> --limit 20
    python -m domains.graph.cli neighbors <base_id> "Marie Curie"

A client of the API like curl (same keys, same owner rules).
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import httpx
import typer

cli = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Knowledge graphs over the dtask HTTP API."
)
TERMINAL = {"success", "failed", "cancelled"}

Api = Annotated[str, typer.Option(envvar="DTASK_API_URL", help="the API's base URL")]
Key = Annotated[str, typer.Option(envvar="DTASK_API_KEY", help="an API key's secret")]


def _client(api: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _ok(response: httpx.Response, *codes: int) -> Any:
    if response.status_code not in codes:
        typer.echo(
            f"{response.request.method} {response.request.url.path}: {response.status_code} "
            f"{response.text[:500]}",
            err=True,
        )
        raise typer.Exit(1)
    return response.json()


@cli.command()
def build(
    base_id: str,
    wait: Annotated[bool, typer.Option("--wait", help="return when the build's task has ended")] = False,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Build the base's graph (or join the build under way); prints the task id."""
    with _client(api, key) as client:
        ref = _ok(client.post(f"/graph/{base_id}/build"), 202)
        typer.echo(ref["task_id"])
        if ref["deduplicated"]:
            typer.echo("a build of this base was already under way: following it", err=True)
        while wait:
            task = _ok(client.get(f"/tasks/{ref['task_id']}"), 200)
            if task["status"] in TERMINAL:
                detail = task["error"]["message"] if task["error"] else f"{task['result']['chunks']} chunks"
                typer.echo(f"{task['status']}: {detail}", err=True)
                if task["status"] != "success":
                    raise typer.Exit(1)
                break
            time.sleep(1.0)


@cli.command()
def entities(
    base_id: str,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """The most mentioned entities: mentions, chunks, name."""
    with _client(api, key) as client:
        page = _ok(client.get(f"/graph/{base_id}/entities", params={"limit": limit}), 200)
    for e in page["items"]:
        typer.echo(f"{e['mentions']:>7} {e['chunks']:>7}  {e['name']}")


@cli.command()
def neighbors(
    base_id: str,
    entity: str,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """The entities sharing most chunks with ENTITY: weight, name."""
    with _client(api, key) as client:
        body = _ok(client.get(f"/graph/{base_id}/neighbors", params={"entity": entity, "limit": limit}), 200)
    for n in body["neighbors"]:
        typer.echo(f"{n['weight']:>7}  {n['name']}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
