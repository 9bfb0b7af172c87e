"""Parse and chunk a file in a child process (``parse_child``) with a memory limit and a deadline.

Extraction is CPU-heavy, and a hostile file has no natural bound: a PDF's font map can turn each
byte into hundreds of characters. Work in a thread cannot be stopped, so it kept a core and
gigabytes long after its task was cancelled; a process can be killed. ``parse_file`` kills the
child the moment it is cancelled (cancel, timeout and a lost lease all cancel the handler), when
the deadline passes, and after any limit breach, so no work outlives its file.

The child is a plain subprocess (``python -m domains.knowledge.parse_child``), since Celery's
prefork children are daemonic and may not start multiprocessing children. One is kept warm per
event loop and memory limit and reused across files, so a small file does not pay a Python
start-up (0.1-0.35 s here); files parsed at the same time get one each. An idle one is stopped after
``IDLE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from domains.knowledge.parsing import LimitExceeded, ParseError

if TYPE_CHECKING:
    from domains.knowledge.settings import KnowledgeSettings

MODULE = "domains.knowledge.parse_child"
# A warm child costs a Python process's memory while it waits; one unused this long is stopped.
IDLE_SECONDS = 60.0


@dataclass(frozen=True)
class ParseLimits:
    """Per file: characters and chunks it may give, the child's address space, the deadline."""

    max_chars: int
    max_chunks: int
    memory_mb: int
    seconds: float

    @classmethod
    def from_settings(cls, settings: KnowledgeSettings) -> ParseLimits:
        return cls(
            max_chars=settings.knowledge_max_chars,
            max_chunks=settings.knowledge_max_chunks,
            memory_mb=settings.knowledge_parse_memory_mb,
            seconds=settings.knowledge_parse_seconds,
        )


@dataclass(eq=False)
class _Child:
    proc: asyncio.subprocess.Process
    memory_mb: int
    loop: asyncio.AbstractEventLoop
    # While it waits for a file: the task that stops it (see _watch_idle).
    watcher: asyncio.Task[None] | None = field(default=None)

    def kill(self) -> None:
        # asyncio's kill goes through Popen, which never signals a process it has already reaped.
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def end(self) -> None:
        """Kill it and wait until it is gone (milliseconds: SIGKILL cannot be ignored)."""
        self.kill()
        await self.proc.wait()


# Warm children waiting for a file (a worker has one event loop; a test has one per test).
_idle: list[_Child] = []


async def _child(memory_mb: int) -> _Child:
    loop = asyncio.get_running_loop()
    # Only this loop's: another loop's children and their watchers are that loop's to use and stop.
    for child in [c for c in reversed(_idle) if c.loop is loop]:
        _idle.remove(child)
        if child.watcher is not None:
            child.watcher.cancel()  # off the idle list first: the watcher leaves it alone
        if child.memory_mb == memory_mb and child.proc.returncode is None:
            return child
        await child.end()  # older limits, or dead
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", MODULE, str(memory_mb), str(os.getpid()),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return _Child(proc, memory_mb, loop)


async def _watch_idle(child: _Child) -> None:
    """Stop an idle child after IDLE_SECONDS, or when its loop shuts down (which cancels this
    task and waits for it), unless a file took it first; forget it if it died meanwhile."""
    try:
        await asyncio.wait_for(child.proc.wait(), IDLE_SECONDS)
    except TimeoutError:
        pass
    finally:
        if child in _idle:
            _idle.remove(child)
            await child.end()


def _keep(child: _Child) -> None:
    _idle.append(child)
    child.watcher = child.loop.create_task(_watch_idle(child))


async def close_idle() -> None:
    """Stop this loop's idle children now (a worker needs not: they die with it)."""
    loop = asyncio.get_running_loop()
    for child in [c for c in _idle if c.loop is loop]:
        _idle.remove(child)
        if child.watcher is not None:
            child.watcher.cancel()
        await child.end()


async def _ask(child: _Child, header: bytes, data: bytes) -> dict[str, Any] | None:
    """The child's reply, or None if it died first."""
    stdin, stdout = child.proc.stdin, child.proc.stdout
    assert stdin is not None and stdout is not None
    try:
        stdin.write(header)
        stdin.write(data)
        await stdin.drain()
        size = int.from_bytes(await stdout.readexactly(8), "big")
        reply: dict[str, Any] = json.loads(await stdout.readexactly(size))
        return reply
    except (asyncio.IncompleteReadError, ConnectionError):
        await child.proc.wait()
        return None


def _timed_out(limits: ParseLimits) -> ParseError:
    return ParseError(
        f"parsing took longer than its {limits.seconds:g} s limit (DTASK_KNOWLEDGE_PARSE_SECONDS)"
    )


def _died(returncode: int | None, limits: ParseLimits) -> ParseError:
    if returncode == -signal.SIGXCPU:  # its own CPU limit: the deadline, seen from inside
        return _timed_out(limits)
    if returncode is not None and returncode < 0:
        how = f"killed by {signal.Signals(-returncode).name}"
    else:
        how = f"exit code {returncode}"
    return ParseError(f"the parser stopped unexpectedly ({how})")


async def parse_file(data: bytes, file_type: str, limits: ParseLimits) -> list[str]:
    """The chunk texts of a file, parsed in a child process within ``limits``.

    Raises ``ParseError`` for a file that gives no usable text or breaks a limit, with a message
    for its owner. Cancelling the caller kills the child at once.
    """
    child = await _child(limits.memory_mb)
    header = json.dumps(
        {
            "file_type": file_type,
            "size": len(data),
            "max_chars": limits.max_chars,
            "max_chunks": limits.max_chunks,
            "seconds": limits.seconds,
        }
    ).encode()
    try:
        async with asyncio.timeout(limits.seconds):
            reply = await _ask(child, header + b"\n", data)
    except TimeoutError:
        await child.end()
        raise _timed_out(limits) from None
    except BaseException:  # cancelled, or a fault of ours: the work must not go on without us
        await child.end()
        raise
    if reply is None:
        raise _died(child.proc.returncode, limits)
    if "chunks" in reply:
        _keep(child)
        chunks: list[str] = reply["chunks"]
        return chunks
    if reply["kind"] == "parse":
        _keep(child)
        raise ParseError(reply["error"])
    # Over a limit or out of memory, the child may keep a large heap: the next file gets a new one.
    await child.end()
    if reply["kind"] == "memory":
        raise ParseError(
            f"the parser ran out of its {limits.memory_mb} MB memory limit (DTASK_KNOWLEDGE_PARSE_MEMORY_MB)"
        )
    raise LimitExceeded(reply["error"])
