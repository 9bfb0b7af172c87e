"""Outages of servers this process owns (embedded PostgreSQL and Redis): pause, resume, crash and
restart. For the fault campaign (`dtask chaos --own-postgres`) and the outage tests; never pointed
at a server the machine runs for others.
"""

from __future__ import annotations

import os
import signal
import time

from tasks_core.devkit.embedded import EmbeddedPostgres
from tasks_core.devkit.processes import signal_tree

_STOP_WAIT = 30.0


def postmaster_pid(pg: EmbeddedPostgres) -> int:
    return int((pg.pgdata / "postmaster.pid").read_text().split()[0])


def pause_postgres(pg: EmbeddedPostgres) -> int:
    """Stop the postmaster and every backend (SIGSTOP): connections stay open, nothing answers."""
    pid = postmaster_pid(pg)
    signal_tree(pid, signal.SIGSTOP)
    return pid


def resume(pid: int) -> None:
    signal_tree(pid, signal.SIGCONT)


def crash_postgres(pg: EmbeddedPostgres) -> None:
    """Immediate shutdown (SIGQUIT, as after a crash: no checkpoint, recovery on the next start)."""
    pid = postmaster_pid(pg)
    os.kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + _STOP_WAIT
    while (pg.pgdata / "postmaster.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pg.stop()  # forget the dead server; start() brings up a new one on the same port


def restart_postgres(pg: EmbeddedPostgres, down_seconds: float) -> float:
    """Crash, stay down ``down_seconds``, start again on the same port; the seconds it was down."""
    started = time.monotonic()
    crash_postgres(pg)
    time.sleep(max(0.0, down_seconds - (time.monotonic() - started)))
    pg.start()
    return time.monotonic() - started
