"""Group commit: concurrent callers' items share one transaction.

An item that arrives while a group is committing waits for the next group, which takes everything
queued by then (up to ``max_size``). No timer: a lone caller's group starts at once, so an idle
process answers as fast as before, and a busy one spends one transaction, one statement and one
publish on many items. Each caller gets its own item's result. Trade-offs: a group that fails
transiently (the database blinked) fails every caller in it, each of whom may retry, as a single
transaction would have; any other error sends each item of the group again on its own, so one bad
item fails only its own caller. A caller cancelled before its group started stores nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from tasks_core.db import is_transient

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    def __init__(self, commit: Callable[[Sequence[T]], Awaitable[Sequence[R]]], *, max_size: int) -> None:
        self._commit = commit
        self._max_size = max_size
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None
        self.groups = 0  # groups committed: sizes = items / groups

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if self._drain is not None and self._drain.get_loop() is not loop:
            # Used from a new event loop (the old one is gone): what waited there never will.
            self._drain, self._waiting = None, [w for w in self._waiting if w[1].get_loop() is loop]
        future: asyncio.Future[R] = loop.create_future()
        self._waiting.append((item, future))
        if self._drain is None or self._drain.done():
            self._drain = loop.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._waiting:
            taken, self._waiting = self._waiting[: self._max_size], self._waiting[self._max_size :]
            group = [(item, future) for item, future in taken if not future.done()]
            if group:
                await self._settle(group)

    async def _settle(self, group: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._commit([item for item, _ in group])
        except asyncio.CancelledError:
            for _, future in group:
                future.cancel()
            raise
        except Exception as exc:
            if len(group) > 1 and not is_transient(exc):
                for one in group:
                    await self._settle([one])
                return
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            return
        self.groups += 1
        for (_, future), result in zip(group, results, strict=True):
            if not future.done():
                future.set_result(result)
