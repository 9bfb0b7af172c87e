"""Task types only the system tests' workers register (through DTASK_EXTRA_TASK_MODULES)."""

from tasks_core.registry import TaskSpec

SPECS = (
    # diagnostics.sleep declared retry-safe: its only effects are fenced writes of its own rows.
    TaskSpec(
        "system.retry_safe_sleep", "domains.diagnostics.handlers:sleep", retry_safe=True, max_attempts=2,
        on_success="domains.diagnostics.hooks:on_success", on_failure="domains.diagnostics.hooks:on_failure",
    ),
)
SPECS = (
    *SPECS,
    # A handler that catches its own cancellation and carries on (tests.handlers_for_tests).
    TaskSpec("system.swallow_cancel", "tests.handlers_for_tests:swallow_cancel"),
)
SPECS = (
    *SPECS,
    # A handler that blocks the event loop (time.sleep), for the dense mode's watchdog.
    TaskSpec("system.block_loop", "tests.handlers_for_tests:block_loop"),
)
