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
from typing import Annotated

import typer

from domains.api_client import Api, Key, connect, ok

cli = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Knowledge graphs over the dtask HTTP API."
)
TERMINAL = {"success", "failed", "cancelled"}





@cli.command()
def build(
    base_id: str,
    wait: Annotated[bool, typer.Option("--wait", help="return when the build's task has ended")] = False,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Build the base's graph (or join the build under way); prints the task id."""
    with connect(api, key) as client:
        ref = ok(client.post(f"/graph/{base_id}/build"), 202)
        typer.echo(ref["task_id"])
        if ref["deduplicated"]:
            typer.echo("a build of this base was already under way: following it", err=True)
        while wait:
            task = ok(client.get(f"/tasks/{ref['task_id']}"), 200)
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
    with connect(api, key) as client:
        page = ok(client.get(f"/graph/{base_id}/entities", params={"limit": limit}), 200)
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
    with connect(api, key) as client:
        body = ok(client.get(f"/graph/{base_id}/neighbors", params={"entity": entity, "limit": limit}), 200)
    for n in body["neighbors"]:
        typer.echo(f"{n['weight']:>7}  {n['name']}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
