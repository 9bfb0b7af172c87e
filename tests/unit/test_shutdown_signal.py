"""ShutdownSignal's callbacks: what a run registers instead of a task waiting on the event."""

from __future__ import annotations

from tasks_core.worker.runtime import ShutdownSignal


async def test_callbacks_run_once_when_set_and_not_after_their_undo() -> None:
    signal = ShutdownSignal()
    calls: list[str] = []
    signal.on_set(lambda: calls.append("kept"))
    undo = signal.on_set(lambda: calls.append("undone"))
    undo()
    signal.set()
    signal.set()  # a second request changes nothing
    assert calls == ["kept"] and signal.event.is_set()


async def test_a_callback_registered_after_the_signal_runs_at_once() -> None:
    signal = ShutdownSignal()
    signal.set()
    calls: list[int] = []
    signal.on_set(lambda: calls.append(1))()  # its undo is harmless
    assert calls == [1]
