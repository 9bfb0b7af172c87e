"""Hostile and slow documents through real `celery worker` processes, real Milvus and real S3:
parsing is bounded in memory and time, and a cancel stops it, not just its task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import psutil
import pytest

from domains.knowledge.chunking import chunk_text
from domains.knowledge.hostile import many_operators_bomb, one_operator_bomb, slow_pdf
from domains.knowledge.parse_process import MODULE
from domains.knowledge.parsing import extract_text
from domains.knowledge.settings import KnowledgeSettings
from tasks_core.settings import Settings
from tests.knowledge_helpers import ALICE, create_base, file_row, knowledge_api, make_pdf, upload
from tests.system.conftest import LEASE_SECONDS, Cluster, Proc, wait_for

pytestmark = pytest.mark.system

GB = 1024**3
HEARTBEAT = LEASE_SECONDS / 3


def _tree(worker: Proc) -> list[psutil.Process]:
    main = psutil.Process(worker.pid)
    return [main, *main.children(recursive=True)]


def _rss(worker: Proc) -> int:
    total = 0
    for proc in _tree(worker):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def _parse_children(worker: Proc) -> list[psutil.Process]:
    found = []
    for proc in _tree(worker):
        with contextlib.suppress(psutil.NoSuchProcess):
            if MODULE in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def _cpu_seconds(worker: Proc) -> dict[int, float]:
    """CPU seconds used so far by each process of the worker's tree."""
    used = {}
    for proc in _tree(worker):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            used[proc.pid] = times.user + times.system
    return used


async def _cores_busy(worker: Proc, window: float = 1.0) -> float:
    """Cores the worker's whole process tree kept busy over ``window`` seconds."""
    before = _cpu_seconds(worker)
    await asyncio.sleep(window)
    after = _cpu_seconds(worker)
    return sum(used - before.get(pid, 0.0) for pid, used in after.items()) / window


async def test_amplifying_pdfs_and_a_16_mb_line_end_error_parsing_quickly_in_bounded_memory(
    cluster: Cluster, knowledge_stores: dict[str, str]
) -> None:
    worker = cluster.start_worker(concurrency=3, **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    limits = KnowledgeSettings(_env_file=None)  # type: ignore[call-arg]
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        files = [
            ("one-operator.pdf", one_operator_bomb()),  # 6 KB, a billion characters in one operator
            ("many-operators.pdf", many_operators_bomb()),  # 16 KB, the same over 4,000 text objects
            ("line.txt", b"x" * settings.max_upload_bytes),  # the largest upload, one line
        ]
        started = time.monotonic()
        r = await upload(client, base, files)
        assert r.status_code == 202, r.text
        ids = [entry["id"] for entry in r.json()["files"]]
        peak = 0

        async def all_failed() -> list[dict[str, Any]] | None:
            nonlocal peak
            assert worker.alive()
            peak = max(peak, _rss(worker))
            assert peak < GB, f"the worker's processes hold {peak / GB:.2f} GB"
            rows = [await file_row(svc, file_id) for file_id in ids]
            return rows if all(row["status"] == "error_parsing" for row in rows) else None

        rows = await wait_for(all_failed, within=60, interval=0.05, what="every file to end error_parsing")
        elapsed = time.monotonic() - started
        print(f"3 hostile files error_parsing in {elapsed:.1f} s; worker tree RSS peak {peak / 2**20:.0f} MB")
        chars = f"limit of {limits.knowledge_max_chars:,} characters (DTASK_KNOWLEDGE_MAX_CHARS)"
        assert [row["error_message"] for row in rows] == [
            f"the parser ran out of its {limits.knowledge_parse_memory_mb} MB memory limit "
            "(DTASK_KNOWLEDGE_PARSE_MEMORY_MB)",
            f"the file's text is longer than the {chars}",
            f"the file's text is longer than the {chars}",
        ]

        async def tasks_failed() -> bool:
            tasks = [
                (await client.get(f"/tasks/{e['task_id']}", headers=ALICE)).json() for e in r.json()["files"]
            ]
            assert all(task["status"] in ("running", "failed") for task in tasks), tasks
            return all(task["status"] == "failed" for task in tasks)

        await wait_for(tasks_failed, within=30, what="the files' tasks to end failed")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
async def test_cancel_while_parsing_stops_the_parse_within_a_heartbeat(
    cluster: Cluster, knowledge_stores: dict[str, str], pool: str
) -> None:
    worker = cluster.start_worker(pool=pool, concurrency=3, **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        # Within every limit (little text, little memory), but minutes of pypdf's CPU.
        r = await upload(client, base, [("slow.pdf", slow_pdf(pages=400))])
        [entry] = r.json()["files"]

        async def parsing() -> bool:
            return (await file_row(svc, entry["id"]))["status"] == "parsing"

        await wait_for(parsing, within=30, what="the file to be parsing")
        busy = await _cores_busy(worker)
        # Most of a core (as much as this shared machine gives it) against none after the cancel.
        assert busy > 0.25, f"the parse should keep a core busy, not {busy:.2f}"

        r = await client.post(f"/tasks/{entry['task_id']}/cancel", headers=ALICE)
        assert r.status_code == 202, r.text
        cancelled_at = time.monotonic()

        # The heartbeat reads the cancel within one interval and cancels the handler, which kills
        # the parse process (half a second more for this loaded machine).
        async def killed() -> bool:
            return _parse_children(worker) == []

        await wait_for(killed, within=HEARTBEAT + 0.5, interval=0.02, what="the parse process to be killed")
        killed_in = time.monotonic() - cancelled_at
        idle = await _cores_busy(worker)
        print(
            f"{pool}: cores busy parsing {busy:.2f}; killed {killed_in:.2f} s after cancel; then {idle:.2f}"
        )
        assert idle < 0.1, f"the worker's processes still keep {idle:.2f} cores busy after the cancel"

        async def cancelled() -> bool:
            task = (await client.get(f"/tasks/{entry['task_id']}", headers=ALICE)).json()
            return task["status"] == "cancelled"

        await wait_for(cancelled, within=30, what="the task to end cancelled")
        print(f"{pool}: cancelled {time.monotonic() - cancelled_at:.1f} s after the request")
        assert (await file_row(svc, entry["id"]))["status"] == "error_parsing"


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
async def test_ordinary_files_are_indexed_through_a_warm_parse_process(
    cluster: Cluster, knowledge_stores: dict[str, str], pool: str
) -> None:
    worker = cluster.start_worker(pool=pool, concurrency=1 if pool == "solo" else 3, **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    files = [
        ("notes.md", b"# Keeper\n\n" + b"The lamp was lit at dusk. " * 200),
        ("page.html", b"<p>Fresnel lens</p><script>no</script><p>second order</p>"),
        ("log.pdf", make_pdf(["Lighthouse keeper log", "Fresnel lens (second order)"])),
    ]
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, files)
        ids = [entry["id"] for entry in r.json()["files"]]

        async def all_indexed() -> list[dict[str, Any]] | None:
            rows = [await file_row(svc, file_id) for file_id in ids]
            return rows if all(row["status"] == "indexed" for row in rows) else None

        rows = await wait_for(all_indexed, within=60, what="every file indexed")
        for (name, data), row in zip(files, rows, strict=True):
            assert row["chunk_count"] == len(chunk_text(extract_text(data, name.rsplit(".")[1]))), name
        # Kept warm for the next file; the solo pool ran all three in one process, with one.
        children = _parse_children(worker)
        assert (len(children) == 1) if pool == "solo" else (1 <= len(children) <= 3)
