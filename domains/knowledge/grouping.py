"""How an upload hands its new files to `knowledge.ingest` tasks: small files of one request share one.

Each task costs a claim, a terminal transaction, a broker message and a handler start-up, and its
files' moves are made together: one small file per task spent about 37 ms of worker CPU and seven
PostgreSQL transactions, while 25 per task share five transactions and one Milvus write
(`dtask bench knowledge-ingest --base-size`, docs/benchmarks.md). Files keep their request's order;
a request of n files is spread over at least min(n, slots) tasks (slots: what its owner may run at
once), so its files still fill the capacity; a task holds at most ``files_per_task`` files and
``bytes_per_task`` bytes of originals (a file that large has a task of its own). With
``DTASK_KNOWLEDGE_FILES_PER_TASK=1`` every file gets its own task, as before uploads grouped files.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from domains.knowledge.payloads import MAX_INGEST_FILES


class GroupingSettings(BaseSettings):
    """Read for each upload request (a few milliseconds, once per request, not per file)."""

    model_config = SettingsConfigDict(env_prefix="DTASK_", env_file=".env", extra="ignore")

    # Files of one request one ingest task may hold. 1: a task per file (finest cancel and
    # progress, about twice the CPU per small file).
    knowledge_files_per_task: int = Field(default=32, ge=1, le=MAX_INGEST_FILES)
    # Bytes of originals one ingest task may hold: bounds what one attempt reads, parses and
    # retries; a file over it gets a task of its own.
    knowledge_bytes_per_task: int = Field(default=8 * 1024 * 1024, ge=1)


def group(sizes: Sequence[int], slots: int, max_files: int, max_bytes: int) -> list[list[int]]:
    """The positions of the files (by their ``sizes``), in order, cut into tasks' groups."""
    if not sizes:
        return []
    per_task = max(1, min(max_files, -(-len(sizes) // max(1, slots))))
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i, size in enumerate(sizes):
        if current and (len(current) >= per_task or held + size > max_bytes):
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += size
    groups.append(current)
    return groups
