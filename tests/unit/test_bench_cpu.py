"""The bench's CPU accounting reads the right processes and adds their time up per task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tasks_core.devkit.bench import cpu


def test_a_workers_own_cpu_is_counted_per_task_under_its_kind() -> None:
    before = cpu.snapshot([os.getpid()])
    assert before[os.getpid()][0] == "worker_main"
    start = time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU
        pass
    spent = cpu.ms_per_task(before, cpu.snapshot([os.getpid()]), tasks=3)
    assert set(spent) == {f"cpu_{kind}_ms" for kind in cpu.KINDS}
    assert 80 <= spent["cpu_worker_main_ms"] <= 200  # 300 ms over 3 tasks


def test_every_thread_of_a_process_counts() -> None:
    # A pool child runs its tasks on an event-loop thread, not on its main thread.
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        spun.set()
        done.wait(30)  # alive while measured, as a pool child's loop thread is

    before = cpu.snapshot([os.getpid()])
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(30)
        spent = cpu.ms_per_task(before, cpu.snapshot([os.getpid()]), tasks=1)["cpu_worker_main_ms"]
    finally:
        done.set()
        thread.join()
    assert 190 <= spent <= 400, spent


def test_a_few_milliseconds_of_cpu_are_not_rounded_to_a_clock_tick() -> None:
    # A quick bench round's PostgreSQL backends each spend a few ms: in 10 ms ticks that read 0.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()\n"
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.004: pass\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # the interpreter has started and waits
        before = cpu.snapshot([child.pid])
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.3)  # spins 4 ms, then waits again
        spent = cpu.ms_per_task(before, cpu.snapshot([child.pid]), tasks=1)["cpu_worker_main_ms"]
        assert 3.5 <= spent <= 9.5, spent
    finally:
        child.kill()
        child.wait()


def test_a_pool_childs_cpu_counts_as_the_workers_children() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(60)"
    # A "worker" whose one pool child spends 0.3 s of CPU, then idles.
    worker = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spin!r}]); " \
        "time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
    try:
        before = cpu.snapshot([parent.pid])
        deadline = time.monotonic() + 30
        while True:
            after = cpu.snapshot([parent.pid])
            children = cpu.ms_per_task(before, after, tasks=1)["cpu_worker_children_ms"]
            if children >= 290 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert 290 <= children <= 400, children
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


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
