"""Bearer API keys from DTASK_API_KEYS (`name:secret` or `name:secret:admin`, comma-separated).

Secrets are compared in constant time and never logged; a task records the key *name* that
submitted it, and a non-admin key sees only its own tasks.

``Guard`` authenticates every non-public request *before* its body is read (an anonymous 32 MiB
body must not cost the api memory or event-loop time), then reads the body against a size limit
and answers 413 itself, so an over-limit chunked body can never surface as a parsing error.
"""

from __future__ import annotations

import hmac
import json
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


class Guard:
    """ASGI middleware: authenticate first, then read the body within a limit.

    ``public`` paths (health, OpenAPI) skip authentication, ``own_auth`` prefixes (the dashboard,
    /metrics) authenticate in their routes; both still get the body limit. ``path_limits`` gives
    larger limits to path prefixes that need them (file uploads).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyRing,
        limit: int,
        public: Iterable[str] = (),
        own_auth: Iterable[str] = (),
        path_limits: dict[str, int] | None = None,
    ) -> None:
        self.app, self.keys, self.limit = app, keys, limit
        self.public = frozenset(public)
        self.own_auth = tuple(own_auth)
        self.path_limits = sorted((path_limits or {}).items(), key=lambda kv: -len(kv[0]))

    def _limit_for(self, path: str) -> int:
        return next((n for prefix, n in self.path_limits if path.startswith(prefix)), self.limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path not in self.public and not path.startswith(self.own_auth):
            token = bearer_token(scope["headers"])
            found = self.keys.authenticate(token) if token else None
            if found is None:
                await _answer(send, 401, "missing or invalid API key", [(b"www-authenticate", b"Bearer")])
                return
            scope.setdefault("state", {})["principal"] = found
        limit = self._limit_for(path)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, 413, "request body too large")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _answer(send, 413, "request body too large")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as servers do

        await self.app(scope, replay, send)


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
