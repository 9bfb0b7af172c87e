"""The ``celery worker`` and ``celery beat`` command lines, built in one place.

``dtask worker``/``dtask beat`` hand these arguments to the Celery app in-process; the development
tooling (dev, bench, chaos, the system tests) runs the same arguments as ``celery -A ... worker``
subprocesses through ``celery_command``. Production code: it imports nothing from the tooling.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

CELERY_APP = "tasks_core.celery_app"


def worker_args(
    *,
    queues: Sequence[str],
    concurrency: int,
    pool: str = "prefork",
    loglevel: str = "INFO",
    node: str,
    events: bool = False,
    neighbours: bool = True,
) -> list[str]:
    """``worker`` and its options. ``events``: send task events (Flower's live view).
    ``neighbours=False``: no mingle or gossip, which only slow a start-up nothing depends on."""
    argv = ["worker", "-Q", ",".join(queues), "-c", str(concurrency), "-P", pool, "-l", loglevel]
    if events:
        argv.append("-E")
    argv += ["-n", node]
    if not neighbours:
        argv += ["--without-mingle", "--without-gossip"]
    return argv


def beat_args(*, schedule: str, loglevel: str = "INFO") -> list[str]:
    return ["beat", "-s", schedule, "-l", loglevel]


def celery_command(args: Sequence[str], *, app: str = CELERY_APP, python: str = sys.executable) -> list[str]:
    """``args`` as a ``celery -A app ...`` subprocess of this interpreter."""
    return [python, "-m", "celery", "-A", app, *args]
