"""A small supervisor for `dtask dev`: starts children in order, restarts one that crashes (with
backoff), and stops them all, in reverse order, on SIGINT, SIGTERM or SIGHUP.

A child is anything with ``start``/``exit_reason``/``ready``/``stop``: a process such as the
worker (``ProcessChild``) or an embedded server object (``ServerChild``). Adding a server to the
stack is one more child.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Protocol

from tasks_core.devkit.embedded import describe_exit
from tasks_core.devkit.processes import log_size, spawn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Child(Protocol):
    name: str
    # Children stop tier by tier, highest first, and in parallel within a tier: the processes (1)
    # before the servers they use (0).
    tier: int

    def start(self) -> None: ...
    def exit_reason(self) -> str | None: ...  # None while it runs
    def ready(self) -> bool: ...  # health-checked: it answers
    def stop(self) -> None: ...  # bounded, idempotent, and clears what a crash left behind


class StopRequested(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ChildFailed(Exception):
    def __init__(self, child: Child, reason: str) -> None:
        super().__init__(f"{child.name} {reason}")
        self.child = child


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff doubles from ``first_delay`` up to ``max_delay``; ``max_crashes`` crashes of one
    child within ``window`` seconds stop the stack (something is wrong that a restart won't fix)."""

    max_crashes: int = 5
    window: float = 60.0
    first_delay: float = 1.0
    max_delay: float = 16.0

    def delay(self, crashes: int) -> float:
        return float(min(self.first_delay * 2 ** (crashes - 1), self.max_delay))


def _say(line: str) -> None:
    print(f"dtask dev: {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(
        self,
        policy: RestartPolicy | None = None,
        *,
        say: Callable[[str], None] = _say,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll_seconds: float = 0.2,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self._say, self._clock, self._sleep, self._poll = say, clock, sleep, poll_seconds
        self._crashes: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._restart_at: dict[str, float] = {}
        self._down_since: dict[str, float] = {}
        self._stopping = False

    # ------------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        """SIGINT, SIGTERM and SIGHUP all mean "stop everything": they only set a flag that every
        wait below checks, so no half-made child or half-stopped server is abandoned mid-call."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        elif self._stopping:
            self._say("still stopping; every child has a bounded grace period")

    def check_stop(self) -> None:
        if self.stop_signal is not None:
            raise StopRequested(self.stop_signal)

    # ------------------------------------------------------------------ starting

    def start(self, child: Child) -> None:
        self.check_stop()
        self.children.append(child)
        child.start()

    def wait_ready(self, children: Iterable[Child], timeout: float) -> None:
        """Until every child answers its health check; ChildFailed names one that exits or stays silent."""
        pending = list(children)
        deadline = self._clock() + timeout
        while pending:
            self.check_stop()
            for child in list(pending):
                reason = child.exit_reason()
                if reason is not None:
                    raise ChildFailed(child, f"{reason} before it was ready")
                if child.ready():
                    pending.remove(child)
            if pending and self._clock() > deadline:
                raise ChildFailed(pending[0], f"was not ready after {timeout:g} s")
            if pending:
                self._sleep(self._poll)

    # ------------------------------------------------------------------ supervising

    def run(self) -> int:
        """Supervise until a stop signal (0) or a child that keeps crashing (1)."""
        while self.stop_signal is None:
            for child in self.children:
                if not self._tend(child):
                    return 1
            self._sleep(self._poll)
        return 0

    def _tend(self, child: Child) -> bool:
        """Look after one child; False when it crashed too often."""
        now = self._clock()
        if child.name in self._restart_at:
            if now >= self._restart_at[child.name]:
                del self._restart_at[child.name]
                self._restart(child)
            return True
        reason = child.exit_reason()
        if reason is None:
            down_since = self._down_since.get(child.name)
            if down_since is not None and child.ready():
                del self._down_since[child.name]
                self._say(f"{child.name} is back ({now - down_since:.1f} s after it went down)")
            return True
        return self._crashed(child, reason, now)

    def _crashed(self, child: Child, reason: str, now: float) -> bool:
        crashes = self._crashes[child.name]
        crashes.append(now)
        while crashes and crashes[0] < now - self.policy.window:
            crashes.popleft()
        limit = f"{self.policy.max_crashes} crashes within {self.policy.window:g} s stop the stack"
        if len(crashes) >= self.policy.max_crashes:
            self._say(f"{child.name} {reason}; {limit}: stopping")
            return False
        delay = self.policy.delay(len(crashes))
        self._say(f"{child.name} {reason}; restarting it in {delay:g} s (crash {len(crashes)}; {limit})")
        self._restart_at[child.name] = now + delay
        self._down_since.setdefault(child.name, now)
        return True

    def _restart(self, child: Child) -> None:
        try:
            child.stop()  # clears what the crash left: pool children, a stale lock file
            child.start()
        except Exception as exc:  # noticed as another crash at the next look
            self._say(f"{child.name} did not start: {exc}")

    # ------------------------------------------------------------------ stopping

    def stop_all(self) -> None:
        """Stop every child: the highest tier first, each tier in parallel. Signals arriving now
        are noted, never raised, so nothing interrupts the shutdown itself."""
        self._stopping = True
        tiers = sorted({c.tier for c in self.children}, reverse=True)
        for tier in tiers:
            members = [c for c in reversed(self.children) if c.tier == tier]
            with ThreadPoolExecutor(max_workers=len(members)) as pool:
                list(pool.map(self._stop_one, members))
        self.children.clear()

    def _stop_one(self, child: Child) -> None:
        try:
            child.stop()
        except Exception as exc:
            self._say(f"stopping {child.name} failed: {exc}")


class ProcessChild:
    """A command run in a session of its own (a terminal's Ctrl-C reaches only `dtask dev`, which
    stops the children in order), its output appended to ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        ready: Callable[[ProcessChild], bool],
        stop_timeout: float = 15.0,
        tier: int = 1,
    ) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.tier = tier
        self.stop_timeout = stop_timeout
        self._ready = ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = log_size(self.log_path)
        self.proc = spawn(self.argv, env=self.env, log=self.log_path, cwd=None)

    def exit_reason(self) -> str | None:
        if self.proc is None:
            return "is not running"
        code = self.proc.poll()
        return None if code is None else describe_exit(code)

    def ready(self) -> bool:
        return self.exit_reason() is None and self._ready(self)

    def log_text(self) -> str:
        """What it wrote since its latest start."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            # The main process only: a Celery worker then stops its own pool, gracefully.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                _say(f"{self.name} ignored SIGTERM for {self.stop_timeout:g} s; killing it")
        # Whatever is left of its session (pool children of a crashed worker): its group only.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class EmbeddedServer(Protocol):
    def start(self) -> str: ...  # blocks until it serves; returns its URL
    def stop(self) -> None: ...
    def exit_reason(self) -> str | None: ...


class ServerChild:
    """An embedded server (PostgreSQL, Redis, …) as a supervised child. Its first URL is the one
    every other child was given, so a restart elsewhere is refused (and retried like a crash)."""

    tier = 0

    def __init__(self, name: str, server: EmbeddedServer, answers: Callable[[str], bool]) -> None:
        self.name = name
        self.server = server
        self.url: str | None = None
        self._answers = answers

    def start(self) -> None:
        url = self.server.start()
        if self.url is not None and url != self.url:
            self.server.stop()
            # Not the URL itself: it may carry a password.
            raise RuntimeError("it came back at another address than the one its clients use")
        self.url = url

    def exit_reason(self) -> str | None:
        return self.server.exit_reason()

    def ready(self) -> bool:
        return self.url is not None and self.exit_reason() is None and self._answers(self.url)

    def stop(self) -> None:
        self.server.stop()


class LogFollower(threading.Thread):
    """`dtask dev --verbose`: copies new lines of the children's logs to stdout, prefixed by name."""

    def __init__(self, logs: dict[str, Path]) -> None:
        super().__init__(daemon=True, name="dtask-dev-logs")
        self.logs = logs
        self.offsets = {name: path.stat().st_size if path.exists() else 0 for name, path in logs.items()}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for name, path in self.logs.items():
                self._copy(name, path)

    def _copy(self, name: str, path: Path) -> None:
        try:
            with path.open("rb") as f:
                f.seek(self.offsets[name])
                chunk = f.read()
        except OSError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only; the rest comes next time
        self.offsets[name] += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            print(f"{name:>8} | {line}", flush=True)
