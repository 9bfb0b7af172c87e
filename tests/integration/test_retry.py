"""Transient failures: a retry-safe handler's RetryableError (or a TaskSpec.retry_on exception) puts
the task back to pending with backoff and frees its slot; attempts run out into `failed`."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta
from typing import Any

import pytest

from tasks_core.registry import Registry, TaskSpec
from tasks_core.retry import backoff, longest_wait
from tasks_core.submission import Submitter, TaskIntent
from tasks_core.worker.runtime import run_task
from tests.conftest import make_settings
from tests.integration.repo_helpers import at, attempt_rows, db_now, scalar, task_row


async def _submit(services: Any, task_type: str, payload: dict[str, Any]) -> uuid.UUID:
    submitted = await Submitter(services).submit(TaskIntent(task_type, payload))
    return submitted.task_id


async def _run_when_due(services: Any, task_id: uuid.UUID) -> str:
    """Run the task as a worker would, at the instant its backoff ends (PostgreSQL's clock, pinned)."""
    row = await task_row(services.engine, task_id)
    if row["not_before"] is not None:
        services.repo.now = row["not_before"] + timedelta(milliseconds=1)
    try:
        return (await run_task(services, str(task_id))).status
    finally:
        services.repo.now = None


async def test_a_transient_failure_goes_back_to_pending_with_backoff_and_frees_its_slot(
    services: Any,
) -> None:
    services.settings.worker_run_next = 0
    task_id = await _submit(services, "diagnostics.flaky", {"fail_times": 2})
    before = await db_now(services.engine)

    assert (await run_task(services, str(task_id))).status == "pending"

    row = await task_row(services.engine, task_id)
    assert (row["status"], row["attempt_count"], row["attempt_token"]) == ("pending", 1, None)
    assert row["error"] is None and row["finished_at"] is None
    base = services.settings.retry_backoff_seconds
    # Equal jitter: between half and all of the first backoff.
    assert before + timedelta(seconds=base / 2) <= row["not_before"]
    assert row["not_before"] <= await db_now(services.engine) + timedelta(seconds=base)
    assert "attempt 1 of 5 failed (flaky: RetryableError: attempt 1 fails on purpose)" in row["message"]
    assert await services.repo.claim(task_id, services.registry, capacity=4, lease_seconds=30) == "backoff"
    # The slot went back: nothing holds one.
    assert await scalar(services.engine, "SELECT count(*) FROM task_slots WHERE task_id IS NOT NULL") == 0
    [attempt] = await attempt_rows(services.engine, task_id)
    assert attempt["outcome"] == "retry" and "attempt 1 fails on purpose" in attempt["detail"]

    assert await _run_when_due(services, task_id) == "pending"
    assert await _run_when_due(services, task_id) == "success"
    row = await task_row(services.engine, task_id)
    assert (row["status"], row["attempt_count"], row["result"]) == ("success", 3, {"attempt": 3})
    assert [a["outcome"] for a in await attempt_rows(services.engine, task_id)] == [
        "retry",
        "retry",
        "success",
    ]


async def test_when_the_attempts_run_out_the_task_fails_under_the_errors_code(services: Any) -> None:
    services.settings.worker_run_next = 0
    task_id = await _submit(services, "diagnostics.flaky", {"fail_times": 99})
    outcomes = [await _run_when_due(services, task_id) for _ in range(5)]

    assert outcomes == ["pending"] * 4 + ["failed"]
    row = await task_row(services.engine, task_id)
    assert row["error"]["code"] == "flaky"
    assert row["error"]["message"].endswith("(attempt 5 of 5; no attempt left)")
    assert len(await attempt_rows(services.engine, task_id)) == 5


async def test_a_cancel_requested_while_it_waits_ends_it_cancelled(services: Any) -> None:
    task_id = await _submit(services, "diagnostics.flaky", {"fail_times": 1})
    assert (await run_task(services, str(task_id))).status == "pending"

    assert await services.repo.request_cancel(task_id, services.registry) == "cancelled"
    assert (await task_row(services.engine, task_id))["status"] == "cancelled"


async def test_retry_on_names_the_exceptions_that_are_transient_for_a_type(services: Any) -> None:
    # diagnostics.fail raises RuntimeError: transient for a retry-safe copy that declares it,
    # permanent for the built-in type.
    fail = services.registry.get("diagnostics.fail")
    transient = dataclasses.replace(
        fail, task_type="test.fail_transient", retry_safe=True, max_attempts=2, retry_on=(RuntimeError,)
    )
    services.registry = Registry([*services.registry.specs(), transient])
    services.settings.worker_run_next = 0
    flaky = await _submit(services, "test.fail_transient", {})
    permanent = await _submit(services, "diagnostics.fail", {})

    assert (await run_task(services, str(flaky))).status == "pending"
    assert (await run_task(services, str(permanent))).status == "failed"
    assert (await task_row(services.engine, permanent))["error"]["code"] == "handler_error"
    assert await _run_when_due(services, flaky) == "failed"
    assert (await task_row(services.engine, flaky))["error"]["code"] == "retryable"


async def test_a_retryable_error_of_a_type_that_is_not_retry_safe_fails_it(services: Any) -> None:
    flaky = services.registry.get("diagnostics.flaky")
    once = dataclasses.replace(flaky, task_type="test.flaky_once", retry_safe=False, max_attempts=1)
    services.registry = Registry([*services.registry.specs(), once])
    task_id = await _submit(services, "test.flaky_once", {"fail_times": 1})

    assert (await run_task(services, str(task_id))).status == "failed"
    assert (await task_row(services.engine, task_id))["error"]["code"] == "handler_error"


async def test_an_explicit_delay_replaces_the_backoff(services: Any) -> None:
    spec = TaskSpec(
        "test.rate_limited", "tests.handlers_for_tests:rate_limited", retry_safe=True, max_attempts=3
    )
    services.registry = Registry([*services.registry.specs(), spec])
    task_id = await _submit(services, "test.rate_limited", {"delay": 42})
    before = await db_now(services.engine)

    assert (await run_task(services, str(task_id))).status == "pending"
    not_before = (await task_row(services.engine, task_id))["not_before"]
    assert (
        before + timedelta(seconds=42) <= not_before <= await db_now(services.engine) + timedelta(seconds=42)
    )
    assert (
        await at(services.engine, not_before - timedelta(seconds=1)).claim(
            task_id, services.registry, capacity=4, lease_seconds=30
        )
        == "backoff"
    )


def test_retry_on_is_only_for_retry_safe_types() -> None:
    with pytest.raises(ValueError, match="only retry-safe handlers may declare retry_on"):
        TaskSpec("x.y", "m:f", retry_on=(OSError,))


def test_backoff_doubles_with_equal_jitter_up_to_its_cap() -> None:
    s = make_settings(retry_backoff_seconds=5.0, retry_backoff_max_seconds=60.0)
    assert [backoff(s, n, rng=lambda: 0.0) for n in (1, 2, 3, 4, 5)] == [2.5, 5.0, 10.0, 20.0, 30.0]
    assert [backoff(s, n, rng=lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 40.0, 60.0]
    assert longest_wait(s, 5) == 5 + 10 + 20 + 40
