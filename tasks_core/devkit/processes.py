"""Child processes in their own process groups: start, signal, kill, wait, find their members;
the loopback ports they listen on and the log files they write.

One module for the embedded servers, the cluster harness (bench, fault campaign, system tests), the
outage helpers and `dtask dev`, which all run real servers and ``celery worker``/``beat``/``dtask
api`` processes. Every process is started in its own session (so its process group id is its pid):
one ``killpg`` reaches the pool children too, and a Ctrl-C meant for the caller never reaches them.
Output goes to a log file, input is closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REAP_SECONDS = 10.0
LOOPBACK = "127.0.0.1"
# An automatically chosen port can be taken between free_port() and the server's bind.
PORT_ATTEMPTS = 5


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None, log: Path, cwd: Path | None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, stdout and stderr appended to ``log`` (``env`` None: this
    process's environment).

    ``cwd`` should lie outside any checkout, so no developer ``.env`` is read by the child.
    """
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv), env=None if env is None else dict(env), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
        )


def terminate(proc: subprocess.Popen[bytes], *steps: tuple[signal.Signals, float]) -> None:
    """Send each (signal, grace seconds) in turn until the process exits; SIGKILL as a last resort.
    Then clear what is left of its process group (the backends of a postmaster that crashed): the
    process leads a session of its own, so its group holds nothing else."""
    try:
        for sig, timeout in steps:
            if proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                log.warning("pid %s ignored %s for %.0fs", proc.pid, sig.name, timeout)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    finally:
        signal_group(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------- ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller must tolerate a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: a port whose old connections linger in TIME_WAIT is still usable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def tcp_connects(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts a TCP connection on ``host:port`` within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


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


# --------------------------------------------------------------------------------------------- logs


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def log_since(path: Path, offset: int = 0, lines: int = 30) -> str:
    """The last ``lines`` lines written after byte ``offset`` (a log appended to across runs)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def log_tail(log: Path, lines: int) -> str:
    return log_since(log, 0, lines)


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
