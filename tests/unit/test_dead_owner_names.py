"""Which attempts a worker may call dead: the pid in ``<node>:<pid>``, only for its own node name,
and only for a node name of this host."""

from __future__ import annotations

import os
import socket

from tasks_core.worker.dead_owners import node_is_local, pid_exists, pid_of, worker_name


def test_the_pid_is_read_only_from_this_node_s_own_names() -> None:
    assert worker_name("w@h", 42) == "w@h:42"
    assert pid_of("w@h:42", "w@h") == 42
    assert pid_of("w@h2:42", "w@h") is None  # another node whose name begins like ours
    assert pid_of("w@h:", "w@h") is None
    assert pid_of("w@h:4x2", "w@h") is None
    assert pid_of("vm", "w@h") is None  # a name recorded without a pid


def test_only_a_node_of_this_host_and_a_process_that_is_gone_count() -> None:
    assert node_is_local(f"worker@{socket.gethostname()}")
    assert not node_is_local("worker@another-host.invalid")
    assert pid_exists(os.getpid())
    assert not pid_exists(2**22 + 12345)  # above any pid_max


def test_a_process_that_exited_unreaped_is_gone() -> None:
    """In a container whose PID 1 reaps nothing, a killed worker's pool children stay zombies:
    they hold no attempt any more, and must not keep their tasks until the lease runs out."""
    import subprocess
    import time

    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not pid_exists(child.pid)  # exited, not reaped yet
    finally:
        child.wait()
