"""Registry entries of the diagnostics domain: handlers by module path (imported when a task runs),
payload models (light: the API checks submissions against them)."""

from typing import Any

from domains.diagnostics.payloads import FailPayload, FlakyPayload, SleepPayload
from tasks_core.registry import TaskSpec

_COMMON: dict[str, Any] = {
    "on_success": "domains.diagnostics.hooks:on_success",
    "on_failure": "domains.diagnostics.hooks:on_failure",
    "diagnostic": True,
}
_SLEEP: dict[str, Any] = {**_COMMON, "payload": SleepPayload, "timeout_seconds": 6 * 3600}

SPECS = (
    # The no-op writes no domain row, so it has no hook to converge one: its whole life is the
    # runtime's own statements (what `dtask bench throughput` measures).
    TaskSpec("diagnostics.noop", "domains.diagnostics.handlers:noop", timeout_seconds=60, diagnostic=True),
    TaskSpec("diagnostics.sleep", "domains.diagnostics.handlers:sleep", **_SLEEP),
    TaskSpec(
        "diagnostics.fail",
        "domains.diagnostics.handlers:fail",
        timeout_seconds=60,
        payload=FailPayload,
        **_COMMON,
    ),
    # The same sleep handler, declared retry-safe: its only effects are writes of its own rows inside
    # owning transactions, stamped with the attempt token (idempotent and fenced), so a lost lease or
    # a worker shutdown sends it back to pending, up to three attempts in all.
    TaskSpec(
        "diagnostics.sleep_retry_safe",
        "domains.diagnostics.handlers:sleep",
        retry_safe=True,
        max_attempts=3,
        **_SLEEP,
    ),
    # Raises RetryableError on its first `fail_times` attempts: the retry path, end to end.
    TaskSpec(
        "diagnostics.flaky",
        "domains.diagnostics.handlers:flaky",
        timeout_seconds=60,
        retry_safe=True,
        max_attempts=5,
        payload=FlakyPayload,
        **_COMMON,
    ),
)
