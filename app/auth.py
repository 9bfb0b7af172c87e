"""Bearer API keys from DTASK_API_KEYS (`name:secret` or `name:secret:admin`, comma-separated).

Secrets are compared in constant time and never logged; a task records the key *name* that
submitted it, and a non-admin key sees only its own tasks.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request, status


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
        keys.append(_Key(parts[0], parts[1].encode(), len(parts) == 3))
    if len({k.name for k in keys}) != len(keys):
        raise ValueError("DTASK_API_KEYS has a duplicate key name")
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


UNAUTHORIZED = HTTPException(
    status.HTTP_401_UNAUTHORIZED, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"}
)


def principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise UNAUTHORIZED
    found: Principal | None = request.app.state.keys.authenticate(token.strip())
    if found is None:
        raise UNAUTHORIZED
    return found
