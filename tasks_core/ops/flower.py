"""`dtask flower`: Celery's dashboard, password-protected, against the same broker as the workers.

Flower can revoke, restart and rate-limit through remote control, and its API shows payloads, so it
never starts without HTTP basic auth unless it is explicitly opened on loopback for development.
"""

from __future__ import annotations

import re

import typer

from tasks_core.settings import Settings, get_settings

LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})

# Flower splits --basic-auth on commas (several users) and compares "user:password" verbatim.
_CREDENTIAL = re.compile(r"[^:,\s]+:[^,]+")


class FlowerConfigError(ValueError):
    """The requested Flower configuration is unsafe or malformed; nothing was started."""


def parse_basic_auth(value: str) -> list[str]:
    """Validate ``user:password`` (or several, comma-separated) and return the credentials."""
    credentials = [part.strip() for part in value.split(",")]
    bad = [c for c in credentials if not _CREDENTIAL.fullmatch(c)]
    if not value.strip() or bad:
        # Never echo the value: it holds a password.
        raise FlowerConfigError(
            "DTASK_FLOWER_BASIC_AUTH must be 'user:password' (several: 'u1:p1,u2:p2'); the user may "
            "not contain ':' or whitespace, the password must be non-empty, and neither may contain ','"
        )
    return credentials


def is_loopback(address: str) -> bool:
    return address.strip().lower() in LOOPBACK_ADDRESSES


def flower_argv(
    settings: Settings, address: str, port: int, *, allow_unauthenticated_local: bool = False
) -> list[str]:
    """The `celery flower` argv for these settings, or FlowerConfigError if it would be unsafe."""
    if not 1 <= port <= 65535:
        raise FlowerConfigError(f"port must be 1-65535, not {port}")
    argv = ["flower", f"--address={address}", f"--port={port}"]
    # Blank counts as unset (compose passes `${VAR:-}` through); set but malformed is always an
    # error, even on loopback, so a typo can never open the dashboard.
    if settings.flower_basic_auth and settings.flower_basic_auth.strip():
        argv.append(f"--basic-auth={','.join(parse_basic_auth(settings.flower_basic_auth))}")
        return argv
    if not allow_unauthenticated_local:
        raise FlowerConfigError(
            "refusing to start Flower without authentication: set DTASK_FLOWER_BASIC_AUTH=user:password "
            "(or, for local development only, pass --insecure-local with --address 127.0.0.1)"
        )
    if not is_loopback(address):
        raise FlowerConfigError(
            f"refusing to start Flower without authentication on {address!r}: --insecure-local only "
            "allows 127.0.0.1/localhost; set DTASK_FLOWER_BASIC_AUTH=user:password to listen elsewhere"
        )
    return argv


def run_flower(
    settings: Settings,
    address: str = "127.0.0.1",
    port: int = 5555,
    *,
    allow_unauthenticated_local: bool = False,
) -> None:
    """Run Flower in this process until it stops (blocks)."""
    argv = flower_argv(settings, address, port, allow_unauthenticated_local=allow_unauthenticated_local)
    broker = settings.require_broker()
    from tasks_core.celery_app import app

    # The broker comes from these settings, not the command line, so its password never shows in argv.
    # Workers already send task events (-E / worker_send_task_events); Flower's default periodic
    # enable_events broadcast stays on so workers started without them still show up.
    app.conf.broker_url = broker
    app.start(argv)


def flower_command(address: str, port: int, insecure_local: bool) -> None:
    """Body of `dtask flower`: print a clear reason and exit 2 instead of starting unsafely."""
    try:
        run_flower(get_settings(), address, port, allow_unauthenticated_local=insecure_local)
    except FlowerConfigError as exc:
        typer.echo(f"dtask flower: {exc}", err=True)
        # SystemExit, not typer.Exit: the same exit status inside the typer app and when called directly.
        raise SystemExit(2) from None
