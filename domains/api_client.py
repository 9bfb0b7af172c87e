"""What every domain's shell client (`dtask kb|eval|graph`, or `python -m domains.<name>.cli`)
shares: the API's URL and key as options (or DTASK_API_URL / DTASK_API_KEY), an authenticated
client, and one-line failures with an exit code (2: how it was called; 1: what the API answered or
that it did not)."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import typer

Api = Annotated[str, typer.Option(envvar="DTASK_API_URL", help="the API's base URL")]
Key = Annotated[str, typer.Option(envvar="DTASK_API_KEY", help="an API key's secret")]
WHERE_KEYS_COME_FROM = "pass --key or set DTASK_API_KEY (`dtask dev` writes it to .dtask/env: source it)"


def _fail(line: str, code: int) -> typer.Exit:
    typer.echo(line, err=True)
    return typer.Exit(code)


class _Client(httpx.Client):
    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        try:
            return super().send(request, **kwargs)
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            where = f"cannot reach the API at {self.base_url}"
            raise _fail(f"{where}: {reason} (--api or DTASK_API_URL)", 1) from None


def connect(api: str, key: str, timeout: float = 60) -> httpx.Client:
    if not key:
        raise _fail(f"no API key: {WHERE_KEYS_COME_FROM}", 2)
    if any(c.isspace() or not c.isprintable() for c in key):
        raise _fail("the API key holds spaces or control characters: a secret is one printable word", 2)
    if not api.startswith(("http://", "https://")):
        raise _fail(f"the API URL {api!r} is not http:// or https:// (--api or DTASK_API_URL)", 2)
    return _Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def ok(response: httpx.Response, *codes: int) -> Any:
    """The JSON body (None when empty) if the status is one of ``codes``; else one line and exit 1."""
    if response.status_code not in codes:
        where = f"{response.request.method} {response.request.url.path}: {response.status_code}"
        if response.status_code == 401:
            raise _fail(f"{where}: the API refused the key; {WHERE_KEYS_COME_FROM}", 1)
        raise _fail(f"{where} {' '.join(response.text[:500].split())}", 1)
    return response.json() if response.content else None
