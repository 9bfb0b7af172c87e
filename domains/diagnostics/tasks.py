"""Registry entries of the diagnostics domain (module paths only: nothing is imported here)."""

from tasks_core.registry import TaskSpec

_HOOKS = {
    "on_success": "domains.diagnostics.hooks:on_success",
    "on_failure": "domains.diagnostics.hooks:on_failure",
}

SPECS = (
    TaskSpec("diagnostics.noop", "domains.diagnostics.handlers:noop", timeout_seconds=60, **_HOOKS),
    TaskSpec("diagnostics.sleep", "domains.diagnostics.handlers:sleep", **_HOOKS),
    TaskSpec("diagnostics.fail", "domains.diagnostics.handlers:fail", timeout_seconds=60, **_HOOKS),
    # The same sleep handler, declared retry-safe: its only effects are writes of its own rows inside
    # owning transactions, stamped with the attempt token (idempotent and fenced), so a lost lease or
    # a worker shutdown sends it back to pending, up to three attempts in all.
    TaskSpec(
        "diagnostics.sleep_retry_safe", "domains.diagnostics.handlers:sleep", retry_safe=True, max_attempts=3,
        **_HOOKS,
    ),
)
