"""Test-only task specs and hooks, named by module path like any domain's (see ``TEST_SPECS``).

Pytest puts this directory on ``sys.path`` when it imports a test module from it, so the registry
imports these hooks by the path ``hooks_for_tests:<name>``, lazily, exactly as it imports a domain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from domains.diagnostics import hooks as diagnostics_hooks
from tasks_core.registry import Registry, TaskSpec

MODULE = __name__


class HookExploded(RuntimeError):
    pass


async def failure_hook(conn: AsyncConnection, task: Mapping[str, Any], status: str) -> None:
    """Converges the diagnostics row like the real hook, but raises for a payload marked ``explode``
    (after writing, so the test also proves the half-done hook is rolled back)."""
    await diagnostics_hooks.on_failure(conn, task, status)
    if (task.get("payload") or {}).get("explode"):
        raise HookExploded(f"failure hook refused task {task['id']}")


def registry_with_test_specs() -> Registry:
    """The diagnostics specs plus test types: a flaky-hook type, a retry-safe type, a capped type."""
    from domains.diagnostics.tasks import SPECS

    return Registry(
        [
            *SPECS,
            TaskSpec(
                "test.flaky_hook",
                "domains.diagnostics.handlers:noop",
                on_success="domains.diagnostics.hooks:on_success",
                on_failure=f"{MODULE}:failure_hook",
            ),
            TaskSpec(
                "test.retry_safe",
                "domains.diagnostics.handlers:noop",
                retry_safe=True,
                max_attempts=2,
                on_success="domains.diagnostics.hooks:on_success",
                on_failure="domains.diagnostics.hooks:on_failure",
            ),
            TaskSpec("test.capped", "domains.diagnostics.handlers:noop", concurrency=1),
        ]
    )
