"""Child processes in their own process groups: start, signal, kill, wait, find their members.

One module for the bench, the fault campaign, the outage helpers and the system tests, which all
run real ``celery worker``/``beat``/``dtask api`` processes. Every process is started in its own
session (so its process group id is its pid): one ``killpg`` reaches the pool children too, and a
Ctrl-C meant for the caller never reaches them. Output goes to a log file, input is closed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REAP_SECONDS = 10.0


def spawn(argv: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, stdout and stderr appended to ``log``.

    ``cwd`` should lie outside any checkout, so no developer ``.env`` is read by the child.
    """
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=cwd,
        )


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, ... (None if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is parenthesised and may itself hold spaces or parentheses.
    return stat.rsplit(")", 1)[1].split() or None


def _live_pids() -> list[tuple[int, list[str]]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None and fields[0] != "Z":
                out.append((int(entry), fields))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (a worker and its pool children, a postmaster and its backends)."""
    children: dict[int, list[int]] = {}
    for child, fields in _live_pids():
        children.setdefault(int(fields[1]), []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    return [pid for pid, fields in _live_pids() if int(fields[2]) == pgid]


def in_group(pid: int, pgid: int) -> bool:
    """Whether ``pid`` is alive in process group ``pgid`` (e.g. one of a worker's pool children)."""
    fields = _stat_fields(pid)
    return fields is not None and int(fields[2]) == pgid


def signal_process(pid: int, sig: int) -> None:
    """Signal one process; one that already exited is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def signal_group(pgid: int, sig: int) -> None:
    """Signal a whole process group; one that already exited is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_tree(pid: int, sig: int) -> None:
    """Signal ``pid`` and its descendants, whatever their process groups."""
    for member in process_tree(pid):
        signal_process(member, sig)


def kill_group(popen: subprocess.Popen[bytes], timeout: float = REAP_SECONDS) -> int | None:
    """SIGKILL the group led by ``popen`` and reap its leader; the exit code (None if not reaped).

    SIGCONT first: a group the caller stopped (SIGSTOP) then dies like any other.
    """
    signal_group(popen.pid, signal.SIGCONT)
    signal_group(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return popen.wait(timeout=timeout)
    return None


def log_tail(log: Path, lines: int) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class GroupProcess:
    """A started process leading its own group, with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        """Signal the main process only."""
        signal_process(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Signal the whole process group: the main process and every pool child."""
        signal_group(self.pid, sig)

    def kill_group(self) -> int | None:
        return kill_group(self.popen)

    def wait_exit(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def group_members(self) -> list[int]:
        return group_members(self.pid)

    def owns_pid(self, pid: int) -> bool:
        return in_group(pid, self.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log, lines)
