"""Build-once caches for clients: many coroutines asking for one key at the same moment get one build.

Values are per process (clients are thread-safe and not tied to an event loop); the locks that
serialise a key's first build are per event loop, because an ``asyncio.Lock`` belongs to the loop
that first waits on it (tests run one loop each; a worker process runs one for its life).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar
from weakref import WeakKeyDictionary

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class KeyedOnce(Generic[K, V]):
    def __init__(self, max_entries: int = 1024) -> None:
        self._values: OrderedDict[K, V] = OrderedDict()
        self._locks: WeakKeyDictionary[asyncio.AbstractEventLoop, dict[K, asyncio.Lock]] = WeakKeyDictionary()
        self._max = max_entries
        self.builds = 0  # successful builds, for tests and metrics

    async def get(self, key: K, build: Callable[[], Awaitable[V]]) -> V:
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        lock = locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._values:  # built while we waited
                value = self._values[key]
            else:
                value = await build()
                self.builds += 1
                self._values[key] = value
                while len(self._values) > self._max:
                    self._values.popitem(last=False)
        locks.pop(key, None)
        return value

    def forget(self, key: K) -> None:
        """Drop a value found stale (its collection or bucket vanished); the next get rebuilds it."""
        self._values.pop(key, None)


class PerProcess(Generic[K, V]):
    """Values built once per process, synchronously: a forked child (a prefork pool process) starts
    with none of its parent's, since clients, sockets and thread pools do not survive a fork."""

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._pid = os.getpid()

    def get(self, key: K, build: Callable[[], V]) -> V:
        if self._pid != os.getpid():
            self._values.clear()
            self._pid = os.getpid()
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = build()
        return value
