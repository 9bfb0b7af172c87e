"""Bearer API keys from DTASK_API_KEYS (`name:secret` or `name:secret:admin`, comma-separated).

Secrets are compared in constant time and never logged; a task records the key *name* that
submitted it, and a non-admin key sees only its own tasks.

``Guard`` authenticates every non-public request *before* its body is read (an anonymous 32 MiB
body must not cost the api memory or event-loop time), then hands the body to the app as it
arrives, counting it against the route's limit: 413 as soon as it is over, so an over-limit
chunked body never surfaces as a parsing error, and no body is held in memory here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Submissions made by `dtask submit` are owned by this name; no API key may take it.
CLI_OWNER = "cli"
MIN_SECRET_LENGTH = 16


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False

    def owner_filter(self) -> str | None:
        return None if self.admin else self.name


@dataclass(frozen=True)
class _Key:
    name: str
    secret: bytes
    admin: bool


def parse_api_keys(raw: str) -> list[_Key]:
    """Parse DTASK_API_KEYS; refuse anything ambiguous or weak at start-up, with a clear reason."""
    keys: list[_Key] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if (
            len(parts) not in (2, 3)
            or not parts[0]
            or not parts[1]
            or (len(parts) == 3 and parts[2] != "admin")
        ):
            raise ValueError("DTASK_API_KEYS entries must be name:secret or name:secret:admin")
        if parts[0] == CLI_OWNER:
            raise ValueError(f"DTASK_API_KEYS: the name {CLI_OWNER!r} is reserved for `dtask submit`")
        if len(parts[1]) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"DTASK_API_KEYS: the secret of {parts[0]!r} is shorter than {MIN_SECRET_LENGTH} characters"
            )
        keys.append(_Key(parts[0], parts[1].encode(), len(parts) == 3))
    if len({k.name for k in keys}) != len(keys):
        raise ValueError("DTASK_API_KEYS has a duplicate key name")
    if len({k.secret for k in keys}) != len(keys):
        # The same secret under two names would sign in as whichever came last (maybe an admin).
        raise ValueError("DTASK_API_KEYS has two keys with the same secret")
    return keys


class KeyRing:
    def __init__(self, raw: str) -> None:
        self._keys = parse_api_keys(raw)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def authenticate(self, token: str) -> Principal | None:
        supplied = token.encode()
        found: Principal | None = None
        for key in self._keys:  # check every key: the time taken does not say which one matched
            if hmac.compare_digest(key.secret, supplied):
                found = Principal(key.name, key.admin)
        return found

    def fingerprint(self, name: str, salt: bytes) -> tuple[Principal, str] | None:
        """The key named ``name`` and HMAC-SHA256(its secret, ``salt``), or None if there is none.

        Whoever keeps the fingerprint can tell later whether the key still has the same secret
        without keeping the secret (the dashboard's sessions)."""
        for key in self._keys:
            if key.name == name:
                return Principal(key.name, key.admin), hmac.new(key.secret, salt, "sha256").hexdigest()
        return None


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


@dataclass(frozen=True)
class BodyRoute:
    """A route that takes larger bodies than Guard's default: requests of ``method`` whose path
    matches ``path`` (the route's own pattern) may send up to ``max_bytes``. At most ``slots`` of
    them are read at once in this process; a request over that waits up to ``wait_seconds`` for
    a slot, then gets 503 with Retry-After, before any of its body is read."""

    method: str
    path: re.Pattern[str]
    max_bytes: int
    slots: int
    wait_seconds: float


class Guard:
    """ASGI middleware: authenticate first, then pass the body on within a size limit and a
    deadline per read.

    ``public`` paths (health, OpenAPI) skip authentication, ``own_auth`` prefixes (the dashboard,
    /metrics) authenticate in their routes; both still get the body limit. ``routes`` give larger
    limits, and a bound on how many such requests are read at once, to the routes that need them
    (file uploads). The body is never buffered here: the app reads it as it arrives.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyRing,
        limit: int,
        body_timeout: float,
        public: Iterable[str] = (),
        own_auth: Iterable[str] = (),
        routes: Iterable[BodyRoute] = (),
    ) -> None:
        self.app, self.keys, self.limit, self.body_timeout = app, keys, limit, body_timeout
        self.public = frozenset(public)
        self.own_auth = tuple(own_auth)
        # Semaphores bind to the event loop they first wait in: the one serving requests.
        self._routes = [(route, asyncio.Semaphore(route.slots)) for route in routes]

    def _route_for(self, scope: Scope) -> tuple[BodyRoute, asyncio.Semaphore] | None:
        method, path = scope["method"], scope["path"]
        return next(((r, s) for r, s in self._routes if r.method == method and r.path.match(path)), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        found = self._route_for(scope)
        body = _Body(scope, receive, found[0].max_bytes if found else self.limit, self.body_timeout)
        if path not in self.public and not path.startswith(self.own_auth):
            token = bearer_token(scope["headers"])
            principal = self.keys.authenticate(token) if token else None
            if principal is None:
                challenge = [(b"www-authenticate", b"Bearer")]
                await _answer(send, 401, "missing or invalid API key", challenge)
                return
            scope.setdefault("state", {})["principal"] = principal
        if body.declared is not None and body.declared > body.limit:
            await _answer(send, 413, TOO_LARGE)
            return
        if found is None:
            await self.app(scope, body.receive, send)
            return
        route, slots = found
        try:
            await asyncio.wait_for(slots.acquire(), route.wait_seconds)
        except TimeoutError:
            detail = "too many requests like this one at once; try again shortly"
            await _answer(send, 503, detail, [(b"retry-after", str(BUSY_RETRY_AFTER).encode())])
            return
        try:
            await self.app(scope, body.receive, send)
        finally:
            slots.release()


TOO_LARGE = "request body too large"
BUSY_RETRY_AFTER = 5  # seconds


class _Body:
    """One request's body on its way to the app: counted against ``limit`` (413 as soon as it is
    over) and each read given ``timeout`` seconds (408, closing the connection), both raised as
    HTTPException, which the app's handlers answer like any refusal."""

    def __init__(self, scope: Scope, receive: Receive, limit: int, timeout: float) -> None:
        self._receive, self.limit, self.timeout = receive, limit, timeout
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        self.declared = int(length) if length is not None and length.isdigit() else None
        self.done = not self.declared and b"transfer-encoding" not in headers  # no body to come
        self.received = 0

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()  # after the body: the disconnect, whenever it comes
        try:
            message = await asyncio.wait_for(self._receive(), self.timeout)
        except TimeoutError:
            detail = "request body not received in time"
            raise HTTPException(408, detail, headers={"Connection": "close"}) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise HTTPException(413, TOO_LARGE)
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message


async def _answer(
    send: Send, code: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


UNAUTHORIZED = HTTPException(
    status.HTTP_401_UNAUTHORIZED, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"}
)

# Declares the scheme in OpenAPI, so Swagger's "Authorize" button works; Guard did the checking.
_bearer = HTTPBearer(auto_error=False, description="An API key's secret (DTASK_API_KEYS)")


async def principal(
    request: Request, _creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    found: Any = getattr(request.state, "principal", None)
    if not isinstance(found, Principal):
        raise UNAUTHORIZED
    return found
