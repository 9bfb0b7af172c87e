"""Registry entries of the knowledge domain: handlers and hooks by module path (imported when a task
runs or converges), payload models (light: the API checks submissions against them)."""

from typing import Any

from domains.knowledge.payloads import IngestPayload, ReindexPayload
from tasks_core.registry import TaskSpec

INGEST = "knowledge.ingest"
REINDEX = "knowledge.reindex"
_HOOKS: dict[str, Any] = {
    "on_success": "domains.knowledge.hooks:on_success",
    "on_failure": "domains.knowledge.hooks:on_failure",
}

SPECS = (
    # Parse and index one uploaded file. Not retry-safe by declaration: a file whose worker died
    # ends error_indexing and the user reindexes it (its effects are idempotent, so that is safe).
    TaskSpec(
        INGEST, "domains.knowledge.handlers:ingest", timeout_seconds=3600, payload=IngestPayload, **_HOOKS
    ),
    # One file again ({"file_id"}), or every pending/errored file of a base ({"base_id"}).
    TaskSpec(
        REINDEX,
        "domains.knowledge.handlers:reindex",
        timeout_seconds=6 * 3600,
        payload=ReindexPayload,
        **_HOOKS,
    ),
)
