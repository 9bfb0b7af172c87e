"""Helpers for the knowledge tests: an in-process API on real stores, documents in every format,
and direct looks into PostgreSQL, Milvus and the bucket (what is really there, not what the API says).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from sqlalchemy import text

KEYS = "alice:alice-secret-0123456,bob:bob-secret-01234567,root:root-secret-0123456:admin"
ALICE = {"Authorization": "Bearer alice-secret-0123456"}
BOB = {"Authorization": "Bearer bob-secret-01234567"}
ROOT = {"Authorization": "Bearer root-secret-0123456"}
TERMINAL = ("success", "failed", "cancelled")


@asynccontextmanager
async def knowledge_api(**overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The real app (routes, Guard, limits) on the test database, Redis and stores, in this loop."""
    from app.main import create_app
    from tasks_core.services import build_services
    from tests.conftest import make_settings

    svc = build_services(make_settings(api_keys=KEYS, **overrides), pool_size=5)
    app = create_app(services=svc)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            yield client, svc
    finally:
        await svc.close()


async def create_base(
    client: httpx.AsyncClient, name: str | None = None, headers: dict[str, str] = ALICE
) -> str:
    r = await client.post(
        "/knowledge/bases", json={"name": name or f"base-{uuid.uuid4().hex[:8]}"}, headers=headers
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def upload(
    client: httpx.AsyncClient,
    base_id: str,
    files: Sequence[tuple[str, bytes]],
    headers: dict[str, str] = ALICE,
) -> httpx.Response:
    parts = [("files", (name, data, "application/octet-stream")) for name, data in files]
    return await client.post(f"/knowledge/bases/{base_id}/files", files=parts, headers=headers)


async def run_pending(svc: Any) -> list[str]:
    """Run every pending task in this process, oldest first, as a worker would (claim, run, finish);
    the final status of each, in that order. A task an earlier one's run went on to run itself
    (DTASK_WORKER_RUN_NEXT) is not run twice."""
    from tasks_core.worker.runtime import run_task

    outcomes = []
    while True:
        async with svc.engine.connect() as conn:
            ids = (
                (
                    await conn.execute(
                        text("SELECT id FROM tasks WHERE status = 'pending' ORDER BY created_at, id")
                    )
                )
                .scalars()
                .all()
            )
        if not ids:
            return outcomes
        for task_id in ids:
            if (await svc.repo.get(task_id))["status"] == "pending":
                await run_task(svc, str(task_id))
        outcomes += [(await svc.repo.get(task_id))["status"] for task_id in ids]


async def file_row(svc: Any, file_id: str) -> dict[str, Any]:
    async with svc.engine.connect() as conn:
        row = (
            (await conn.execute(text("SELECT * FROM knowledge_files WHERE file_id = :id"), {"id": file_id}))
            .mappings()
            .first()
        )
    assert row is not None, file_id
    return dict(row)


async def scalar(svc: Any, sql: str, **params: Any) -> Any:
    async with svc.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar()


def milvus_client(env: dict[str, str]) -> Any:
    from domains.knowledge.vectors import connect

    return connect(env["DTASK_MILVUS_URI"], timeout=5)


def vector_count(client: Any, base_id: str, file_id: str | None = None) -> int:
    """Vectors really in the base's collection (optionally one file's), read back from Milvus."""
    name = f"kb_{base_id}"
    if not client.has_collection(name):
        return 0
    rows = client.query(
        name,
        filter=f'file_id == "{file_id}"' if file_id else "",
        output_fields=["count(*)"],
        consistency_level="Strong",
    )
    return int(rows[0]["count(*)"])


def s3_client(env: dict[str, str]) -> Any:
    from minio import Minio

    return Minio(
        env["DTASK_MINIO_ENDPOINT"],
        env["DTASK_MINIO_ACCESS_KEY"],
        env["DTASK_MINIO_SECRET_KEY"],
        secure=False,
    )


def object_names(env: dict[str, str], prefix: str, bucket: str | None = None) -> list[str]:
    client = s3_client(env)
    bucket = bucket or env["DTASK_MINIO_BUCKET"]
    if not client.bucket_exists(bucket):
        return []
    return [o.object_name for o in client.list_objects(bucket, prefix=prefix, recursive=True)]


# ------------------------------------------------------------------------------------------------ documents


def paragraphs(words: Sequence[str], count: int, seed: int = 0) -> str:
    """``count`` paragraphs made from ``words`` (deterministic), separated by blank lines."""
    out = []
    for p in range(count):
        out.append(" ".join(words[(p * 7 + i * 3 + seed) % len(words)] for i in range(60)) + ".")
    return "\n\n".join(out)


def make_pdf(lines: Sequence[str]) -> bytes:
    """A minimal valid one-page PDF whose text pypdf extracts (Helvetica, one line per entry)."""

    def escape(s: str) -> str:
        return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    content = "BT /F1 11 Tf 50 760 Td 14 TL " + " ".join(f"({escape(line)}) '" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        "/Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    return pdf_of(objects)


def make_empty_pdf() -> bytes:
    """A well-formed PDF whose page tree is empty."""
    return pdf_of(["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [] /Count 0 >>"])


def pdf_of(objects: Sequence[str]) -> bytes:
    """A PDF of these objects (numbered from 1; the first is the catalog) with its xref table."""
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


async def lapse_and_reconcile(svc: Any, task_id: Any) -> Any:
    """The task's attempt falls silent (its lease ended a second ago), then one reconcile pass runs
    with no backoff; its report."""
    async with svc.engine.begin() as conn:
        await conn.execute(
            text("UPDATE tasks SET lease_expires_at = clock_timestamp() - interval '1 s' WHERE id = :id"),
            {"id": task_id},
        )
    return await svc.repo.reconcile(svc.registry, batch=10, retry_delay=lambda n: 0.0)
