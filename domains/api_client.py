"""What every domain's shell client (`python -m domains.<name>.cli`) shares: the API's URL and key
as options (or DTASK_API_URL / DTASK_API_KEY), an authenticated client, and one-line failures."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import typer

Api = Annotated[str, typer.Option(envvar="DTASK_API_URL", help="the API's base URL")]
Key = Annotated[str, typer.Option(envvar="DTASK_API_KEY", help="an API key's secret")]


def connect(api: str, key: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def ok(response: httpx.Response, *codes: int) -> Any:
    """The JSON body (None when empty) if the status is one of ``codes``; else one line and exit 1."""
    if response.status_code not in codes:
        typer.echo(
            f"{response.request.method} {response.request.url.path}: {response.status_code} "
            f"{response.text[:500]}",
            err=True,
        )
        raise typer.Exit(1)
    return response.json() if response.content else None
