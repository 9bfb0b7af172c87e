"""The knowledge domain's own counters: recorded like the runtime's (tasks_core.metrics, summed in
Redis across processes) and rendered at /metrics through ``Domain.metrics``. This module imports
nothing else, so the api can render them without loading a model client."""

from __future__ import annotations

from tasks_core.metrics import Counter

# One per retried embedding request; reason: the HTTP status (408, 429, 5xx), "timeout" or
# "connection". A steady rate means the model server is overloaded or flapping.
EMBEDDING_RETRIES = Counter(
    "dtask_embedding_retries",
    "Embedding requests retried, by reason (HTTP status, timeout, connection)",
    ("reason",),
)
# Embedding calls that gave up: "unavailable" (retried past DTASK_EMBEDDING_RETRY_SECONDS; the task
# waits and tries again) or "rejected" (a permanent answer: the file ends error_indexing).
EMBEDDING_FAILURES = Counter(
    "dtask_embedding_failures", "Embedding calls that gave up, by kind (unavailable, rejected)", ("kind",)
)
