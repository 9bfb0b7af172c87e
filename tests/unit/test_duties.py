"""Domain duties: declared beside a domain's task specs, scheduled by beat on the duties queue, run
by name; a name no domain declared runs nothing."""

from __future__ import annotations

import pytest

from tasks_core.registry import DutySpec, Registry, default_registry


def test_the_knowledge_verifier_is_a_duty_beat_schedules_on_the_duties_queue() -> None:
    import celeryconfig

    entry = celeryconfig.beat_schedule["duty-knowledge.verify"]
    assert entry["task"] == "dtask.duty" and entry["args"] == ("knowledge.verify",)
    assert entry["options"]["queue"] == "duties"
    assert entry["schedule"] == entry["options"]["expires"] == 600.0  # DTASK_KNOWLEDGE_VERIFY_SECONDS
    assert celeryconfig.task_routes["dtask.duty"] == {"queue": "duties"}


def test_a_duty_is_found_by_name_and_an_unknown_name_finds_nothing() -> None:
    registry = default_registry()
    from domains.knowledge.verify import duty

    assert registry.duty("knowledge.verify") is duty
    assert registry.duty("nope") is None


def test_a_duty_name_is_registered_once() -> None:
    twice = [DutySpec("x.y", "m:f", every="knowledge_verify_seconds")] * 2
    with pytest.raises(ValueError, match="registered twice"):
        Registry([], twice)
