"""Where a round's CPU goes: the worker's main process and its pool children, PostgreSQL, Redis.

Read from /proc before and after the measured stretch, so a ratio between
variants can be explained by who spends the CPU per task, not only stated. PostgreSQL and Redis are
found by process name: every backend and server process on the host counts, so the figures are
only the round's own on a machine where nothing else uses them. A process that exits inside the
stretch (a recycled pool child) counts up to its last reading only, and so does a thread. The time
on CPU is the scheduler's nanosecond count of each of the process's threads
(``/proc/PID/task/TID/schedstat``; the pid's own file covers its main thread only, not a pool
child's event-loop thread), where the kernel has it: user + system time in ``stat`` comes in 10 ms
ticks, too coarse for a quick round of 40 tasks (a backend's few ms read 0).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tasks_core.devkit.processes import process_tree

KINDS = ("worker_main", "worker_children", "postgres", "redis")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
Readings = dict[int, tuple[str, float]]


def _read(pid: int) -> tuple[str, float] | None:
    """(command name, CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    exact = _thread_ns(pid)
    if exact is not None:
        return name, exact / 1e9
    fields = stat.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime, in ticks


def _thread_ns(pid: int) -> int | None:
    """Nanoseconds on CPU of the process's live threads; None where the kernel keeps no schedstat."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended just now
            continue
        except (OSError, IndexError, ValueError):
            return None
    return total


def _all_pids() -> Iterable[int]:
    return (int(e) for e in os.listdir("/proc") if e.isdigit())


def snapshot(worker_pids: Iterable[int]) -> Readings:
    """CPU seconds of the workers' trees (main process first in each tree) and of every
    PostgreSQL and Redis process, by kind."""
    readings: Readings = {}
    for main in worker_pids:
        for pid in process_tree(main):
            got = _read(pid)
            if got is not None:
                readings[pid] = ("worker_main" if pid == main else "worker_children", got[1])
    for pid in _all_pids():
        if pid in readings:
            continue
        got = _read(pid)
        if got is None:
            continue
        if got[0].startswith("postgres"):
            readings[pid] = ("postgres", got[1])
        elif got[0].startswith("redis-server"):
            readings[pid] = ("redis", got[1])
    return readings


def ms_per_task(before: Readings, after: Readings, tasks: int) -> dict[str, float]:
    """CPU milliseconds per task by kind, between two snapshots: ``cpu_<kind>_ms``."""
    spent = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, seconds) in after.items():
        spent[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    return {f"cpu_{kind}_ms": round(1000 * spent[kind] / max(tasks, 1), 3) for kind in KINDS}
