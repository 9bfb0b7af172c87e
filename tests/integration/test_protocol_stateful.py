"""The real repository held to the protocol model (see protocol_machine.py, docs/protocol).

Seeded and bounded in the default run; ``-m soak`` explores many more and longer histories.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from protocol_machine import machine

BOUNDED = settings(
    max_examples=100,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def test_repository_follows_the_protocol_model(database_url: str) -> None:
    with machine(database_url) as machine_class:
        run_state_machine_as_test(machine_class, settings=BOUNDED)


@pytest.mark.soak
def test_repository_follows_the_protocol_model_long(database_url: str) -> None:
    with machine(database_url) as machine_class:
        run_state_machine_as_test(
            machine_class,
            settings=settings(BOUNDED, max_examples=400, stateful_step_count=80, derandomize=False),
        )
