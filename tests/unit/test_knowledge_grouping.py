"""How an upload's new files are cut into ingest tasks, and the ingest payload's two forms."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from domains.knowledge.grouping import GroupingSettings, group
from domains.knowledge.payloads import MAX_INGEST_FILES, IngestPayload

ID = "0" * 32
OTHER = "1" * 32


def test_a_request_is_spread_over_the_slots_in_order() -> None:
    assert group([10] * 100, 4, 32, 10**9) == [list(range(i, i + 25)) for i in range(0, 100, 25)]
    # Fewer files than slots: a task each.
    assert group([10] * 3, 4, 32, 10**9) == [[0], [1], [2]]
    # Seven files over two slots: four, then three.
    assert group([10] * 7, 2, 32, 10**9) == [[0, 1, 2, 3], [4, 5, 6]]
    assert group([], 4, 32, 10**9) == []


def test_a_task_holds_at_most_its_files_and_bytes() -> None:
    assert [len(g) for g in group([1] * 100, 1, 32, 10**9)] == [32, 32, 32, 4]
    # A file over the byte bound has a task of its own; the others fill tasks up to it.
    assert group([40, 40, 500, 40, 40, 40], 1, 32, 100) == [[0, 1], [2], [3, 4], [5]]
    # One file per task, as before uploads grouped files.
    assert group([1] * 5, 1, 1, 10**9) == [[0], [1], [2], [3], [4]]


def test_the_settings_are_read_from_the_environment_and_refuse_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DTASK_KNOWLEDGE_FILES_PER_TASK", "5")
    monkeypatch.setenv("DTASK_KNOWLEDGE_BYTES_PER_TASK", "1000")
    chosen = GroupingSettings(_env_file=None)  # type: ignore[call-arg]
    assert (chosen.knowledge_files_per_task, chosen.knowledge_bytes_per_task) == (5, 1000)
    for bad in ("0", str(MAX_INGEST_FILES + 1), "many"):
        monkeypatch.setenv("DTASK_KNOWLEDGE_FILES_PER_TASK", bad)
        with pytest.raises(ValidationError):
            GroupingSettings(_env_file=None)  # type: ignore[call-arg]


def test_an_ingest_payload_names_one_file_or_several() -> None:
    assert IngestPayload.model_validate({"file_id": ID}).file_id == ID  # tasks queued before grouping
    assert IngestPayload.model_validate({"file_ids": [ID, OTHER]}).file_ids == [ID, OTHER]
    for bad in (
        {},
        {"file_id": ID, "file_ids": [OTHER]},
        {"file_ids": []},
        {"file_ids": ["x"]},
        {"file_ids": ID},
    ):
        with pytest.raises(ValidationError):
            IngestPayload.model_validate(bad)
