"""The verifier against real PostgreSQL, Milvus and S3: every kind of disagreement made by hand in the
stores themselves, reported, repaired (re-queued files reindexed by a real run), then agreement."""

from __future__ import annotations

import asyncio
import io
import json
import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from domains.knowledge import verify as verifier
from domains.knowledge.catalog import new_id
from domains.knowledge.stores import stores_for
from tasks_core.ops.cli import cli
from tasks_core.settings import get_settings
from tests.knowledge_helpers import (
    create_base,
    file_row,
    knowledge_api,
    milvus_client,
    object_names,
    run_pending,
    s3_client,
    scalar,
    upload,
    vector_count,
)

pytestmark = pytest.mark.usefixtures("clean_db")


def _vectors(n: int) -> list[list[float]]:
    return [[random.random() for _ in range(1024)] for _ in range(n)]


def dtask(*args: str) -> Any:
    # The command reads this process's settings, cached by whichever test first asked for them:
    # read them afresh, with the stores the session exported since.
    get_settings.cache_clear()
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


async def test_the_verifier_finds_each_disagreement_and_repair_restores_agreement(
    knowledge_stores: dict[str, str],
) -> None:
    env, bucket = knowledge_stores, knowledge_stores["DTASK_MINIO_BUCKET"]
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        docs = [(f"doc{i}.txt", f"document {i} about subject{i}. ".encode() * 60) for i in range(4)]
        entries = (await upload(client, base, docs)).json()["files"]
        files = [f["id"] for f in entries]
        assert await run_pending(svc) == ["success"] * len({f["task_id"] for f in entries})
        # Earlier tests' bases left collections and objects in the shared stores (their rows were
        # truncated): the sweep of deleted bases clears those first.
        await verifier.verify(svc, repair=True)
        assert (await verifier.verify(svc)).agrees

        lost_vectors, lost_original, failed, _agreeing = files
        milvus, s3 = milvus_client(env), s3_client(env)
        collection = f"kb_{base}"
        milvus.delete(collection, filter=f'file_id == "{lost_vectors}"')  # acknowledged vectors gone
        s3.remove_object(bucket, f"{base}/{lost_original}")
        # A failed attempt's leftovers: the file ended error_indexing with chunks and vectors.
        async with svc.engine.begin() as conn:
            await conn.execute(
                text("UPDATE knowledge_files SET status = 'error_indexing' WHERE file_id = :id"),
                {"id": failed},
            )
        ghost = new_id()  # vectors and an object of a file that no longer exists
        milvus.upsert(collection, [{"chunk_id": f"{ghost}-0", "file_id": ghost, "vector": _vectors(1)[0]}])
        s3.put_object(bucket, f"{base}/{ghost}", io.BytesIO(b"orphan"), 6)
        gone_base = new_id()  # a collection and objects of a base that no longer exists
        milvus.create_collection(f"kb_{gone_base}", dimension=8)
        s3.put_object(bucket, f"{gone_base}/{new_id()}", io.BytesIO(b"orphan"), 6)

        report = await verifier.verify(svc, object_grace=timedelta(0))
        assert not report.agrees
        [checked] = report.bases
        problems = {v.file_id: v.problem for v in checked.problems}
        assert problems == {
            lost_vectors: "chunks and vectors disagree",
            lost_original: "original missing",
            failed: "leftovers of a failed attempt",
        }
        assert checked.agreeing == 1 and checked.files == 4
        assert (checked.stray_vectors, checked.stray_objects) == (1, 1)
        assert (report.stray_collections, report.stray_prefixes) == (1, 1)
        # The same, from the operator's command (no repair: exit 1, nothing changed). The command
        # runs its own event loop, so it gets a thread of its own here.
        out = await asyncio.to_thread(dtask, "kb", "verify", base, "--json")
        assert out.exit_code == 1 and out.stdout, out.output  # no report: the error says why
        assert {v["file_id"] for v in json.loads(out.stdout)["bases"][0]["problems"]} == set(problems)
        assert vector_count(milvus, base, lost_vectors) == 0  # nothing repaired yet

        repaired = await verifier.verify(svc, repair=True, object_grace=timedelta(0))
        actions = {v.file_id: v.action for v in repaired.bases[0].problems}
        assert actions[lost_vectors].startswith("re-queued as task ")
        assert actions[lost_original] == "marked error_parsing, chunks and vectors removed"
        assert actions[failed] == "chunks and vectors removed"
        assert await run_pending(svc) == ["success"]  # the re-queued file's reindex

        row = await file_row(svc, lost_vectors)
        assert row["status"] == "indexed"
        assert vector_count(milvus, base, lost_vectors) == row["chunk_count"] > 0
        row = await file_row(svc, lost_original)
        assert row["status"] == "error_parsing" and row["error_message"] == verifier.LOST_ORIGINAL
        for fid in (lost_original, failed, ghost):
            assert vector_count(milvus, base, fid) == 0
            assert await scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=fid) == 0
        assert f"{base}/{ghost}" not in object_names(env, f"{base}/")
        assert not milvus.has_collection(f"kb_{gone_base}")
        assert object_names(env, f"{gone_base}/") == []
        assert (await verifier.verify(svc, object_grace=timedelta(0))).agrees


async def test_young_objects_are_left_to_the_upload_that_is_putting_them(
    knowledge_stores: dict[str, str],
) -> None:
    env, bucket = knowledge_stores, knowledge_stores["DTASK_MINIO_BUCKET"]
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        await stores_for(svc.settings).objects()  # the bucket exists from here on
        pending = new_id()
        s3_client(env).put_object(bucket, f"{base}/{pending}", io.BytesIO(b"just put"), 8)
        report = await verifier.verify(svc, repair=True)
        assert report.bases[0].stray_objects == 0
        assert f"{base}/{pending}" in object_names(env, f"{base}/")


async def test_the_duty_checks_a_share_of_the_bases_per_run_and_continues_where_it_stopped(
    knowledge_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verifier, "DUTY_BASES", 2)
    async with knowledge_api() as (client, svc):
        bases = sorted([await create_base(client) for _ in range(3)])
        await svc.redis.delete(verifier.CURSOR_KEY)
        first = await verifier.duty(svc)
        assert first["bases"] == 2 and (await svc.redis.get(verifier.CURSOR_KEY)).decode() == bases[1]
        second = await verifier.duty(svc)
        assert second["bases"] == 1 and (await svc.redis.get(verifier.CURSOR_KEY)) == b""


async def test_a_file_that_arrives_while_its_base_is_checked_is_not_taken_for_a_stray(
    knowledge_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier reads a base's rows, then scans its collection: a file uploaded and indexed in
    between has vectors but was not among the rows. Its vectors must stay."""
    from domains.knowledge import catalog

    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [("new.txt", b"a file that arrives late. " * 40)])
        entry = r.json()["files"][0]
        assert await run_pending(svc) == ["success"]
        read = catalog.files_to_verify

        async def read_before_the_upload(conn: Any, base_id: str) -> list[dict[str, Any]]:
            return [r for r in await read(conn, base_id) if r["file_id"] != entry["id"]]

        monkeypatch.setattr(catalog, "files_to_verify", read_before_the_upload)
        report = await verifier.verify(svc, base_id=base, repair=True, object_grace=timedelta(0))
        assert (report.bases[0].stray_vectors, report.bases[0].stray_objects) == (0, 0)
        chunks = (await file_row(svc, entry["id"]))["chunk_count"]
        assert vector_count(milvus_client(knowledge_stores), base, entry["id"]) == chunks > 0
        assert object_names(knowledge_stores, f"{base}/") == [f"{base}/{entry['id']}"]
