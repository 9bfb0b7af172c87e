"""What the `dtask` client commands print when the database is not usable: one line naming the
fix, and an exit code per kind of problem (documented in `dtask --help` and the README)."""

from __future__ import annotations

import enum
from collections.abc import Iterator

import asyncpg
from sqlalchemy.engine import make_url

from tasks_core.db import SchemaNotCurrent


class Exit(enum.IntEnum):
    """Exit codes of `dtask` commands (0 is success)."""

    FAILED = 1  # the task ended failed or cancelled (--wait), a setting is missing, or another error
    USAGE = 2  # invalid input: a bad option, id, payload, duration or status
    SCHEMA = 3  # the database schema is not this release's: run `dtask migrate`
    NO_TASK = 4  # no task with that id
    FINISHED = 5  # the task already finished
    DB_UNREACHABLE = 6  # nothing answers at the database's host and port
    DB_MISSING = 7  # the server answers, but the database does not exist
    DB_LOGIN = 8  # the server refused the user or password
    INTERRUPTED = 130  # Ctrl-C


EXIT_HELP = {
    Exit.FAILED: "the task ended failed or cancelled (--wait), a setting is missing, or another error",
    Exit.USAGE: "invalid input (option, id, payload, duration, status)",
    Exit.SCHEMA: "the database schema is not current: run `dtask migrate`",
    Exit.NO_TASK: "no such task",
    Exit.FINISHED: "the task already finished",
    Exit.DB_UNREACHABLE: "cannot reach the database (host, port)",
    Exit.DB_MISSING: "the database does not exist",
    Exit.DB_LOGIN: "the database refused the login",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}


class DatabaseProblem(Exception):
    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what caused it, and the driver error SQLAlchemy wraps (``.orig``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, current.__cause__, current.__context__]


def _where(url: str) -> str:
    parsed = make_url(url)
    return f"{parsed.host or 'localhost'}:{parsed.port or 5432}"


def classify(exc: BaseException, url: str) -> DatabaseProblem | None:
    """The kind of database problem behind ``exc``, or None when it is not one we can name."""
    for cause in _chain(exc):
        if isinstance(cause, DatabaseProblem):
            return cause
        if isinstance(cause, asyncpg.InvalidCatalogNameError):
            name = make_url(url).database
            return DatabaseProblem(
                Exit.DB_MISSING,
                f"database {name!r} does not exist on {_where(url)}: create it "
                f"(createdb {name}) or fix DTASK_DATABASE_URL",
            )
        if isinstance(cause, asyncpg.InvalidAuthorizationSpecificationError):
            return DatabaseProblem(
                Exit.DB_LOGIN,
                f"the database on {_where(url)} refused the login ({cause}): fix the user or password "
                "in DTASK_DATABASE_URL",
            )
        if isinstance(cause, asyncpg.UndefinedTableError):
            return DatabaseProblem(
                Exit.SCHEMA, "the database has no durable-tasks tables: run `dtask migrate`"
            )
        # OSError covers refused connections, unknown hosts (gaierror) and timeouts.
        if isinstance(cause, OSError | asyncpg.CannotConnectNowError):
            reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
            return DatabaseProblem(
                Exit.DB_UNREACHABLE,
                f"cannot reach the database at {_where(url)} ({reason or type(cause).__name__}): "
                "start PostgreSQL or fix DTASK_DATABASE_URL",
            )
    # The server answered, but its schema is not this release's.
    if any(isinstance(cause, SchemaNotCurrent) for cause in _chain(exc)):
        return DatabaseProblem(Exit.SCHEMA, str(exc))
    return None
