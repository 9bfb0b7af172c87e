"""Crashed knowledge ingestion resumes by itself: real `celery worker` and `beat` processes, real
Milvus and S3. A SIGKILLed pool child, a SIGKILLed worker restarted under the same node name (as
`dtask dev` restarts it), and a warm shutdown, mid-ingest of 200 files: every file ends `indexed`
with exactly its chunk rows' vectors, no file ever shows an error state, and no person is involved.

The killed attempts are expired by their tokens long before their leases (60 s here) run out, and
a killed pool child's tasks are claimed again within two reconcile intervals: the worker's main
process expires them at once, the reconciler's next pass (within R) sends them back to pending with
a backoff (at most R/4 here), and the next relay publishes them once due. A protocol bound of the
intervals configured here, measured on PostgreSQL's clock (attempt rows).
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
from tests.system.conftest import SHUTDOWN_GRACE_SECONDS, Cluster, wait_for

pytestmark = pytest.mark.system

FILES = 200
SHUTDOWN_FILES = 40
CAPACITY = 4
RECONCILE_SECONDS = 2.0
# Far beyond the bound asserted: a recovery by the lease fails these tests.
LEASE_SECONDS = 60.0
# The first retry waits 0.25-0.5 s (half fixed, half jitter), well within a reconcile interval.
BACKOFF_SECONDS = 0.5
BOUND = 2 * RECONCILE_SECONDS
# An attempt holds its task's files (small files of one upload share a task) in indexing.
HELD_SQL = """SELECT a.worker, a.token, a.task_id, t.lease_expires_at
    FROM tasks t JOIN task_attempts a ON a.token = t.attempt_token
    WHERE t.status = 'running' AND t.task_type = 'knowledge.ingest' AND EXISTS (
        SELECT 1 FROM knowledge_files f WHERE f.attempt_token = t.attempt_token AND f.status = 'indexing')"""
CHUNKS_SQL = """SELECT f.file_id, f.chunk_count, count(c.*) AS n FROM knowledge_files f
    LEFT JOIN knowledge_chunks c ON c.file_id = f.file_id WHERE f.kb_id = :kb GROUP BY f.file_id"""
STATUSES_SQL = "SELECT status, count(*) AS n FROM knowledge_files WHERE kb_id = :kb GROUP BY status"
TASKS_SQL = "SELECT status, count(*) AS n FROM tasks WHERE task_type = 'knowledge.ingest' GROUP BY status"
FILE_TASKS_SQL = "SELECT count(DISTINCT task_id) AS n FROM knowledge_files WHERE kb_id = :kb"


@pytest.fixture(autouse=True)
def _small_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four files per ingest task (read by the in-process api): tasks enough that, once each
    process's first task has passed the gate, every slot holds one inside indexing."""
    monkeypatch.setenv("DTASK_KNOWLEDGE_FILES_PER_TASK", "4")


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


def _node(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"


def _files(n: int = FILES) -> list[tuple[str, bytes]]:
    return [(f"crash-{i:03d}.txt", f"file {i} about crash{i} and recovery".encode()) for i in range(n)]


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
    entered = Path(f"{gate}.entered")
    seen: set[Any] = set()

    async def full() -> list[dict[str, Any]] | None:
        if not await asyncio.to_thread(entered.exists):
            return None
        running = await _rows(svc, HELD_SQL)
        tokens = {r["token"] for r in running}
        stable = len(running) == CAPACITY and tokens == seen
        seen.clear()
        seen.update(tokens)
        return running if stable else None

    return await wait_for(full, within=90, interval=1.0, what=f"{CAPACITY} attempts held while indexing")


async def _all_indexed(svc: Any, base: str, procs: list[Any], files: int = FILES) -> None:
    """Every file `indexed` and every task ended; no file ever seen in an error state."""

    async def done() -> bool:
        for proc in procs:
            assert proc.alive(), f"{proc.name} exited"
        counts = {r["status"]: r["n"] for r in await _rows(svc, STATUSES_SQL, kb=base)}
        assert not {"error_parsing", "error_indexing"} & counts.keys(), counts
        if counts.get("indexed") != files:
            return False
        return not await _rows(svc, "SELECT id FROM tasks WHERE status IN ('pending', 'running')")

    await wait_for(done, within=180, interval=0.5, what=f"{files} files indexed")


async def _assert_complete(svc: Any, stores: dict[str, str], base: str, count: int = FILES) -> None:
    """Each file's vectors in Milvus are exactly its chunk rows; each file's task succeeded."""
    files = await _rows(svc, CHUNKS_SQL, kb=base)
    assert len(files) == count
    assert all(f["chunk_count"] == f["n"] > 0 for f in files), files
    client = milvus_client(stores)
    rows = await asyncio.to_thread(
        client.query, f"kb_{base}", filter='file_id != ""', output_fields=["file_id"], limit=16384,
        consistency_level="Strong",
    )
    vectors = Counter(r["file_id"] for r in rows)
    chunks = Counter({f["file_id"]: f["n"] for f in files})
    assert vectors == chunks, {f: (vectors[f], n) for f, n in chunks.items() if vectors[f] != n}
    [tasks] = await _rows(svc, FILE_TASKS_SQL, kb=base)
    assert await _rows(svc, TASKS_SQL) == [{"status": "success", "n": tasks["n"]}]


async def _claimed_again(svc: Any, held: list[dict[str, Any]], since: datetime, outcome: str) -> list[float]:
    """Each attempt of ``held`` (read before the kill, with its lease) ended with ``outcome`` before
    its lease ran out; the seconds from ``since`` to the claim of its task's next attempt."""
    delays = []
    for attempt in held:
        [ended] = await _rows(svc, "SELECT * FROM task_attempts WHERE token = :tok", tok=attempt["token"])
        [following] = await _rows(
            svc, "SELECT * FROM task_attempts WHERE task_id = :id AND attempt = :n",
            id=ended["task_id"], n=ended["attempt"] + 1,
        )
        early = (attempt["lease_expires_at"] - ended["ended_at"]).total_seconds()
        print(f"attempt {ended['token']} ended {ended['outcome']} {early:.2f} s before its lease's end")
        assert ended["outcome"] == outcome, ended
        assert early > 0, (ended, attempt)
        delays.append((following["claimed_at"] - since).total_seconds())
    return delays


async def test_sigkill_of_a_pool_child_mid_ingest_is_claimed_again_within_two_reconcile_intervals(
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
        delays = await _claimed_again(svc, mine, killed_at, "lease_expired")
        print(f"pool child {victim} SIGKILLed holding {len(mine)} attempt(s): claimed again "
              f"{', '.join(f'{d:.2f}' for d in delays)} s after the kill (bound {BOUND:g} s)")
        assert all(0 < d <= BOUND for d in delays), delays
        await _assert_complete(svc, knowledge_stores, base)


async def test_sigkill_of_a_worker_restarted_under_its_node_name_frees_its_slots_at_start_up(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    """As `dtask dev` does it: the worker's whole group is killed and the worker started again under
    the same node name; its new main process expires the dead incarnation's attempts before it
    takes any work. Another worker (the duties queue only) runs the reconciler meanwhile, as in any
    cluster of more than one worker."""
    gate = tmp_path / "embed-gate"
    gate.touch()
    env = _env(knowledge_stores, gate)
    node = _node("crash")
    first = cluster.harness.start_worker("worker-1", cluster.env(**env), node=node, concurrency=CAPACITY + 2)
    duties = cluster.harness.start_worker(
        "duties", cluster.env(**env), node=_node("duties"), concurrency=2, queues=("duties",)
    )
    beat = cluster.start_beat(**env)
    await cluster.wait_worker_ready(first)
    await cluster.wait_worker_ready(duties)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, _files())
        assert r.status_code == 202, r.text

        held = await _held(svc, gate)
        assert all(a["worker"].startswith(f"{node}:") for a in held), held
        first.killpg(signal.SIGKILL)
        assert first.wait_exit(10) == -signal.SIGKILL
        gate.unlink()
        restarted_at = await _pg_now(svc)
        second = cluster.harness.start_worker(
            "worker-2", cluster.env(**env), node=node, concurrency=CAPACITY + 2
        )

        await _all_indexed(svc, base, [second, duties, beat])
        # Each was expired by the restarted main process, long before its lease ran out, and sent
        # back to pending by the other worker's reconciler. When it runs again depends on the
        # restarted worker's own start-up (imports, forks), so that is reported, not bounded.
        delays = await _claimed_again(svc, held, restarted_at, "lease_expired")
        print(f"worker SIGKILLed holding {len(held)} attempts and restarted: claimed again "
              f"{', '.join(f'{d:.2f}' for d in delays)} s after the restart began")
        await _assert_complete(svc, knowledge_stores, base)


async def test_warm_shutdown_mid_ingest_hands_the_files_back_and_another_worker_indexes_them(
    cluster: Cluster, knowledge_stores: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM: each running ingest gets its grace, then goes back to pending (its file keeps its
    in-progress state, never `error_indexing`), and the next worker indexes it."""
    gate = tmp_path / "embed-gate"
    gate.touch()
    env = _env(knowledge_stores, gate)
    first = cluster.start_worker("worker-1", concurrency=CAPACITY + 2, cli=True, **env)
    beat = cluster.start_beat(**env)
    await cluster.wait_worker_ready(first)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, _files(SHUTDOWN_FILES))
        assert r.status_code == 202, r.text

        held = await _held(svc, gate)
        signalled_at = await _pg_now(svc)
        first.send(signal.SIGTERM)

        async def handed_back() -> bool:
            ended = await _rows(
                svc, "SELECT outcome FROM task_attempts WHERE token = ANY(:toks) AND ended_at IS NOT NULL",
                toks=[a["token"] for a in held],
            )
            return len(ended) == len(held)

        await wait_for(handed_back, within=SHUTDOWN_GRACE_SECONDS + 10, what="the held attempts handed back")
        # The handlers' embedding threads are still held: let them go so the children can exit.
        gate.unlink()
        assert first.wait_exit(timeout=30) == 0
        files = await _rows(svc, STATUSES_SQL, kb=base)
        assert not {"error_parsing", "error_indexing"} & {f["status"] for f in files}, files

        second = cluster.start_worker("worker-2", concurrency=CAPACITY + 2, **env)
        await _all_indexed(svc, base, [second, beat], SHUTDOWN_FILES)
        delays = await _claimed_again(svc, held, signalled_at, "worker_shutdown")
        print(f"warm shutdown: {len(held)} held attempts handed back, claimed again "
              f"{', '.join(f'{d:.2f}' for d in delays)} s after the SIGTERM")
        await _assert_complete(svc, knowledge_stores, base, SHUTDOWN_FILES)
