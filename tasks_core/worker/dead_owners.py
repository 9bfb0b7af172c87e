"""Early expiry of the attempts of a worker process that is known to be dead.

Every attempt records the process that claimed it as ``<node>:<pid>`` (``worker_name``). A worker's
main process knows two deaths for certain, on its own host:

- a prefork pool child that exited (billiard reaps it and tells the pool, which calls
  ``on_process_down`` before it starts a replacement): the attempts named ``<node>:<that pid>``;
- at start-up, the earlier processes under its own node name (a SIGKILLed worker restarted, a dense
  or solo worker whose one process ran its tasks): attempts named ``<node>:<pid>`` whose pid no
  longer exists on this host. A pool child of the old worker that is still alive keeps its tasks.

Their leases end now, by their tokens (``TaskStore.expire_attempts``), so the reconciler's next pass
moves their tasks on: a retry-safe one back to pending with backoff, any other to failed
``lease_expired`` with its failure hook, exactly as a lapsed lease. Each look is one short blocking
round trip with a deadline; if it fails, the lease still bounds the recovery.

A node name must therefore name one running worker at a time, as Celery requires for remote control.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable

from tasks_core.db import make_engine
from tasks_core.store.facade import TaskStore

log = logging.getLogger(__name__)

# One look's deadline: it runs in the worker's main process, whose event loop waits meanwhile.
DEADLINE_SECONDS = 3.0


def worker_name(node: str, pid: int) -> str:
    """How an attempt names the process that claimed it."""
    return f"{node}:{pid}"


def pid_of(name: str, node: str) -> int | None:
    """The pid in an attempt's worker name of this node (None for anything else)."""
    prefix = f"{node}:"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


def pid_exists(pid: int) -> bool:
    """Whether a process runs under ``pid``. One that exited but is not reaped yet (a zombie: what
    a killed worker's pool children stay in a container whose PID 1 reaps nothing) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone meanwhile, unless there is no /proc at all
    except OSError:
        return True
    # "<pid> (<command>) <state> ...": the command may hold spaces and parentheses.
    return fields[fields.rfind(b")") + 2 : fields.rfind(b")") + 3] != b"Z"


def node_is_local(node: str) -> bool:
    """Whether the node name names this host (``name@host``): only here are its pids meaningful."""
    return node.rpartition("@")[2] in {socket.gethostname(), os.uname().nodename}


async def expire_dead(store: TaskStore, node: str, dead: Callable[[int], bool]) -> list[uuid.UUID]:
    """Expire the running attempts of ``node``'s processes whose pid ``dead`` says is gone; the
    ids of the tasks whose lease ended."""
    attempts = await store.running_attempts_of(node)
    tokens = [token for name, token in attempts if (pid := pid_of(name, node)) is not None and dead(pid)]
    return await store.expire_attempts(tokens)


def expire_dead_blocking(
    database_url: str, node: str, dead: Callable[[int], bool], *, why: str
) -> list[uuid.UUID]:
    """``expire_dead`` for a process with no event loop of its own (a worker's main process), on a
    connection of its own, within DEADLINE_SECONDS; a failure is logged, never raised."""

    async def look() -> list[uuid.UUID]:
        engine = make_engine(
            database_url, pool_size=1, max_overflow=0, connect_seconds=DEADLINE_SECONDS,
            statement_seconds=DEADLINE_SECONDS,
        )
        try:
            async with asyncio.timeout(DEADLINE_SECONDS):
                return await expire_dead(TaskStore(engine), node, dead)
        finally:
            await engine.dispose()

    try:
        expired = asyncio.run(look())
    except Exception as exc:
        log.warning("%s: could not expire the dead process's attempts (%s); their leases will", why, exc)
        return []
    if expired:
        log.warning("%s: expired %d attempt(s) at once: %s", why, len(expired), ", ".join(map(str, expired)))
    return expired
