"""GroupCommit on its own: who shares a group, what each caller gets back, and what a failure
does to the others (a commit function of plain Python; the database side is in
tests/integration/test_group_commit.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tasks_core.store.group_commit import GroupCommit


class Recorder:
    """Commits items by doubling them, records each group, and fails where told to."""

    def __init__(self, *, bad: int | None = None, transient: bool = False) -> None:
        self.groups: list[list[int]] = []
        self.bad, self.transient = bad, transient
        self.gate = asyncio.Event()
        self.gate.set()

    async def commit(self, items: Sequence[int]) -> list[int]:
        await self.gate.wait()
        if self.bad in items:
            raise (ConnectionResetError if self.transient else ValueError)(f"bad {self.bad}")
        self.groups.append(list(items))
        return [2 * i for i in items]


async def test_callers_that_arrive_together_share_groups_no_larger_than_the_bound() -> None:
    recorder = Recorder()
    group = GroupCommit(recorder.commit, max_size=4)
    assert await asyncio.gather(*(group(i) for i in range(10))) == [2 * i for i in range(10)]
    assert recorder.groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert group.groups == 3


async def test_a_caller_that_arrives_during_a_commit_joins_the_next_group() -> None:
    recorder = Recorder()
    group = GroupCommit(recorder.commit, max_size=100)
    recorder.gate.clear()
    first = asyncio.ensure_future(group(1))
    await asyncio.sleep(0.01)  # the first group is committing, held at the gate
    later = [asyncio.ensure_future(group(i)) for i in (2, 3, 4)]
    await asyncio.sleep(0.01)
    recorder.gate.set()
    assert await asyncio.gather(first, *later) == [2, 4, 6, 8]
    assert recorder.groups == [[1], [2, 3, 4]]


async def test_a_bad_item_fails_only_its_own_caller() -> None:
    recorder = Recorder(bad=3)
    group = GroupCommit(recorder.commit, max_size=100)
    outcomes = await asyncio.gather(*(group(i) for i in range(1, 6)), return_exceptions=True)
    assert outcomes[:2] == [2, 4] and outcomes[3:] == [8, 10]
    assert isinstance(outcomes[2], ValueError)
    # The failed group went again item by item; the bad one committed nothing.
    assert recorder.groups == [[1], [2], [4], [5]]


async def test_a_transient_failure_fails_every_caller_of_the_group() -> None:
    recorder = Recorder(bad=3, transient=True)
    group = GroupCommit(recorder.commit, max_size=100)
    outcomes = await asyncio.gather(*(group(i) for i in range(1, 6)), return_exceptions=True)
    assert all(isinstance(o, ConnectionResetError) for o in outcomes)
    assert recorder.groups == []


async def test_a_caller_cancelled_before_its_group_starts_is_left_out() -> None:
    recorder = Recorder()
    group = GroupCommit(recorder.commit, max_size=100)
    recorder.gate.clear()
    first = asyncio.ensure_future(group(1))
    await asyncio.sleep(0.01)
    gone, stays = asyncio.ensure_future(group(2)), asyncio.ensure_future(group(3))
    await asyncio.sleep(0.01)
    gone.cancel()
    recorder.gate.set()
    assert await first == 2 and await stays == 6
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert recorder.groups == [[1], [3]]


def test_a_group_left_behind_by_a_closed_event_loop_does_not_hold_up_the_next_loop() -> None:
    recorder = Recorder()
    group = GroupCommit(recorder.commit, max_size=100)
    left: list[asyncio.Future[int]] = []

    async def leave_a_group_committing() -> None:
        recorder.gate = asyncio.Event()  # never set: this loop's group never finishes
        left.append(asyncio.ensure_future(group(1)))
        await asyncio.sleep(0.01)
        left.append(asyncio.ensure_future(group(2)))
        await asyncio.sleep(0.01)

    old = asyncio.new_event_loop()
    old.run_until_complete(leave_a_group_committing())
    old.close()  # closed with its tasks pending, never cancelled

    async def once() -> int:
        recorder.gate = asyncio.Event()
        recorder.gate.set()
        return await asyncio.wait_for(group(3), timeout=5)

    assert asyncio.run(once()) == 6
    assert recorder.groups == [[3]]
