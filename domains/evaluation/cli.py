"""`python -m domains.evaluation.cli`: evaluation datasets and runs from a shell, through the HTTP API.

    export DTASK_API_URL=http://127.0.0.1:8000 DTASK_API_KEY=<secret>
    python -m domains.evaluation.cli generate <base_id> 200      # prints the dataset id
    python -m domains.evaluation.cli dataset <dataset_id> --watch # until it is no longer generating
    python -m domains.evaluation.cli resume <dataset_id>
    python -m domains.evaluation.cli run <dataset_id> <base_id> --top-k 5 --watch

A client of the API like curl (same keys, same owner rules).
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import typer

from domains.api_client import Api, Key, connect, ok

cli = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Evaluation datasets and runs over the dtask API."
)

Watch = Annotated[bool, typer.Option("--watch", help="repeat until it has ended")]




def _dataset_line(d: dict[str, Any]) -> str:
    line = f"{d['id']}  {d['status']:<10} {d['item_count']} of {d['target']} items  task {d['task_id']}"
    return line + (f"\n  {d['error_message']}" if d["error_message"] else "")


def _run_line(r: dict[str, Any]) -> str:
    p = r["progress"]
    line = f"{r['id']}  {r['status']:<9} {p['done']} of {p['total']} items  top_k {r['top_k']}"
    if r["metrics"]:
        m = r["metrics"]
        k = m["top_k"]
        line += f"\n  hit@{k} {m['hit_rate']:.4f}  recall@{k} {m['recall']:.4f}  MRR {m['mrr']:.4f}"
    return line + (f"\n  {r['error_message']}" if r["error_message"] else "")


@cli.command()
def generate(base_id: str, size: int, api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """Create a dataset of SIZE items drawn from the base (an evaluation.generate_dataset task)."""
    with connect(api, key) as client:
        body = ok(client.post("/evaluation/datasets", json={"base_id": base_id, "size": size}), 202)
    typer.echo(body["id"])
    typer.echo(f"task {body['task_id']}", err=True)


@cli.command()
def dataset(dataset_id: str, watch: Watch = False, api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """A dataset's status and item count (`--watch`: until it is no longer generating)."""
    with connect(api, key) as client:
        while True:
            d = ok(client.get(f"/evaluation/datasets/{dataset_id}"), 200)
            typer.echo(_dataset_line(d))
            if not watch or d["status"] != "generating":
                break
            time.sleep(1.0)


@cli.command()
def resume(dataset_id: str, api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """Continue a failed or cancelled dataset from its persisted items; prints the new task id."""
    with connect(api, key) as client:
        typer.echo(ok(client.post(f"/evaluation/datasets/{dataset_id}/resume"), 202)["task_id"])


@cli.command()
def run(
    dataset_id: str,
    base_id: str,
    top_k: Annotated[int, typer.Option("--top-k", min=1, max=100)] = 5,
    watch: Watch = False,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Evaluate retrieval on the base with the dataset's questions; prints the run id (and, with
    `--watch`, its metrics once it ends)."""
    with connect(api, key) as client:
        body = ok(
            client.post(
                "/evaluation/runs", json={"dataset_id": dataset_id, "base_id": base_id, "top_k": top_k}
            ),
            202,
        )
        typer.echo(body["id"])
        while watch:
            r = ok(client.get(f"/evaluation/runs/{body['id']}"), 200)
            if r["status"] != "running":
                typer.echo(_run_line(r))
                break
            time.sleep(1.0)


@cli.command("show-run")
def show_run(run_id: str, api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """A run's status, progress and metrics."""
    with connect(api, key) as client:
        typer.echo(_run_line(ok(client.get(f"/evaluation/runs/{run_id}"), 200)))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
