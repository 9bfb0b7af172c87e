"""Evaluation datasets and runs brought into each of their states the way workers move them,
without Milvus or S3: a real task per dataset or run, a real claim, the store's fenced writes as the
owning attempt, and the task's terminal hook (which completes, fails or cancels the row). For the
dashboard tests, which show these states."""

from __future__ import annotations

import uuid
from typing import Any

from domains.evaluation import store
from domains.evaluation.tasks import GENERATE, RUN
from tasks_core.model import Status
from tasks_core.store.outcomes import Claim, NewTask


async def _claim(svc: Any, task_id: uuid.UUID) -> uuid.UUID:
    got = await svc.repo.claim(task_id, svc.registry, capacity=100, lease_seconds=60.0, worker="test")
    assert isinstance(got, Claim), got
    token: uuid.UUID = got.token
    return token


async def new_dataset(svc: Any, base_id: str, owner: str, target: int) -> tuple[str, uuid.UUID]:
    """A dataset as POST /evaluation/datasets leaves it: ``generating``, its task pending."""
    dataset_id = store.new_id()
    task = NewTask(GENERATE, 1, {"dataset_id": dataset_id}, timeout_seconds=3600, owner=owner)
    async with svc.engine.begin() as conn:
        task_id: uuid.UUID = (await svc.repo.insert(conn, task)).id
        await store.insert_dataset(conn, owner, base_id, target, task_id, dataset_id)
    return dataset_id, task_id


def _item(i: int, question: str | None = None) -> dict[str, Any]:
    return {
        "chunk_id": f"chunk-{i:05}",
        "ordinal": 0,
        "question": question or f"What does chunk {i} say?",
        "answer": f"chunk {i}'s words",
        "relevant_chunk_ids": [f"chunk-{i:05}"],
    }


async def generate(
    svc: Any, dataset_id: str, task_id: uuid.UUID, n: int, questions: tuple[str, ...] = ()
) -> uuid.UUID:
    """A worker claims the dataset's task and stores ``n`` items (it is still ``generating``); the
    first items' questions may be given."""
    token = await _claim(svc, task_id)
    async with svc.engine.begin() as conn:
        assert await store.claim_dataset(conn, dataset_id, task_id, token, "local")
        items = [_item(i, questions[i] if i < len(questions) else None) for i in range(n)]
        assert await store.add_items(conn, dataset_id, task_id, token, items) == n
    return token


async def finish(svc: Any, task_id: uuid.UUID, token: uuid.UUID, status: Status, message: str = "") -> None:
    """The task ends: its terminal hook completes (success) or stops the dataset or run."""
    error = None if status == Status.SUCCESS else {"code": "handler_error", "message": message}
    await svc.repo.finish(task_id, token, svc.registry, status=status, error=error)


async def completed_dataset(svc: Any, base_id: str, owner: str, n: int) -> tuple[str, uuid.UUID]:
    dataset_id, task_id = await new_dataset(svc, base_id, owner, n)
    await finish(svc, task_id, await generate(svc, dataset_id, task_id, n), Status.SUCCESS)
    return dataset_id, task_id


async def new_run(
    svc: Any, dataset_id: str, base_id: str, owner: str, total: int, top_k: int = 3
) -> tuple[str, uuid.UUID]:
    """A run as POST /evaluation/runs leaves it: ``running``, its task pending."""
    run_id = store.new_id()
    task = NewTask(RUN, 1, {"run_id": run_id}, timeout_seconds=3600, owner=owner)
    async with svc.engine.begin() as conn:
        task_id: uuid.UUID = (await svc.repo.insert(conn, task)).id
        await store.insert_run(
            conn,
            {
                "id": run_id,
                "owner": owner,
                "dataset_id": dataset_id,
                "base_id": base_id,
                "top_k": top_k,
                "items_total": total,
                "task_id": task_id,
            },
        )
    return run_id, task_id


async def evaluate(svc: Any, run_id: str, task_id: uuid.UUID, ranks: list[int | None]) -> uuid.UUID:
    """A worker claims the run's task and checkpoints one outcome per rank (None: a miss), items
    0, 1, ... in order; the run is still ``running``."""
    token = await _claim(svc, task_id)
    outcomes = [
        {
            "seq": seq,
            "hit": rank is not None,
            "rank": rank,
            "recall": 1.0 if rank is not None else 0.0,
            "retrieved_chunk_ids": ["chunk-x", "chunk-y"],
        }
        for seq, rank in enumerate(ranks)
    ]
    async with svc.engine.begin() as conn:
        assert await store.claim_run(conn, run_id, task_id, token)
        assert await store.add_outcomes(conn, run_id, task_id, token, outcomes) == len(ranks)
    return token
