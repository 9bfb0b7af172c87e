"""`python -m domains.knowledge.cli`: knowledge bases from a shell, through the HTTP API.

    export DTASK_API_URL=http://127.0.0.1:8000 DTASK_API_KEY=<secret>
    python -m domains.knowledge.cli create-base handbook
    python -m domains.knowledge.cli upload <base_id> ./docs          # folders are walked
    python -m domains.knowledge.cli files <base_id> --watch           # until nothing is in progress
    python -m domains.knowledge.cli search <base_id> "how do I ..."

It is a client of the API like curl (same keys, same owner rules), so it works against any
deployment the API key reaches.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer

from domains.api_client import Api, Key, connect, ok
from domains.knowledge.parsing import SUPPORTED, file_type_of

if TYPE_CHECKING:
    from domains.knowledge.verify import Report

cli = typer.Typer(no_args_is_help=True, add_completion=False, help="Knowledge bases over the dtask HTTP API.")
IN_PROGRESS = {"uploaded", "parsing", "parsed", "indexing"}





@cli.command("create-base")
def create_base(name: str, api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """Create a base; prints its id."""
    with connect(api, key, timeout=300) as client:
        typer.echo(ok(client.post("/knowledge/bases", json={"name": name}), 201)["id"])


@cli.command()
def bases(api: Api = "http://127.0.0.1:8000", key: Key = "") -> None:
    """Your bases, with their files by status."""
    with connect(api, key, timeout=300) as client:
        for base in ok(client.get("/knowledge/bases"), 200)["items"]:
            counts = ", ".join(f"{n} {s}" for s, n in sorted(base["file_counts"].items())) or "no files"
            typer.echo(f"{base['id']}  {base['name']:<24} {counts}")


def _documents(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """Supported files under the given files and folders, and the ones skipped."""
    found: list[Path] = []
    skipped: list[Path] = []
    for path in paths:
        for candidate in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if candidate.is_file():
                (found if file_type_of(candidate.name) else skipped).append(candidate)
    return found, skipped


@cli.command()
def upload(
    base_id: str,
    paths: Annotated[list[Path], typer.Argument(exists=True, help="files and folders (walked)")],
    batch: Annotated[int, typer.Option(min=1, max=1000, help="files per request")] = 100,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Upload the documents among PATHS (.txt .md .rst .html .pdf .docx .csv .json; other files are
    skipped); each batch is one request (one transaction)."""
    found, skipped = _documents(paths)
    for path in skipped:
        typer.echo(f"skipped (not one of {SUPPORTED}): {path}", err=True)
    kinds: Counter[str] = Counter()
    with connect(api, key, timeout=300) as client:
        for start in range(0, len(found), batch):
            group = found[start : start + batch]
            parts = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in group]
            body = ok(client.post(f"/knowledge/bases/{base_id}/files", files=parts), 202)
            for entry in body["files"]:
                line = f"{entry['id']}  {entry['status']:<13} {entry['filename']}"
                if entry.get("duplicate_of"):
                    kinds["duplicates"] += 1
                    line += f"  (same content as file {entry['duplicate_of']}: not indexed again)"
                elif entry.get("error_message"):
                    kinds["refused"] += 1
                    line += f": {entry['error_message']}"
                else:
                    kinds["new"] += 1
                typer.echo(line)
    summary = ", ".join(f"{kinds[k]} {k}" for k in ("new", "duplicates", "refused") if kinds[k])
    typer.echo(f"uploaded {len(found)} files" + (f": {summary}" if summary else ""), err=True)


def _all_files(client: httpx.Client, base_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = ok(client.get(f"/knowledge/bases/{base_id}/files", params=params), 200)
        items += page["items"]
        cursor = page["next_cursor"]
        if not cursor:
            return items


@cli.command()
def files(
    base_id: str,
    watch: Annotated[bool, typer.Option("--watch", help="repeat until no file is in progress")] = False,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """Files of a base by status (errors with their messages)."""
    with connect(api, key, timeout=300) as client:
        while True:
            items = _all_files(client, base_id)
            counts = Counter(f["status"] for f in items)
            typer.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no files")
            if not watch or not IN_PROGRESS & set(counts):
                break
            time.sleep(1.0)
        for f in items:
            if f["error_message"]:
                typer.echo(f"{f['id']}  {f['status']}  {f['filename']}: {f['error_message']}")


@cli.command()
def search(
    base_id: str,
    query: str,
    top_k: Annotated[int, typer.Option("--top-k", min=1, max=100)] = 5,
    min_score: Annotated[
        float | None, typer.Option("--min-score", min=-1.0, max=1.0, help="leave out hits scoring less")
    ] = None,
    api: Api = "http://127.0.0.1:8000",
    key: Key = "",
) -> None:
    """The passages most similar to QUERY, best first: score, file name, text."""
    body: dict[str, Any] = {"query": query, "top_k": top_k}
    if min_score is not None:
        body["min_score"] = min_score
    with connect(api, key, timeout=300) as client:
        hits = ok(client.post(f"/knowledge/bases/{base_id}/search", json=body), 200)
    for hit in hits["hits"]:
        snippet = " ".join(hit["text"].split())[:160]
        typer.echo(f"{hit['score']:.3f}  {hit['filename']}  {snippet}")


@cli.command()
def verify(
    base_id: Annotated[str | None, typer.Argument(help="one base (default: every base)")] = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="re-queue disagreeing files and remove leftovers")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="the whole report as JSON")] = False,
) -> None:
    """Check that each file's chunk rows, Milvus vectors and S3 original agree (an operator
    command: it reads PostgreSQL, Milvus and S3 with the DTASK_* settings, not the HTTP API).
    Exit 0 when everything agrees or was repaired, 1 when something disagrees."""
    # Imported here: `dtask` loads this module for every command, and these bring the stores' clients.
    from domains.knowledge.errors import StoreError
    from domains.knowledge.verify import verify as run_verify
    from tasks_core.ops.cli import client_services, run_command

    async def go() -> Report:
        async with client_services() as services:
            return await run_verify(services, base_id=base_id, repair=repair)

    try:
        report = run_command(go)
    except StoreError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(report.as_dict(), default=str, indent=2))
    else:
        _print_report(report)
    if not report.agrees and not repair:
        raise typer.Exit(1)


def _print_report(report: Report) -> None:
    for base in report.bases:
        strays = f", {base.stray_vectors} stray vectors, {base.stray_objects} stray objects"
        typer.echo(f"{base.base_id}  {base.files} files, {base.agreeing} agree{strays}")
        for v in base.problems:
            typer.echo(
                f"  {v.file_id}  {v.filename}: {v.problem} (status {v.status}, chunk_count {v.chunk_count}, "
                f"{v.chunk_rows} chunk rows, {v.vectors} vectors, original {'yes' if v.original else 'no'})"
                + (f" -> {v.action}" if v.action else "")
            )
    typer.echo(
        f"{report.stray_collections} collections and {report.stray_prefixes} object prefixes of deleted bases"
        + (" removed" if report.repair and (report.stray_collections or report.stray_prefixes) else "")
    )
    verdict = "repaired" if report.repair else "disagreements found"
    typer.echo("everything agrees" if report.agrees else verdict)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
