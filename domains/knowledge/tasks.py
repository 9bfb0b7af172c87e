"""Registry entries of the knowledge domain (module paths only: nothing is imported here)."""

from tasks_core.registry import TaskSpec

ON_SUCCESS = "domains.knowledge.hooks:on_success"
ON_FAILURE = "domains.knowledge.hooks:on_failure"

INGEST = "knowledge.ingest"
REINDEX = "knowledge.reindex"

SPECS = (
    # Parse and index one uploaded file. Not retry-safe by declaration: a file whose worker died
    # ends error_indexing and the user reindexes it (its effects are idempotent, so that is safe).
    TaskSpec(
        INGEST,
        "domains.knowledge.handlers:ingest",
        timeout_seconds=3600,
        on_success=ON_SUCCESS,
        on_failure=ON_FAILURE,
    ),
    # One file again ({"file_id"}), or every pending/errored file of a base ({"base_id"}).
    TaskSpec(
        REINDEX,
        "domains.knowledge.handlers:reindex",
        timeout_seconds=6 * 3600,
        on_success=ON_SUCCESS,
        on_failure=ON_FAILURE,
    ),
)
