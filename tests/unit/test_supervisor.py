"""The supervisor's restart rules, with fake children and a fake clock (no processes, no sleeping)."""

from __future__ import annotations

import signal

import pytest

from tasks_core.devkit.supervisor import ChildFailed, RestartPolicy, ServerChild, StopRequested, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeChild:
    """Crashes ``crash_after`` seconds after each start (never, if None)."""

    tier = 1

    def __init__(self, name: str, clock: Clock, crash_after: float | None = None) -> None:
        self.name, self.clock, self.crash_after = name, clock, crash_after
        self.starts: list[float] = []
        self.stops = 0

    def start(self) -> None:
        self.starts.append(self.clock.now)

    def exit_reason(self) -> str | None:
        if self.crash_after is not None and self.clock.now >= self.starts[-1] + self.crash_after:
            return "exited with 1"
        return None

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        self.stops += 1


def _supervisor(clock: Clock, lines: list[str], policy: RestartPolicy | None = None) -> Supervisor:
    return Supervisor(policy, say=lines.append, clock=clock, sleep=clock.sleep, poll_seconds=0.1)


def test_a_child_that_keeps_crashing_stops_the_stack_after_backoff() -> None:
    clock, lines = Clock(), []
    sup = _supervisor(clock, lines, RestartPolicy(max_crashes=5, window=60, first_delay=1, max_delay=16))
    flaky, steady = FakeChild("api", clock, crash_after=0.5), FakeChild("worker", clock)
    sup.start(flaky)
    sup.start(steady)
    assert sup.run() == 1
    gaps = [b - a for a, b in zip(flaky.starts, flaky.starts[1:], strict=False)]
    # It crashes 0.5 s after each start, then waits a doubling backoff (give or take a few polls).
    for gap, expected in zip(gaps, [1.5, 2.5, 4.5, 8.5], strict=True):
        assert expected <= gap < expected + 0.5, gaps
    assert len(flaky.starts) == 5 and steady.starts == [0.0]
    assert lines[-1] == "api exited with 1; 5 crashes within 60 s stop the stack: stopping"
    assert [line.split(";")[1].strip() for line in lines if "restarting" in line] == [
        f"restarting it in {delay} s (crash {n}" for n, delay in enumerate((1, 2, 4, 8), start=1)
    ]


def test_crashes_spread_wider_than_the_window_never_stop_the_stack() -> None:
    clock, lines = Clock(), []
    sup = _supervisor(clock, lines, RestartPolicy(max_crashes=2, window=10, first_delay=1))
    child = FakeChild("beat", clock, crash_after=30)
    sup.start(child)

    def stop_after(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now > 200:
            sup.stop_signal = signal.SIGTERM

    sup._sleep = stop_after
    assert sup.run() == 0
    assert len(child.starts) >= 6
    assert sum("is back" in line for line in lines) == len(child.starts) - 1


def test_a_stop_signal_interrupts_waiting_for_readiness() -> None:
    clock, lines = Clock(), []
    sup = _supervisor(clock, lines)
    child = FakeChild("api", clock)
    child.ready = lambda: False  # type: ignore[method-assign]
    sup.start(child)
    sup._on_signal(signal.SIGHUP, None)
    with pytest.raises(StopRequested):
        sup.wait_ready([child], timeout=30)


def test_a_child_that_exits_before_it_is_ready_is_named() -> None:
    clock, lines = Clock(), []
    sup = _supervisor(clock, lines)
    child = FakeChild("beat", clock, crash_after=0)
    sup.start(child)
    with pytest.raises(ChildFailed, match="beat exited with 1 before it was ready"):
        sup.wait_ready([child], timeout=30)


def test_stop_all_stops_processes_before_servers() -> None:
    clock, order = Clock(), []
    sup = _supervisor(clock, [])
    server, app = FakeChild("postgres", clock), FakeChild("worker", clock)
    server.tier = 0
    server.stop = lambda: order.append("postgres")  # type: ignore[method-assign]
    app.stop = lambda: order.append("worker")  # type: ignore[method-assign]
    sup.start(server)
    sup.start(app)
    sup.stop_all()
    assert order == ["worker", "postgres"]


class MovingServer:
    """An embedded server that serves at another URL after each start."""

    def __init__(self) -> None:
        self.starts = 0
        self.running = False

    def start(self) -> str:
        self.starts += 1
        self.running = True
        return f"redis://127.0.0.1:{6000 + self.starts}/0"

    def stop(self) -> None:
        self.running = False

    def exit_reason(self) -> str | None:
        return None if self.running else "is not running"


def test_a_server_that_comes_back_elsewhere_is_not_taken_for_back() -> None:
    clock, lines = Clock(), []

    def sleep(seconds: float) -> None:  # a stop signal after a minute, should the stack go on
        clock.sleep(seconds)
        if clock.now > 60:
            sup.stop_signal = signal.SIGTERM

    policy = RestartPolicy(max_crashes=3, window=60, first_delay=1, max_delay=1)
    sup = Supervisor(policy, say=lines.append, clock=clock, sleep=sleep, poll_seconds=0.1)
    server = MovingServer()
    child = ServerChild("redis", server, answers=lambda url: True)
    sup.start(child)
    server.running = False  # it crashed
    assert sup.run() == 1  # every restart lands elsewhere: the stack stops instead of serving nobody
    assert child.url == "redis://127.0.0.1:6001/0" and server.starts == 3
    assert not any(" is back " in line for line in lines), lines
    assert any("came back at another address" in line for line in lines), lines
