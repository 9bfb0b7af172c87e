"""Registry entry of the graph domain: graph.build, the one retry-safe domain handler."""

from domains.graph.payloads import BuildPayload
from tasks_core.registry import TaskSpec

BUILD = "graph.build"
MAX_ATTEMPTS = 3

SPECS = (
    # Retry-safe by declaration: its only effects are rows of its own build, written in owning
    # transactions that also move the build's checkpoint by compare-and-set, so a batch counts
    # exactly once whichever attempt commits it. After a lost lease or a worker shutdown the task
    # goes back to pending (with backoff) and the next attempt resumes from the checkpoint.
    TaskSpec(
        BUILD,
        "domains.graph.handlers:build",
        timeout_seconds=6 * 3600,
        retry_safe=True,
        max_attempts=MAX_ATTEMPTS,
        payload=BuildPayload,
        on_success="domains.graph.hooks:on_success",
        on_failure="domains.graph.hooks:on_failure",
        internal=True,  # made by POST /graph/{base_id}/build with its build row
    ),
)
