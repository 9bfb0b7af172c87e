"""Which database failures are worth a retry on a fresh connection (db.is_transient)."""

from __future__ import annotations

import asyncpg
import pytest

from tasks_core.db import is_transient


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("reset by peer"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        # a terminated backend's notice that reached an idle connection: the next query finds the
        # protocol out of step (seen in test_claim's terminated-backend test)
        asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress"),
    ],
)
def test_connection_level_failures_are_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.UniqueViolationError("duplicate key value violates unique constraint"),
        asyncpg.UndefinedColumnError('column "nope" does not exist'),
        ValueError("a bug of ours"),
    ],
)
def test_statements_that_would_fail_again_are_not(exc: BaseException) -> None:
    assert not is_transient(exc)
