"""Registry entries of the knowledge domain: handlers and hooks by module path (imported when a task
runs or converges), payload models (light: the API checks submissions against them)."""

from typing import Any

from domains.knowledge.payloads import IngestPayload, ReindexPayload
from tasks_core.registry import DutySpec, TaskSpec

INGEST = "knowledge.ingest"
REINDEX = "knowledge.reindex"
# Attempts in all. With the default backoff (DTASK_RETRY_BACKOFF_SECONDS 5, doubling, capped at
# DTASK_RETRY_BACKOFF_MAX_SECONDS 300) a file waits out a store outage for 5 to 10 minutes before
# it ends error_indexing (tasks_core.retry.longest_wait).
MAX_ATTEMPTS = 8
_COMMON: dict[str, Any] = {
    "on_success": "domains.knowledge.hooks:on_success",
    "on_failure": "domains.knowledge.hooks:on_failure",
    # Retry-safe: every effect is fenced (file moves name the attempt) and idempotent (chunks and
    # vectors are replaced by chunk id), so a lost lease, a worker shutdown or a store that does not
    # answer (the handler raises RetryableError) sends the task back to pending with backoff, and
    # the next attempt starts over the files not yet indexed. A file that cannot be parsed is not
    # retried.
    "retry_safe": True,
    "max_attempts": MAX_ATTEMPTS,
    # Made by the upload and reindex routes with the file rows they work on.
    "internal": True,
}

SPECS = (
    # Parse and index uploaded files: one ({"file_id"}), or several of one upload ({"file_ids"}).
    TaskSpec(
        INGEST, "domains.knowledge.handlers:ingest", timeout_seconds=3600, payload=IngestPayload, **_COMMON
    ),
    # One file again ({"file_id"}), or every pending/errored file of a base ({"base_id"}).
    TaskSpec(
        REINDEX,
        "domains.knowledge.handlers:reindex",
        timeout_seconds=6 * 3600,
        payload=ReindexPayload,
        **_COMMON,
    ),
)

DUTIES = (
    # Chunk rows, vectors and originals agree, or the file is re-queued; leftovers are removed.
    DutySpec("knowledge.verify", "domains.knowledge.verify:duty", every="knowledge_verify_seconds"),
)
