"""The diagnostics domain's declaration: smoke-test task types and their rows, nothing more."""

from pathlib import Path

from tasks_core.domain import Domain

DOMAIN = Domain(
    name="diagnostics",
    root=Path(__file__).resolve().parent,
    tasks=("domains.diagnostics.tasks",),
    metadata="domains.diagnostics.model",
)
