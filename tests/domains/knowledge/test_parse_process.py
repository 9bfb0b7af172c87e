"""The parse process: a real child of this process, with its memory limit and deadline, killed
when its caller is cancelled; hostile files end in the ParseError that names the limit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import psutil
import pytest

from domains.knowledge import parse_process
from domains.knowledge.chunking import chunk_text
from domains.knowledge.hostile import many_operators_bomb, one_operator_bomb, slow_pdf
from domains.knowledge.parse_child import NICENESS
from domains.knowledge.parse_process import ParseLimits, parse_file
from domains.knowledge.parsing import ParseError, extract_text
from tests.knowledge_helpers import make_pdf

T = TypeVar("T")
MB = 1024 * 1024
LIMITS = ParseLimits(max_chars=4_000_000, max_chunks=10_000, memory_mb=256, seconds=60)


@pytest.fixture(autouse=True)
async def _no_helper_outlives_its_test() -> AsyncIterator[None]:
    yield
    await parse_process.close_idle()


def _helpers() -> list[psutil.Process]:
    """This process's parse children, as the operating system sees them."""
    found = []
    for child in psutil.Process().children():
        try:
            if parse_process.MODULE in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


async def _busy_helper() -> psutil.Process:
    """The helper that is parsing, once it has used a quarter of a second of CPU."""
    for _ in range(300):
        for helper in _helpers():
            try:
                cpu = helper.cpu_times()
            except psutil.NoSuchProcess:
                continue
            if cpu.user + cpu.system > 0.25:
                return helper
        await asyncio.sleep(0.1)
    raise AssertionError("no parse process got busy")


async def _peaks(work: Awaitable[T]) -> tuple[T | BaseException, int, int]:
    """``work``'s result (or exception), with the peak RSS of the parse children and the growth of
    this process's RSS, sampled every 10 ms while it ran."""
    me = psutil.Process()
    before = me.memory_info().rss
    peaks = {"child": 0, "parent": before}
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    while not task.done():
        for helper in _helpers():
            with contextlib.suppress(psutil.NoSuchProcess):
                peaks["child"] = max(peaks["child"], helper.memory_info().rss)
        peaks["parent"] = max(peaks["parent"], me.memory_info().rss)
        await asyncio.wait({task}, timeout=0.01)
    outcome: T | BaseException = task.exception() or task.result()
    return outcome, peaks["child"], peaks["parent"] - before


async def test_files_parse_in_the_child_as_they_would_in_process() -> None:
    files = [
        (b"# Title\n\n" + b"A line of text. " * 400, "md"),
        (b"<p>caf&eacute;</p><script>x</script>" * 50, "html"),
        (make_pdf(["Lighthouse keeper log", "Fresnel lens (second order)"]), "pdf"),
    ]
    for data, file_type in files:
        assert await parse_file(data, file_type, LIMITS) == chunk_text(extract_text(data, file_type))


async def test_an_unreadable_file_keeps_its_message_and_its_helper() -> None:
    with pytest.raises(ParseError, match=r"^not a text file \(binary data"):
        await parse_file(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "txt", LIMITS)
    [helper] = _helpers()
    assert await parse_file(b"fine", "txt", LIMITS) == ["fine"]
    assert _helpers() == [helper]


async def test_one_operator_amplification_ends_at_the_memory_limit_and_the_parent_stays_small() -> None:
    # 1.07 billion characters from a 6 KB file, shown by one text operator: no callback sees any
    # of it before pypdf has built it, so the child's address-space limit is what stops it.
    outcome, child_peak, parent_growth = await _peaks(parse_file(one_operator_bomb(), "pdf", LIMITS))
    assert isinstance(outcome, ParseError)
    assert str(outcome) == "the parser ran out of its 256 MB memory limit (DTASK_KNOWLEDGE_PARSE_MEMORY_MB)"
    assert 0 < child_peak < 256 * MB
    assert parent_growth < 50 * MB
    assert _helpers() == []  # replaced: the next file gets a fresh one


async def test_many_operators_amplification_stops_at_the_character_limit() -> None:
    # Without stopping at the limit pypdf would run for minutes on this towards a billion characters.
    outcome, child_peak, parent_growth = await _peaks(parse_file(many_operators_bomb(), "pdf", LIMITS))
    assert isinstance(outcome, ParseError)
    assert "limit of 4,000,000 characters (DTASK_KNOWLEDGE_MAX_CHARS)" in str(outcome)
    assert 0 < child_peak < 256 * MB and parent_growth < 50 * MB


async def test_a_slow_file_is_killed_at_its_deadline() -> None:
    limits = ParseLimits(max_chars=4_000_000, max_chunks=10_000, memory_mb=256, seconds=1.5)
    started = time.monotonic()
    with pytest.raises(ParseError) as caught:
        await parse_file(slow_pdf(pages=200), "pdf", limits)
    assert str(caught.value) == "parsing took longer than its 1.5 s limit (DTASK_KNOWLEDGE_PARSE_SECONDS)"
    assert time.monotonic() - started < 30
    assert _helpers() == []


async def test_cancelling_the_caller_kills_the_child_at_once() -> None:
    task = asyncio.create_task(parse_file(slow_pdf(pages=200), "pdf", LIMITS))
    helper = await _busy_helper()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not helper.is_running()  # gone by the time the cancelled caller resumes


async def test_the_helper_is_reused_with_its_limits_and_replaced_after_a_breach() -> None:
    assert await parse_file(b"one", "txt", LIMITS) == ["one"]
    [helper] = _helpers()
    assert helper.rlimit(psutil.RLIMIT_AS) == (256 * MB, 256 * MB)
    # Below the worker's priority: a hostile file yields the cores to the rest of the worker.
    assert helper.nice() == psutil.Process().nice() + NICENESS
    assert await parse_file(b"two", "txt", LIMITS) == ["two"]
    assert _helpers() == [helper]
    # Its CPU limit is moved on for each file: its own CPU so far plus the deadline.
    soft_cpu, _ = helper.rlimit(psutil.RLIMIT_CPU)
    cpu = helper.cpu_times()
    assert cpu.user + cpu.system < soft_cpu <= cpu.user + cpu.system + LIMITS.seconds + 2

    small = ParseLimits(max_chars=10, max_chunks=10, memory_mb=256, seconds=60)
    with pytest.raises(ParseError, match="10 characters"):
        await parse_file(b"eleven chars", "txt", small)
    assert not helper.is_running()
    assert await parse_file(b"three", "txt", LIMITS) == ["three"]
    [fresh] = _helpers()
    assert fresh.pid != helper.pid

    # Another memory limit needs another process.
    other = ParseLimits(max_chars=100, max_chunks=10, memory_mb=300, seconds=60)
    assert await parse_file(b"four", "txt", other) == ["four"]
    [third] = _helpers()
    assert third.rlimit(psutil.RLIMIT_AS) == (300 * MB, 300 * MB)


async def test_a_child_that_dies_mid_parse_fails_that_file_only() -> None:
    task = asyncio.create_task(parse_file(slow_pdf(pages=200), "pdf", LIMITS))
    helper = await _busy_helper()
    os.kill(helper.pid, signal.SIGKILL)  # the OOM killer, say
    with pytest.raises(ParseError, match=r"the parser stopped unexpectedly \(killed by SIGKILL\)"):
        await task
    assert await parse_file(b"next", "txt", LIMITS) == ["next"]


async def test_parses_in_one_loop_run_side_by_side_and_a_cancel_stops_only_its_own() -> None:
    slow = asyncio.create_task(parse_file(slow_pdf(pages=200), "pdf", LIMITS))
    await _busy_helper()
    texts = [f"file {i} ".encode() * 50 for i in range(3)]
    results: list[Any] = await asyncio.gather(*(parse_file(t, "txt", LIMITS) for t in texts))
    assert results == [chunk_text(t.decode()) for t in texts]
    assert len(_helpers()) >= 2  # the slow one kept its own
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert await parse_file(b"after", "txt", LIMITS) == ["after"]


async def test_an_idle_helper_is_stopped_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse_process, "IDLE_SECONDS", 0.5)
    assert await parse_file(b"one", "txt", LIMITS) == ["one"]
    [helper] = _helpers()
    for _ in range(100):
        if not helper.is_running():
            break
        await asyncio.sleep(0.1)
    assert not helper.is_running()
    assert await parse_file(b"two", "txt", LIMITS) == ["two"]  # a fresh one
