"""Figures the api serves often and computes expensively (exact counts over the task table),
kept for a short while and refreshed by one request at a time per key.

A scrape or dashboard storm then costs one query per key and interval, never one table scan per
request; every answer says how old its figures are.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class TtlCache(Generic[T]):
    def __init__(self, max_age: float, max_keys: int = 1024) -> None:
        self.max_age = max_age
        self.max_keys = max_keys
        self._values: OrderedDict[Hashable, tuple[float, T]] = OrderedDict()
        self._locks: dict[Hashable, asyncio.Lock] = {}

    def _fresh(self, key: Hashable) -> tuple[float, T] | None:
        hit = self._values.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.max_age:
            self._values.move_to_end(key)
            return hit
        return None

    async def get(self, key: Hashable, compute: Callable[[], Awaitable[T]]) -> tuple[T, float]:
        """The value and its age in seconds (0 when computed for this call)."""
        hit = self._fresh(key)
        if hit is None:
            lock = self._locks.setdefault(key, asyncio.Lock())
            async with lock:  # single flight: waiters take what the first one computed
                hit = self._fresh(key)
                if hit is None:
                    hit = (time.monotonic(), await compute())
                    self._values[key] = hit
                    self._values.move_to_end(key)
                    while len(self._values) > self.max_keys:
                        old, _ = self._values.popitem(last=False)
                        self._locks.pop(old, None)
        return hit[1], time.monotonic() - hit[0]
