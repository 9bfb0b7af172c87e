"""/knowledge end to end in one process: the real app, PostgreSQL, Redis, a milvus-lite server and
SeaweedFS S3 over HTTP; tasks are claimed and run by the real runtime (``run_task``), no worker."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import pytest

from domains.knowledge import catalog
from tests.knowledge_helpers import (
    ALICE,
    BOB,
    ROOT,
    create_base,
    file_row,
    knowledge_api,
    lapse_and_reconcile,
    make_pdf,
    milvus_client,
    object_names,
    run_pending,
    s3_client,
    scalar,
    upload,
    vector_count,
)

pytestmark = pytest.mark.usefixtures("clean_db")

WORDS = {
    "txt": ["quokka", "marsupial", "rottnest", "island", "herbivore", "nocturnal", "smiling", "burrow"],
    "md": ["zephyr", "glacier", "moraine", "crevasse", "serac", "icefall", "firn", "ablation"],
    "html": ["basalt", "columnar", "lava", "jointing", "causeway", "hexagonal", "cooling", "fissure"],
    "pdf": ["lighthouse", "keeper", "fresnel", "lantern", "foghorn", "beacon", "mariner", "shoal"],
}
FILLER = ["the", "and", "of", "a", "to", "in", "is", "it", "with", "for"]


def sentence(words: list[str], n: int = 40, seed: int = 0) -> str:
    pool = words + FILLER
    return " ".join(pool[(i * 5 + seed) % len(pool)] for i in range(n))


def documents() -> dict[str, tuple[str, bytes]]:
    text = "\n\n".join(sentence(WORDS["txt"], seed=s) for s in range(3))
    md = "# Glaciers\n\n" + "\n\n".join(f"- {sentence(WORDS['md'], seed=s)}" for s in range(3))
    html = (
        "<html><head><title>Basalt</title><style>.hidden { color: red }</style>"
        "<script>var scriptonlyword = 'never indexed';</script></head><body>"
        + "".join(f"<p>{sentence(WORDS['html'], seed=s)}</p>" for s in range(3))
        + "<noscript>noscriptonlyword</noscript></body></html>"
    )
    pdf = make_pdf([sentence(WORDS["pdf"], n=12, seed=s) for s in range(8)])
    return {
        "txt": ("notes.txt", text.encode()),
        "md": ("guide.md", md.encode()),
        "html": ("page.html", html.encode()),
        "pdf": ("manual.pdf", pdf),
    }


async def test_every_format_is_indexed_and_its_words_find_it_first(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        docs = documents()
        r = await upload(client, base, list(docs.values()))
        assert r.status_code == 202, r.text
        files = r.json()["files"]
        assert [f["filename"] for f in files] == [name for name, _ in docs.values()]
        assert all(f["status"] == "uploaded" and f["task_id"] for f in files)
        by_type = {t: f["id"] for t, f in zip(docs, files, strict=True)}

        # Small files of one request share tasks (at least as many as the owner may run at once).
        assert await run_pending(svc) == ["success"] * len({f["task_id"] for f in files})
        for file_type, file_id in by_type.items():
            shown = (await client.get(f"/knowledge/files/{file_id}", headers=ALICE)).json()
            assert shown["status"] == "indexed", shown
            assert shown["error_message"] is None and shown["chunk_count"] >= 1
            assert shown["task_id"] == next(f["task_id"] for f in files if f["id"] == file_id)
            task = (await client.get(f"/tasks/{shown['task_id']}", headers=ALICE)).json()
            assert task["status"] == "success" and task["task_type"] == "knowledge.ingest"
            # Every vector of the file is in Milvus, once.
            assert vector_count(milvus_client(knowledge_stores), base, file_id) == shown["chunk_count"]

            query = " ".join(WORDS[file_type][:5])
            r = await client.post(
                f"/knowledge/bases/{base}/search", json={"query": query, "top_k": 3}, headers=ALICE
            )
            assert r.status_code == 200, r.text
            hits = r.json()["hits"]
            assert hits and hits[0]["file_id"] == file_id, (file_type, hits)
            assert WORDS[file_type][0] in hits[0]["text"] and 0 < hits[0]["score"] <= 1.0001

        # Scripts, styles and noscript never became text.
        async with svc.engine.connect() as conn:
            from sqlalchemy import text

            html_text = " ".join(
                (
                    await conn.execute(
                        text("SELECT text FROM knowledge_chunks WHERE file_id = :id"), {"id": by_type["html"]}
                    )
                ).scalars()
            )
        assert "basalt" in html_text and "Basalt" in html_text
        for hidden in ("scriptonlyword", "color: red", "noscriptonlyword"):
            assert hidden not in html_text
        # The base lists its files, counted by status.
        listed = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()
        assert {f["id"] for f in listed["items"]} == set(by_type.values())
        shown_base = (await client.get(f"/knowledge/bases/{base}", headers=ALICE)).json()
        assert shown_base["file_counts"] == {"indexed": 4}


async def test_only_the_request_itself_is_refused(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api(max_upload_request_bytes=50_000, max_upload_files=10) as (client, svc):
        base = await create_base(client)
        ok = ("ok.txt", b"fine words here")

        r = await upload(client, base, [(f"f{i}.txt", b"y" * 1500) for i in range(120)])  # 180 kB body
        assert r.status_code == 413 and r.json()["detail"] == "request body too large"
        r = await upload(client, base, [(f"f{i}.txt", b"y") for i in range(11)])
        assert r.status_code == 422 and "at most 10 files" in r.json()["detail"][0]["msg"]
        r = await client.post(
            f"/knowledge/bases/{base}/files", files={"other": ("a.txt", b"x")}, headers=ALICE
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "files"]  # no files
        for body, kind in ((b"{}", "application/json"), (b"words", "text/plain")):
            r = await client.post(
                f"/knowledge/bases/{base}/files", content=body, headers={**ALICE, "content-type": kind}
            )
            assert r.status_code == 415 and "multipart/form-data" in r.json()["detail"], r.text
        # Nothing of the refused requests was stored: no rows, no tasks, no objects.
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 0
        assert await scalar(svc, "SELECT count(*) FROM tasks") == 0
        assert object_names(knowledge_stores, f"{base}/") == []

        unknown = uuid.uuid4().hex
        assert (await upload(client, unknown, [ok])).status_code == 404
        assert (
            await client.post(f"/knowledge/bases/{unknown}/search", json={"query": "x"}, headers=ALICE)
        ).status_code == 404
        assert (await upload(client, "not-a-base-id", [ok])).status_code == 422

        # Another owner's base does not exist for you; an admin sees it.
        assert (await upload(client, base, [ok], headers=BOB)).status_code == 404
        for method, path in (
            ("GET", f"/knowledge/bases/{base}"),
            ("GET", f"/knowledge/bases/{base}/files"),
            ("DELETE", f"/knowledge/bases/{base}"),
            ("POST", f"/knowledge/bases/{base}/reindex-pending"),
        ):
            assert (await client.request(method, path, headers=BOB)).status_code == 404, path
        assert (await client.get("/knowledge/bases", headers=BOB)).json()["items"] == []
        assert [b["id"] for b in (await client.get("/knowledge/bases", headers=ROOT)).json()["items"]] == [
            base
        ]
        assert (await client.post("/knowledge/bases", json={"name": "dup"}, headers=ALICE)).status_code == 201
        assert (await client.post("/knowledge/bases", json={"name": "dup"}, headers=ALICE)).status_code == 409
        assert (await client.post("/knowledge/bases", json={"name": "dup"}, headers=BOB)).status_code == 201


async def test_bad_files_never_refuse_the_good_ones(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api(max_upload_bytes=2000) as (client, svc):
        base = await create_base(client)
        sent = [
            ("good.txt", b"quokka marsupial rottnest island words"),
            ("empty.txt", b""),
            ("tool.exe", b"MZ\x90\x00binary"),
            ("README", b"no extension at all"),
            ("big.txt", b"x" * 2001),
            ("guide.md", b"# Glaciers\n\nzephyr glacier moraine crevasse"),
            # Accepted, but nothing to read: their tasks end them error_parsing saying why.
            ("blank.txt", b"  \n\n \t "),
            ("broken.pdf", b"%PDF-1.4\nthis is not a pdf at all"),
            ("scripts.html", b"<script>only code</script>"),
        ]
        r = await upload(client, base, sent)
        assert r.status_code == 202, r.text
        entries = {e["filename"]: e for e in r.json()["files"]}
        assert [e["filename"] for e in r.json()["files"]] == [name for name, _ in sent]
        refused = {
            "empty.txt": "the file is empty",
            "tool.exe": "not a supported file type: .exe files are not read",
            "README": "a file with no extension is not read",
            "big.txt": "over the 2,000-byte limit per file (DTASK_MAX_UPLOAD_BYTES)",
        }
        for name, why in refused.items():
            e = entries[name]
            assert e["status"] == "error_parsing" and e["task_id"] is None and why in e["error_message"], e
            row = await file_row(svc, e["id"])
            assert row["status"] == "error_parsing" and why in row["error_message"]
            assert row["content_hash"] is None and row["task_id"] is None
        assert (await file_row(svc, entries["tool.exe"]["id"]))["file_type"] == "other"
        assert (await file_row(svc, entries["big.txt"]["id"]))["size_bytes"] == 2001
        kept = [n for n in entries if n not in refused]
        assert all(entries[n]["status"] == "uploaded" and entries[n]["task_id"] for n in kept)
        # Only the kept files have a task (small files of one request share one) and an original.
        tasks = {entries[n]["task_id"] for n in kept}
        assert await scalar(svc, "SELECT count(*) FROM tasks") == len(tasks) < len(kept)
        assert sorted(object_names(knowledge_stores, f"{base}/")) == sorted(
            f"{base}/{entries[n]['id']}" for n in kept
        )

        unreadable_tasks = {entries[n]["task_id"] for n in ("blank.txt", "broken.pdf", "scripts.html")}
        assert sorted(await run_pending(svc)) == sorted(
            "failed" if t in unreadable_tasks else "success" for t in tasks
        )
        unreadable = {
            "blank.txt": "no text found",
            "broken.pdf": "not a readable PDF",
            "scripts.html": "no text",
        }
        for name, why in unreadable.items():
            row = await file_row(svc, entries[name]["id"])
            assert row["status"] == "error_parsing" and why in row["error_message"], row
            task = await scalar(svc, "SELECT error FROM tasks WHERE id = :id", id=entries[name]["task_id"])
            assert task["code"] == "handler_error" and why in task["message"]
        for name in ("good.txt", "guide.md"):
            assert (await file_row(svc, entries[name]["id"]))["status"] == "indexed"

        # Every file is in the list with its reason; the refused ones are shown like any other.
        listed = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()["items"]
        assert {f["filename"]: f["status"] for f in listed} == {
            **{n: "error_parsing" for n in [*refused, *unreadable]},
            "good.txt": "indexed",
            "guide.md": "indexed",
        }
        shown = (await client.get(f"/knowledge/files/{entries['tool.exe']['id']}", headers=ALICE)).json()
        assert shown["file_type"] == "other" and refused["tool.exe"] in shown["error_message"]
        counts = (await client.get(f"/knowledge/bases/{base}", headers=ALICE)).json()["file_counts"]
        assert counts == {"error_parsing": 7, "indexed": 2}

        # Nothing to parse in a refused file: a reindex of it is refused, and reindex-pending takes
        # only the files that were kept.
        r = await client.post(f"/knowledge/files/{entries['empty.txt']['id']}/reindex", headers=ALICE)
        assert r.status_code == 409 and "refused at upload" in r.json()["detail"], r.text
        r = await client.post(f"/knowledge/bases/{base}/reindex-pending", headers=ALICE)
        assert r.status_code == 202, r.text
        assert sorted(f["filename"] for f in r.json()["files"]) == sorted(unreadable)
        assert await run_pending(svc) == ["success"]

        # A refused file is deleted like any other.
        for name in refused:
            assert (
                await client.delete(f"/knowledge/files/{entries[name]['id']}", headers=ALICE)
            ).status_code == 204
        listed = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()["items"]
        assert sorted(f["filename"] for f in listed) == sorted(["good.txt", "guide.md", *unreadable])


# Every bidirectional control: embeddings, overrides, isolates and marks.
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


async def test_bidirectional_controls_are_stripped_from_filenames(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        # Shown as is, "invoice\u202etxt.md" reads "invoicedm.txt"; the controls are dropped.
        files = [("invoice\u202etxt.md", b"words"), (f"no{BIDI}tes.txt", b"more words")]
        r = await upload(client, base, files)
        assert r.status_code == 202, r.text
        assert [f["filename"] for f in r.json()["files"]] == ["invoicetxt.md", "notes.txt"]
        for entry in r.json()["files"]:
            row = await file_row(svc, entry["id"])
            assert row["filename"] == entry["filename"] and row["file_type"] in ("md", "txt")
        listed = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()["items"]
        assert sorted(f["filename"] for f in listed) == ["invoicetxt.md", "notes.txt"]

        # A name of nothing but controls is no name; nothing of that request is stored.
        r = await upload(client, base, [("ok.txt", b"fine"), (BIDI, b"words")])
        assert r.status_code == 422 and "needs a name" in r.json()["detail"][0]["msg"], r.text
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 2


async def test_delete_base_whose_collection_and_objects_are_gone(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [("a.txt", b"alpha beta gamma"), ("b.md", b"# delta\n\nepsilon")])
        assert await run_pending(svc) == ["success", "success"]
        milvus, s3 = milvus_client(knowledge_stores), s3_client(knowledge_stores)
        assert vector_count(milvus, base) == 2 and len(object_names(knowledge_stores, f"{base}/")) == 2
        # Gone behind our back.
        milvus.drop_collection(f"kb_{base}")
        for name in object_names(knowledge_stores, f"{base}/"):
            s3.remove_object(knowledge_stores["DTASK_MINIO_BUCKET"], name)

        assert (await client.delete(f"/knowledge/bases/{base}", headers=ALICE)).status_code == 204
        assert not milvus.has_collection(f"kb_{base}")
        assert object_names(knowledge_stores, f"{base}/") == []
        for table in ("knowledge_bases", "knowledge_files", "knowledge_chunks"):
            assert await scalar(svc, f"SELECT count(*) FROM {table}") == 0, table
        assert (await client.get(f"/knowledge/bases/{base}", headers=ALICE)).status_code == 404
        assert (await client.delete(f"/knowledge/bases/{base}", headers=ALICE)).status_code == 404
        assert {f["id"] for f in r.json()["files"]}  # (the files existed)


async def test_delete_base_when_the_whole_bucket_is_gone(knowledge_stores: dict[str, str]) -> None:
    bucket = f"dtask-gone-{uuid.uuid4().hex[:8]}"
    async with knowledge_api(minio_bucket=bucket) as (client, svc):
        base = await create_base(client)
        assert (await upload(client, base, [("a.txt", b"alpha")])).status_code == 202
        s3 = s3_client(knowledge_stores)
        for name in object_names(knowledge_stores, "", bucket):
            s3.remove_object(bucket, name)
        s3.remove_bucket(bucket)
        assert (await client.delete(f"/knowledge/bases/{base}", headers=ALICE)).status_code == 204
        assert not s3.bucket_exists(bucket)
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 0
        # The pending ingest task was cancelled with its base.
        assert await scalar(svc, "SELECT status FROM tasks") == "cancelled"


async def test_delete_file_takes_its_vectors_chunks_and_object(knowledge_stores: dict[str, str]) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [("keep.txt", b"keep these words"), ("drop.txt", b"drop those words")])
        keep, drop = (f["id"] for f in r.json()["files"])
        await run_pending(svc)
        milvus = milvus_client(knowledge_stores)
        assert (await client.delete(f"/knowledge/files/{drop}", headers=BOB)).status_code == 404
        assert (await client.delete(f"/knowledge/files/{drop}", headers=ALICE)).status_code == 204
        assert vector_count(milvus, base, drop) == 0 and vector_count(milvus, base, keep) == 1
        assert object_names(knowledge_stores, f"{base}/") == [f"{base}/{keep}"]
        assert await scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=drop) == 0
        assert (await client.get(f"/knowledge/files/{drop}", headers=ALICE)).status_code == 404
        hits = (
            await client.post(
                f"/knowledge/bases/{base}/search", json={"query": "drop those words"}, headers=ALICE
            )
        ).json()["hits"]
        assert {h["file_id"] for h in hits} == {keep}


async def test_a_lower_upload_limit_later_leaves_accepted_files_reindexable(
    knowledge_stores: dict[str, str],
) -> None:
    """Refused is what the upload recorded, not a reading of today's limit: an operator who lowers
    DTASK_MAX_UPLOAD_BYTES does not turn the files already kept into refused ones."""
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [("long.txt", b"heron estuary tide " * 200)])
        file_id = r.json()["files"][0]["id"]
        assert await run_pending(svc) == ["success"]
    async with knowledge_api(max_upload_bytes=100) as (client, svc):
        r = await client.post(f"/knowledge/files/{file_id}/reindex", headers=ALICE)
        assert r.status_code == 202, r.text
        assert await run_pending(svc) == ["success"]
        assert (await file_row(svc, file_id))["status"] == "indexed"


async def test_reindex_file_and_reindex_pending_deduplicated_per_base(
    knowledge_stores: dict[str, str],
) -> None:
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(
            client, base, [("good.txt", b"solid words"), ("bad1.txt", b"   "), ("bad2.pdf", b"%PDF-x")]
        )
        good, bad1, bad2 = (f["id"] for f in r.json()["files"])
        # While the ingest task is pending, a reindex is refused and names the active task.
        r409 = await client.post(f"/knowledge/files/{good}/reindex", headers=ALICE)
        assert r409.status_code == 409 and r409.json()["task_id"] == str(
            (await file_row(svc, good))["task_id"]
        )
        await run_pending(svc)
        assert [(await file_row(svc, f))["status"] for f in (good, bad1, bad2)] == [
            "indexed",
            "error_parsing",
            "error_parsing",
        ]

        r = await client.post(f"/knowledge/bases/{base}/reindex-pending", headers=ALICE)
        assert r.status_code == 202, r.text
        task_id = r.json()["task_id"]
        assert {f["id"] for f in r.json()["files"]} == {bad1, bad2}
        assert all(f["status"] == "uploaded" and f["task_id"] == task_id for f in r.json()["files"])
        again = await client.post(f"/knowledge/bases/{base}/reindex-pending", headers=ALICE)
        assert again.status_code == 409 and again.json()["task_id"] == task_id
        assert await run_pending(svc) == ["success"]
        result = await scalar(svc, "SELECT result FROM tasks WHERE id = :id", id=task_id)
        assert result["files"] == 2 and result["indexed"] == 0 and set(result["errors"]) == {bad1, bad2}
        assert (await file_row(svc, bad1))["status"] == "error_parsing"

        # One file again: a new task, new chunks, the same number of vectors (replaced, not added).
        milvus = milvus_client(knowledge_stores)
        before = vector_count(milvus, base, good)
        r = await client.post(f"/knowledge/files/{good}/reindex", headers=ALICE)
        assert r.status_code == 202 and r.json()["status"] == "uploaded"
        assert await run_pending(svc) == ["success"]
        row = await file_row(svc, good)
        assert row["status"] == "indexed" and str(row["task_id"]) == r.json()["task_id"]
        assert vector_count(milvus, base, good) == before == row["chunk_count"]

        # Nothing left to do (the errored files' reindex task is finished, they stay errored).
        await client.delete(f"/knowledge/files/{bad1}", headers=ALICE)
        await client.delete(f"/knowledge/files/{bad2}", headers=ALICE)
        r = await client.post(f"/knowledge/bases/{base}/reindex-pending", headers=ALICE)
        assert r.status_code == 200 and r.json() == {"task_id": None, "files": []}


async def test_routes_answer_503_naming_missing_or_unreachable_stores(
    knowledge_stores: dict[str, str],
) -> None:
    from tasks_core.devkit.embedded import free_port

    async with knowledge_api(milvus_uri=None, minio_endpoint=None) as (client, _svc):
        r = await client.get("/knowledge/bases", headers=ALICE)
        assert r.status_code == 503
        assert "DTASK_MILVUS_URI" in r.json()["detail"] and "DTASK_MINIO_ENDPOINT" in r.json()["detail"]
        assert (
            await client.post("/tasks", json={"task_type": "diagnostics.noop"}, headers=ROOT)
        ).status_code == 202
        facts = (await client.get("/readyz")).json()["facts"]
        assert facts["milvus"]["ok"] and "not configured" in facts["milvus"]["detail"]
        assert facts["object_store"]["ok"] and "not configured" in facts["object_store"]["detail"]

    dead = f"http://127.0.0.1:{free_port()}"
    async with knowledge_api(milvus_uri=dead) as (client, _svc):
        r = await client.post("/knowledge/bases", json={"name": "x"}, headers=ALICE)
        assert r.status_code == 503 and "Milvus is not reachable" in r.json()["detail"], r.text
        assert r.headers["retry-after"]
        assert (await client.get("/knowledge/bases", headers=ALICE)).status_code == 200  # PostgreSQL only
        r = await client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["facts"]["milvus"]["ok"] is False and r.json()["facts"]["object_store"]["ok"] is True
        assert (await client.get("/tasks", headers=ALICE)).status_code == 200


async def test_an_upload_over_the_owners_pending_quota_stores_nothing(
    knowledge_stores: dict[str, str],
) -> None:
    # The quota counts tasks: five files of one request make two (the owner runs two at once).
    async with knowledge_api(owner_max_pending=1) as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [(f"f{i}.txt", b"words %d" % i) for i in range(5)])
        assert r.status_code == 429 and "DTASK_OWNER_MAX_PENDING" in r.json()["detail"]
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 0
        assert await scalar(svc, "SELECT count(*) FROM tasks") == 0
        assert object_names(knowledge_stores, f"{base}/") == []  # the originals were taken back
        assert (await upload(client, base, [("f0.txt", b"words 0")])).status_code == 202


async def test_a_reindex_removes_the_vectors_past_the_files_last_chunk_by_id(
    knowledge_stores: dict[str, str],
) -> None:
    """Chunk ids are <file>-<seq>: a reindex overwrites every vector it has a chunk for, and
    removes the ones past its last chunk (an earlier version's) by id, not by a scan of the base."""
    import random

    from sqlalchemy import text

    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        entry = (await upload(client, base, [("doc.txt", b"some words here. " * 200)])).json()["files"][0]
        assert await run_pending(svc) == ["success"]
        file_id = entry["id"]
        chunks = (await file_row(svc, file_id))["chunk_count"]
        milvus = milvus_client(knowledge_stores)
        # As if an earlier version of the file had three chunks more: their rows and vectors.
        extra = [f"{file_id}-{seq}" for seq in range(chunks, chunks + 3)]
        vectors = [[random.random() for _ in range(1024)] for _ in extra]
        rows = [{"chunk_id": c, "file_id": file_id, "vector": v} for c, v in zip(extra, vectors, strict=True)]
        milvus.upsert(f"kb_{base}", rows)
        async with svc.engine.begin() as conn:
            token = (await conn.execute(text("SELECT attempt_token FROM knowledge_chunks LIMIT 1"))).scalar()
            for seq, chunk_id in enumerate(extra, chunks):
                await conn.execute(
                    text("INSERT INTO knowledge_chunks VALUES (:c, :f, :s, 'old text', :t)"),
                    {"c": chunk_id, "f": file_id, "s": seq, "t": token},
                )
        assert vector_count(milvus, base, file_id) == chunks + 3

        assert (await client.post(f"/knowledge/files/{file_id}/reindex", headers=ALICE)).status_code == 202
        assert await run_pending(svc) == ["success"]
        assert vector_count(milvus, base, file_id) == chunks == (await file_row(svc, file_id))["chunk_count"]
        rows_left = await scalar(svc, "SELECT count(*) FROM knowledge_chunks WHERE file_id = :id", id=file_id)
        assert rows_left == chunks


async def _chunk_tokens(svc: Any, file_id: str) -> list[Any]:
    from sqlalchemy import text

    async with svc.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT attempt_token FROM knowledge_chunks WHERE file_id = :id ORDER BY seq"),
            {"id": file_id},
        )
        return list(rows.scalars())


async def test_the_same_content_again_is_the_same_file(knowledge_stores: dict[str, str]) -> None:
    data = b"quokka marsupial rottnest island herbivore nocturnal words " * 30
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        [first] = (await upload(client, base, [("notes.txt", data)])).json()["files"]
        assert "duplicate_of" not in first or first["duplicate_of"] is None
        assert await run_pending(svc) == ["success"]
        row = await file_row(svc, first["id"])
        assert row["content_hash"] == hashlib.sha256(data).hexdigest() and row["status"] == "indexed"
        tokens = await _chunk_tokens(svc, first["id"])

        # Again, under another name, beside a new file and with a twin of its own in the request.
        other = b"zephyr glacier moraine crevasse serac icefall"
        r = await upload(client, base, [("copy.md", data), ("new.txt", other), ("copy2.txt", data)])
        assert r.status_code == 202, r.text
        copy, new, copy2 = r.json()["files"]
        for dup, name in ((copy, "copy.md"), (copy2, "copy2.txt")):
            assert dup["duplicate_of"] == dup["id"] == first["id"], dup
            assert dup["filename"] == name  # as sent, so a client can match its entries
            assert dup["status"] == "indexed" and dup["task_id"] == first["task_id"]
        assert new.get("duplicate_of") is None and new["status"] == "uploaded" and new["task_id"]
        # Nothing stored twice, nothing indexed again: one new task, two rows, two originals.
        assert await scalar(svc, "SELECT count(*) FROM tasks") == 2
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 2
        assert sorted(object_names(knowledge_stores, f"{base}/")) == sorted(
            f"{base}/{fid}" for fid in (first["id"], new["id"])
        )
        assert await run_pending(svc) == ["success"]
        assert await _chunk_tokens(svc, first["id"]) == tokens  # its chunks were not rewritten
        assert vector_count(milvus_client(knowledge_stores), base, first["id"]) == row["chunk_count"]

        # The same bytes in another base are that base's own file.
        other_base = await create_base(client)
        [elsewhere] = (await upload(client, other_base, [("notes.txt", data)])).json()["files"]
        assert elsewhere.get("duplicate_of") is None and elsewhere["id"] != first["id"]

        # To replace a file: delete it, then upload.
        assert (await client.delete(f"/knowledge/files/{first['id']}", headers=ALICE)).status_code == 204
        [again] = (await upload(client, base, [("notes.txt", data)])).json()["files"]
        assert again.get("duplicate_of") is None and again["id"] != first["id"]
        assert await run_pending(svc) == ["success", "success"]
        assert (await file_row(svc, again["id"]))["status"] == "indexed"


async def test_concurrent_uploads_of_the_same_content_end_as_one_file(
    knowledge_stores: dict[str, str],
) -> None:
    one = b"lighthouse keeper fresnel lantern foghorn beacon " * 50
    two = b"basalt columnar lava jointing causeway hexagonal " * 50

    def files(i: int) -> list[tuple[str, bytes]]:
        # Half the requests send the shared files in the other order.
        shared = [(f"one-{i}.txt", one), (f"two-{i}.txt", two)]
        return [*(shared if i % 2 else shared[::-1]), (f"own{i}.txt", b"own words %d" % i)]

    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        answers = await asyncio.gather(*(upload(client, base, files(i)) for i in range(8)))
        assert [a.status_code for a in answers] == [202] * 8, [a.text for a in answers]
        for data in (one, two):
            name = "one" if data is one else "two"
            copies = [e for a in answers for e in a.json()["files"] if e["filename"].startswith(name)]
            [file_id] = {c["id"] for c in copies}
            assert [c.get("duplicate_of") for c in copies].count(None) == 1
            assert [c.get("duplicate_of") for c in copies].count(file_id) == 7
            # One row, one task and one original for each shared content.
            digest = hashlib.sha256(data).hexdigest()
            row = await scalar(svc, "SELECT file_id FROM knowledge_files WHERE content_hash = :h", h=digest)
            assert row == file_id
        # Each request's own file too: 2 + 8 files and originals, each file with its task (a
        # request's new files may share one).
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 10
        tasks = await scalar(svc, "SELECT count(DISTINCT task_id) FROM knowledge_files")
        assert await scalar(svc, "SELECT count(*) FROM tasks") == tasks >= 8
        assert len(object_names(knowledge_stores, f"{base}/")) == 10
        assert await run_pending(svc) == ["success"] * tasks
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files WHERE status = 'indexed'") == 10


async def test_uploads_of_the_same_files_in_other_orders_wait_for_each_other_not_deadlock(
    knowledge_stores: dict[str, str],
) -> None:
    """Each upload inserts its new contents in hash order, so a transaction holding one content
    (not yet committed) makes another wait before it takes any content after it."""
    from sqlalchemy import text

    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        low, high = sorted(hashlib.sha256(b"%d" % i).hexdigest() for i in range(2))

        def row(digest: str) -> dict[str, Any]:
            return {"file_id": catalog.new_id(), "kb_id": base, "filename": f"{digest[:6]}.txt",
                    "file_type": "txt", "size_bytes": 1, "content_hash": digest}  # fmt: skip

        async with svc.engine.connect() as first, svc.engine.connect() as second:
            await first.begin()
            await second.begin()
            assert len(await catalog.insert_new_contents(first, [row(low)])) == 1
            pid = (await second.execute(text("SELECT pg_backend_pid()"))).scalar()
            # The other upload sends the two contents high first; it waits on ``low``, holding nothing.
            theirs = asyncio.create_task(catalog.insert_new_contents(second, [row(high), row(low)]))

            async def waiting() -> bool:
                async with svc.engine.connect() as look:
                    found = await look.execute(
                        text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
                    )
                    return found.scalar() == "Lock"

            for _ in range(200):
                if await waiting():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the second upload never waited for the first")
            # So the first may still take ``high``: in the other order this was a deadlock.
            assert len(await catalog.insert_new_contents(first, [row(high)])) == 1
            await first.commit()
            assert await theirs == set()  # both contents are the first upload's files
            await second.commit()
        assert await scalar(svc, "SELECT count(*) FROM knowledge_files") == 2


def _long_paragraph(words: list[str], seed: int) -> str:
    # About 900 characters: one chunk on its own (chunks hold up to 1,000).
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(130))


async def test_search_names_files_has_a_floor_and_shows_each_text_once(
    knowledge_stores: dict[str, str],
) -> None:
    shared = _long_paragraph(WORDS["pdf"] + FILLER, 1)
    a_text = shared + "\n\n" + _long_paragraph(WORDS["txt"] + FILLER, 2)
    b_text = shared + "\n\n" + _long_paragraph(WORDS["md"] + FILLER, 3)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [("alpha.txt", a_text.encode()), ("beta.txt", b_text.encode())])
        alpha, beta = r.json()["files"]
        assert await run_pending(svc) == ["success", "success"]
        assert (await file_row(svc, alpha["id"]))["chunk_count"] == 2

        async def search(**body: Any) -> list[dict[str, Any]]:
            r = await client.post(f"/knowledge/bases/{base}/search", json=body, headers=ALICE)
            assert r.status_code == 200, r.text
            hits: list[dict[str, Any]] = r.json()["hits"]
            return hits

        # Four chunks, three texts: the shared one is shown once, and top_k is still filled.
        hits = await search(query=" ".join(WORDS["pdf"]), top_k=3)
        assert len(hits) == 3 and len({h["text"] for h in hits}) == 3, hits
        assert hits[0]["text"] == shared and hits[0]["filename"] in ("alpha.txt", "beta.txt")
        names = {alpha["id"]: "alpha.txt", beta["id"]: "beta.txt"}
        assert all(h["filename"] == names[h["file_id"]] for h in hits)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)

        # A floor between the best and the rest keeps only the best.
        floor = (hits[0]["score"] + hits[1]["score"]) / 2
        assert [
            h["chunk_id"] for h in await search(query=" ".join(WORDS["pdf"]), top_k=3, min_score=floor)
        ] == [hits[0]["chunk_id"]]
        assert await search(query=" ".join(WORDS["pdf"]), min_score=1) == [] or hits[0]["score"] >= 1
        assert len(await search(query=" ".join(WORDS["pdf"]), top_k=3, min_score=-1)) == 3

        for bad in (b"1.5", b"-1.01", b"NaN", b"Infinity", b'"0.5"', b"true"):
            r = await client.post(
                f"/knowledge/bases/{base}/search",
                content=b'{"query": "x", "min_score": ' + bad + b"}",
                headers={**ALICE, "content-type": "application/json"},
            )
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "min_score", (bad, r.text)
        assert len(await search(query="x", min_score=0, top_k=1)) <= 1  # an integer is a number


async def test_a_file_in_progress_shows_its_tasks_attempt(knowledge_stores: dict[str, str]) -> None:

    from domains.knowledge.tasks import MAX_ATTEMPTS

    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        [entry] = (await upload(client, base, [("doc.txt", b"some words " * 40)])).json()["files"]
        file_id, task_id = entry["id"], uuid.UUID(entry["task_id"])

        async def shown() -> tuple[Any, Any]:
            one = (await client.get(f"/knowledge/files/{file_id}", headers=ALICE)).json()
            [listed] = (await client.get(f"/knowledge/bases/{base}/files", headers=ALICE)).json()["items"]
            assert (listed["attempt"], listed["max_attempts"]) == (one["attempt"], one["max_attempts"])
            return one["attempt"], one["max_attempts"]

        assert await shown() == (1, MAX_ATTEMPTS)  # waiting for its first claim
        claim = await svc.repo.claim(task_id, svc.registry, capacity=10, lease_seconds=30)
        assert not isinstance(claim, str), claim
        async with svc.engine.begin() as conn:
            assert await catalog.start(conn, file_id, task_id, claim.token) is not None
        assert await shown() == (1, MAX_ATTEMPTS)  # running its first
        # The attempt falls silent; the reconciler sends the retry-safe task back with backoff.
        report = await lapse_and_reconcile(svc, task_id)
        assert report.retried == 1
        assert (await file_row(svc, file_id))["status"] == "parsing"
        assert await shown() == (2, MAX_ATTEMPTS)  # the file waits for its second attempt
        assert await run_pending(svc) == ["success"]
        assert await shown() == (None, None)  # indexed: no attempt to show
        task = (await client.get(f"/tasks/{task_id}", headers=ALICE)).json()
        assert task["attempt_count"] == 2
