"""Signing in to the dashboard: the API key lives in a cookie, CSRF tokens are derived from it.

The cookie holds a random session nonce and the key's secret; it is Secure, HttpOnly (no script
reads it), SameSite=Strict (no other site's page or link sends it) and scoped to /ui. Nothing is
kept on the server, so any number of api processes serve the same sessions, and removing a key
from DTASK_API_KEYS signs its sessions out at once.

Forms that change something carry ``csrf`` = HMAC(secret, nonce): another site can neither read
it nor compute it, and a new sign-in (new nonce) invalidates the old forms.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Form, Request
from starlette.responses import Response

from app.auth import Principal

COOKIE = "dtask_ui"
# Sign-in form token (double submit): another site cannot sign a browser in under its own key.
SIGN_IN_COOKIE = "dtask_ui_signin"
COOKIE_PATH = "/ui"


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


def start_session(response: Response, secret: str) -> None:
    raw = f"{secrets.token_urlsafe(16)}:{secret}".encode()
    _set(response, COOKIE, base64.urlsafe_b64encode(raw).decode())
    response.delete_cookie(SIGN_IN_COOKIE, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict")


def end_session(response: Response) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict")


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


def current_viewer(request: Request) -> Viewer | None:
    raw = request.cookies.get(COOKIE)
    if not raw:
        return None
    try:
        nonce, _, secret = base64.urlsafe_b64decode(raw.encode()).decode().partition(":")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    found = authenticate(request, secret) if nonce and secret else None
    if found is None:
        return None
    csrf = hmac.new(secret.encode(), f"dtask-ui-csrf:{nonce}".encode(), hashlib.sha256).hexdigest()
    return Viewer(found, csrf)


async def signed(request: Request) -> Viewer:
    """Dependency: the signed-in viewer, or SignInRequired."""
    viewer = current_viewer(request)
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
