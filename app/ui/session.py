"""Signing in to the dashboard: sessions kept on the server, in PostgreSQL.

The cookie carries only a random session id; it is Secure, HttpOnly (no script reads it),
SameSite=Strict (no other site's page or link sends it) and scoped to /ui. Each session is a row of
``ui_sessions`` (app/model.py): the id's SHA-256, the key's name, a fingerprint of the key's secret
(an HMAC under the secret of the session id, so the table alone yields neither a cookie nor
anything to test guessed secrets against), the CSRF token and the expiry. Signing out deletes the
row, so a copied cookie is worth nothing afterwards; removing a key from DTASK_API_KEYS or changing
its secret ends its sessions at their next request; a session ends DTASK_UI_SESSION_SECONDS after
its sign-in whatever happens.

PostgreSQL rather than Redis: every api process already shares it and every page reads it anyway,
it keeps sessions through a broker restart (Redis here persists nothing), and expiry is judged by
the clock that judges every other deadline. Expired rows are deleted when presented, and each
sign-in deletes the rest, so the table holds about one lifetime's worth of sign-ins.

Forms that change something carry the session's ``csrf`` token: another site can neither read nor
guess it, and it dies with its session.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Form, Request
from sqlalchemy import delete, func, insert, or_, select
from starlette.responses import Response

from app.auth import Principal
from app.model import ui_sessions
from tasks_core.services import Services

COOKIE = "dtask_ui"
# Sign-in form token (double submit): another site cannot sign a browser in under its own key.
SIGN_IN_COOKIE = "dtask_ui_signin"
COOKIE_PATH = "/ui"
# Session ids are secrets.token_urlsafe(32); anything else is no session, and costs no query.
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")
_FINGERPRINT_SALT = b"dtask-ui-session:"


class SignInRequired(Exception):
    """No valid session: pages redirect to the sign-in page, other requests get 401."""


class UiError(Exception):
    """Answered with the dashboard's error page (never with internals)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Viewer:
    principal: Principal
    csrf: str


def _set(response: Response, name: str, value: str) -> None:
    response.set_cookie(name, value, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict")


def _clear(response: Response, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict")


def _services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def _presented(request: Request) -> str | None:
    """The session id the browser sent, if it looks like one of ours."""
    value = request.cookies.get(COOKIE, "")
    return value if _SESSION_ID.fullmatch(value) else None


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _key_fingerprint(request: Request, name: str, session_id: str) -> tuple[Principal, str] | None:
    found: tuple[Principal, str] | None = request.app.state.keys.fingerprint(
        name, _FINGERPRINT_SALT + session_id.encode()
    )
    return found


async def start_session(request: Request, response: Response, principal: Principal) -> None:
    """A new session for ``principal`` (just authenticated), replacing the browser's previous one."""
    svc = _services(request)
    session_id = secrets.token_urlsafe(32)
    found = _key_fingerprint(request, principal.name, session_id)
    if found is None:  # the key vanished between authentication and now (a reload of the ring)
        raise SignInRequired
    previous = _presented(request)
    async with svc.engine.begin() as conn:
        # Expired sessions nobody presents again go here, so they cannot pile up.
        stale = ui_sessions.c.expires_at <= func.clock_timestamp()
        if previous is not None:
            stale = or_(stale, ui_sessions.c.id_hash == _id_hash(previous))
        await conn.execute(delete(ui_sessions).where(stale))
        await conn.execute(
            insert(ui_sessions).values(
                id_hash=_id_hash(session_id),
                key_name=principal.name,
                key_fingerprint=found[1],
                csrf=secrets.token_hex(32),
                expires_at=func.clock_timestamp() + timedelta(seconds=svc.settings.ui_session_seconds),
            )
        )
    _set(response, COOKIE, session_id)
    _clear(response, SIGN_IN_COOKIE)


async def end_session(request: Request, response: Response) -> None:
    session_id = _presented(request)
    if session_id is not None:
        await _forget(_services(request), _id_hash(session_id))
    _clear(response, COOKIE)


async def _forget(svc: Services, id_hash: str) -> None:
    async with svc.engine.begin() as conn:
        await conn.execute(delete(ui_sessions).where(ui_sessions.c.id_hash == id_hash))


def sign_in_token() -> str:
    return secrets.token_urlsafe(16)


def remember_sign_in_token(response: Response, token: str) -> None:
    _set(response, SIGN_IN_COOKIE, token)


def sign_in_token_ok(request: Request, submitted: str) -> bool:
    expected = request.cookies.get(SIGN_IN_COOKIE, "")
    return bool(expected) and hmac.compare_digest(expected.encode(), submitted.encode("utf-8", "replace"))


def authenticate(request: Request, secret: str) -> Principal | None:
    try:
        found: Principal | None = request.app.state.keys.authenticate(secret)
    except UnicodeEncodeError:  # a lone surrogate is no key
        return None
    return found


async def current_viewer(request: Request) -> Viewer | None:
    """The signed-in viewer, or None; looked up once per request (``request.state.ui_viewer``)."""
    session_id = _presented(request)
    viewer = await _lookup(request, session_id) if session_id is not None else None
    request.state.ui_viewer = viewer
    return viewer


async def _lookup(request: Request, session_id: str) -> Viewer | None:
    svc = _services(request)
    id_hash = _id_hash(session_id)
    live = (ui_sessions.c.expires_at > func.clock_timestamp()).label("live")
    query = select(ui_sessions.c.key_name, ui_sessions.c.key_fingerprint, ui_sessions.c.csrf, live)
    async with svc.engine.connect() as conn:
        row = (await conn.execute(query.where(ui_sessions.c.id_hash == id_hash))).first()
    if row is None:
        return None
    found = _key_fingerprint(request, row.key_name, session_id) if row.live else None
    if found is None or not hmac.compare_digest(found[1], row.key_fingerprint):
        # Expired, or its key was removed or given another secret: it can never be valid again.
        await _forget(svc, id_hash)
        return None
    return Viewer(found[0], row.csrf)


async def signed(request: Request) -> Viewer:
    """Dependency: the signed-in viewer, or SignInRequired."""
    viewer = await current_viewer(request)
    if viewer is None:
        raise SignInRequired
    return viewer


Signed = Annotated[Viewer, Depends(signed)]


async def checked(request: Request, viewer: Signed, csrf: Annotated[str, Form()] = "") -> Viewer:
    """Dependency for forms that change something: a session and its CSRF token, or 403."""
    # Browsers say where a request comes from; a cross-site one is refused whatever it carries.
    cross_site = request.headers.get("sec-fetch-site") in ("cross-site", "same-site")
    if cross_site or not hmac.compare_digest(viewer.csrf.encode(), csrf.encode("utf-8", "replace")):
        raise UiError(
            403, "This form has expired or did not come from this dashboard. Reload the page and try again."
        )
    return viewer


Checked = Annotated[Viewer, Depends(checked)]
