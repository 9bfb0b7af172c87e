"""tasks_core.devkit.processes on real processes: a shell that forks a child into its own group."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from tasks_core.devkit.processes import GroupProcess, group_members, in_group, process_tree, spawn

# A parent that starts one child (same process group), says both pids, and waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('child', child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _start(tmp_path: Path) -> tuple[GroupProcess, int]:
    log = tmp_path / "parent.log"
    proc = GroupProcess("parent", spawn([sys.executable, "-c", PARENT], env={}, log=log, cwd=tmp_path), log)
    deadline = time.monotonic() + 20
    while "child" not in proc.log_text():
        assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.02)
    return proc, int(proc.log_text().split()[1])


def test_group_kill_reaches_the_children(tmp_path: Path) -> None:
    proc, child = _start(tmp_path)
    try:
        assert proc.pid != child
        assert sorted(proc.group_members()) == sorted([proc.pid, child])
        assert process_tree(proc.pid) == [proc.pid, child]
        assert proc.owns_pid(child) and in_group(child, proc.pid)
        assert not in_group(child, child)  # the child is in its parent's group, not its own
        assert proc.kill_group() == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while group_members(proc.pid):  # the orphaned child is reaped by init, not by us
            assert time.monotonic() < deadline, group_members(proc.pid)
            time.sleep(0.02)
        assert not proc.alive()
    finally:
        proc.kill_group()


def test_send_reaches_the_main_process_only(tmp_path: Path) -> None:
    proc, child = _start(tmp_path)
    try:
        proc.send(signal.SIGTERM)
        assert proc.wait_exit(10) == -signal.SIGTERM
        assert child in group_members(proc.pid)  # its child still runs, in the same group
        proc.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group_members(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send(signal.SIGTERM)  # gone already: not an error
        proc.signal_group(signal.SIGTERM)
    finally:
        proc.kill_group()


def test_a_stopped_group_is_killed(tmp_path: Path) -> None:
    proc, _child = _start(tmp_path)
    proc.signal_group(signal.SIGSTOP)
    assert proc.kill_group() == -signal.SIGKILL
