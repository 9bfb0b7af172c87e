"""The bench's CPU accounting reads the right processes and adds their time up per task."""

from __future__ import annotations

import os
import time

from tasks_core.bench import cpu


def test_a_workers_own_cpu_is_counted_per_task_under_its_kind() -> None:
    before = cpu.snapshot([os.getpid()])
    assert before[os.getpid()][0] == "worker_main"
    start = time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU
        pass
    spent = cpu.ms_per_task(before, cpu.snapshot([os.getpid()]), tasks=3)
    assert set(spent) == {f"cpu_{kind}_ms" for kind in cpu.KINDS}
    assert 80 <= spent["cpu_worker_main_ms"] <= 200  # 300 ms over 3 tasks, at clock-tick granularity
    assert spent["cpu_worker_children_ms"] == 0


def test_the_database_and_broker_processes_are_found() -> None:
    kinds = {kind for kind, _ in cpu.snapshot([]).values()}
    assert "postgres" in kinds  # the PostgreSQL the tests run on


def test_a_process_that_appears_counts_from_zero_and_one_that_left_counts_nothing_more() -> None:
    before = {1: ("postgres", 10.0), 2: ("worker_children", 5.0)}
    after = {1: ("postgres", 10.5), 3: ("worker_children", 0.25)}
    assert cpu.ms_per_task(before, after, tasks=1) == {
        "cpu_worker_main_ms": 0.0, "cpu_worker_children_ms": 250.0, "cpu_postgres_ms": 500.0,
        "cpu_redis_ms": 0.0,
    }
