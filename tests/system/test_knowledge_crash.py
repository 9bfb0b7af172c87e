"""Crashed knowledge ingestion resumes by itself: real `celery worker` and `beat` processes, real
Milvus and S3. A SIGKILLed pool child, and a SIGKILLed worker restarted under the same node name
(as `dtask dev` restarts it), mid-ingest of 200 files: every file ends `indexed` with exactly its
chunk rows' vectors, and the killed attempts are claimed again within two reconcile intervals —
long before their leases (60 s here) could have run out.

The bound is a protocol property of the intervals configured here: the main process expires a dead
process's attempts by their tokens at once, the reconciler's next pass (≤ R) sends them back to
pending with a backoff (≤ R/2 here), and the next relay (another task's terminal write, or the
reconciler's own pass) publishes them once due. Measured on the PostgreSQL clock (attempt rows).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.knowledge_helpers import create_base, knowledge_api, milvus_client, upload
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

FILES = 200
CAPACITY = 4
RECONCILE_SECONDS = 2.0
# Far beyond the bound asserted: recovery by the lease would fail the test.
LEASE_SECONDS = 60.0
# The first retry waits 0.25-0.5 s (half fixed, half jitter), below a reconcile interval.
BACKOFF_SECONDS = 0.5
BOUND = 2 * RECONCILE_SECONDS


def _env(stores: dict[str, str], gate: Path) -> dict[str, str]:
    return {
        **stores,
        "DTASK_CAPACITY": str(CAPACITY),
        # One owner uploads everything: let it fill the capacity (by default it keeps half back).
        "DTASK_OWNER_MAX_RUNNING": str(CAPACITY),
        "DTASK_LEASE_SECONDS": str(LEASE_SECONDS),
        "DTASK_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
        "DTASK_RETRY_BACKOFF_SECONDS": str(BACKOFF_SECONDS),
        # Held from each process's second embedding on while the gate file exists.
        "DTASK_EMBEDDER": "tests.knowledge_embedders:GateEmbedder",
        "DTASK_TEST_EMBED_GATE": str(gate),
    }


def _files() -> list[tuple[str, bytes]]:
    return [(f"crash-{i:03d}.txt", f"file {i} about crash{i} and recovery words".encode()) for i in range(FILES)]


async def _pg_now(svc: Any) -> datetime:
    async with svc.engine.connect() as conn:
        now: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    return now


async def _rows(svc: Any, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with svc.engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(text(sql), params)).mappings().all()]


async def _held(svc: Any, gate: Path) -> list[dict[str, Any]]:
    """Wait until every slot is taken by an attempt held inside indexing (its file `indexing`, the
    same attempts a second later); those attempts, with their leases."""
    seen: set[Any] = set()

    async def full() -> list[dict[str, Any]] | None:
        if not Path(f"{gate}.entered").exists():
            return None
        running = await _rows(
            svc,
            """SELECT a.worker, a.token, a.task_id, t.lease_expires_at
               FROM tasks t JOIN task_attempts a ON a.token = t.attempt_token
               JOIN knowledge_files f ON f.attempt_token = t.attempt_token AND f.status = 'indexing'
               WHERE t.status = 'running' AND t.task_type = 'knowledge.ingest'""",
        )
        tokens = {r["token"] for r in running}
        stable = len(running) == CAPACITY and tokens == seen
        seen.clear()
        seen.update(tokens)
        return running if stable else None

    return await wait_for(full, within=90, interval=1.0, what=f"{CAPACITY} ingest attempts held while indexing")


async def _all_indexed(svc: Any, base: str, workers: list[Any]) -> None:
    async def done() -> bool:
        for w in workers:
            assert w.alive(), f"{w.name} exited"
        counts = {
            r["status"]: r["n"]
            for r in await _rows(
                svc, "SELECT status, count(*) AS n FROM knowledge_files WHERE kb_id = :kb GROUP BY status", kb=base
            )
        }
        assert not {"error_parsing", "error_indexing"} & counts.keys(), counts
        if counts.get("indexed") != FILES:
            return False
        active = await _rows(svc, "SELECT id FROM tasks WHERE status IN ('pending', 'running')")
        return not active

    await wait_for(done, within=180, interval=0.5, what=f"{FILES} files indexed")


async def _assert_vectors_match_chunks(svc: Any, stores: dict[str, str], base: str) -> None:
    chunks = {
        r["file_id"]: r["n"]
        for r in await _rows(
            svc,
            """SELECT f.file_id, count(c.*) AS n FROM knowledge_files f
               LEFT JOIN knowledge_chunks c ON c.file_id = f.file_id WHERE f.kb_id = :kb GROUP BY f.file_id""",
            kb=base,
        )
    }
    files = await _rows(svc, "SELECT file_id, chunk_count FROM knowledge_files WHERE kb_id = :kb", kb=base)
    assert all(f["chunk_count"] == chunks[f["file_id"]] > 0 for f in files), files
    client = milvus_client(stores)
    rows = await asyncio.to_thread(
        client.query, f"kb_{base}", filter='file_id != ""', output_fields=["file_id"], limit=16384,
        consistency_level="Strong",
    )
    vectors = Counter(r["file_id"] for r in rows)
    assert len(chunks) == FILES
    assert vectors == Counter(chunks), {f: (vectors[f], n) for f, n in chunks.items() if vectors[f] != n}


async def _reclaim_delays(svc: Any, held: list[dict[str, Any]], killed_at: datetime | None) -> list[float]:
    """For each killed attempt (``held``, read before the kill with its lease): the seconds from
    ``killed_at`` (or, without it, from the attempt's end) to the claim of the task's next attempt.
    Each must have been expired by its token: ended before its lease ran out."""
    delays, ends = [], []
    for attempt in held:
        [dead] = await _rows(svc, "SELECT * FROM task_attempts WHERE token = :tok", tok=attempt["token"])
        [following] = await _rows(
            svc, "SELECT * FROM task_attempts WHERE task_id = :id AND attempt = :n",
            id=dead["task_id"], n=dead["attempt"] + 1,
        )
        since = killed_at or dead["ended_at"]
        delays.append((following["claimed_at"] - since).total_seconds())
        ends.append((dead, (attempt["lease_expires_at"] - dead["ended_at"]).total_seconds()))
    print(f"claimed again {', '.join(f'{d:.2f}' for d in delays)} s after "
          f"{'the kill' if killed_at else 'their expiry'}; ended {', '.join(f'{e:.2f}' for _, e in ends)} s "
          f"before their leases' end")
    for dead, early in ends:
        assert dead["outcome"] == "lease_expired", dead
        assert early > 0, dead
    return delays


async def test_sigkill_of_a_pool_child_mid_ingest_is_retried_within_two_reconcile_intervals(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    gate = tmp_path / "embed-gate"
    gate.touch()
    env = _env(knowledge_stores, gate)
    worker = cluster.start_worker(concurrency=CAPACITY + 2, **env)
    beat = cluster.start_beat(**env)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, _files())
        assert r.status_code == 202, r.text

        held = await _held(svc, gate)
        owner = held[0]["worker"]
        victim = int(owner.rpartition(":")[2])
        assert victim in worker.group_members() and victim != worker.pid
        mine = [a for a in held if a["worker"] == owner]
        os.kill(victim, signal.SIGKILL)
        killed_at = await _pg_now(svc)
        gate.unlink()

        await _all_indexed(svc, base, [worker, beat])
        delays = await _reclaim_delays(svc, mine, killed_at)
        print(f"pool child {victim} SIGKILLed holding {len(mine)} attempt(s): claimed again "
              f"{', '.join(f'{d:.2f}' for d in delays)} s after the kill (bound {BOUND:g} s, lease {LEASE_SECONDS:g} s)")
        assert all(0 < d <= BOUND for d in delays), delays
        await _assert_vectors_match_chunks(svc, knowledge_stores, base)
        # No person involved: one task per file, every one a success.
        tasks = await _rows(svc, "SELECT status, count(*) AS n FROM tasks WHERE task_type = 'knowledge.ingest' GROUP BY status")
        assert tasks == [{"status": "success", "n": FILES}], tasks


async def test_sigkill_of_a_worker_restarted_under_its_node_name_frees_its_slots_at_once(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    """As `dtask dev` does it: the worker's whole group is killed and the worker started again under
    the same node name; the new main process expires the attempts of the dead incarnation."""
    gate = tmp_path / "embed-gate"
    gate.touch()
    env = _env(knowledge_stores, gate)
    node = f"crash-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
    first = cluster.harness.start_worker("worker-1", cluster.env(**env), node=node, concurrency=CAPACITY + 2)
    beat = cluster.start_beat(**env)
    await cluster.wait_worker_ready(first)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, _files())
        assert r.status_code == 202, r.text

        held = await _held(svc, gate)
        first.killpg(signal.SIGKILL)
        assert first.wait_exit(10) == -signal.SIGKILL
        gate.unlink()
        second = cluster.harness.start_worker("worker-2", cluster.env(**env), node=node, concurrency=CAPACITY + 2)

        await _all_indexed(svc, base, [second, beat])
        # Each was expired by the restarted main process (before its lease ran out), and claimed
        # again within two reconcile intervals of that.
        delays = await _reclaim_delays(svc, held, None)
        print(f"worker SIGKILLed holding {len(held)} attempts and restarted: claimed again "
              f"{', '.join(f'{d:.2f}' for d in delays)} s after their expiry (bound {BOUND:g} s)")
        assert all(0 < d <= BOUND for d in delays), delays
        await _assert_vectors_match_chunks(svc, knowledge_stores, base)
        tasks = await _rows(
            svc, "SELECT status, count(*) AS n FROM tasks WHERE task_type = 'knowledge.ingest' GROUP BY status"
        )
        assert tasks == [{"status": "success", "n": FILES}], tasks
