"""Every document format, and text in legacy encodings, through a real `celery worker`, real Milvus
(milvus-lite server) and real S3 (SeaweedFS): uploaded to one base, indexed, and each found first by
words of its own text; hostile Word files end error_parsing at the parse limits."""

from __future__ import annotations

import io
from typing import Any

import docx
import pytest
from sqlalchemy import text

from domains.knowledge.chunking import chunk_text
from domains.knowledge.parsing import extract_text, file_type_of
from tests.knowledge_documents import MB, docx_bomb, make_docx
from tests.knowledge_helpers import (
    ALICE,
    create_base,
    file_row,
    knowledge_api,
    milvus_client,
    upload,
    vector_count,
)
from tests.system.conftest import Cluster, wait_for

pytestmark = pytest.mark.system

CHINESE = "灯塔看守人的日志。第二个透镜在晚上点亮，海港的船只依靠它航行。㐀字在扩展区。"  # noqa: RUF001

RST = """\
Albatross Station
=================

Keepers log every *albatross* that lands on the pier; see :ref:`the seabird chapter <birds>`.

.. note::

   The cormorant colony nests below the lamp room.

+-----------+-------------+
| Bird      | Season      |
+===========+=============+
| albatross | winter      |
+-----------+-------------+
"""


def _docx() -> bytes:
    document = docx.Document()
    document.add_heading("Narwhal survey", level=1)
    document.add_paragraph("Each narwhal sighted in the fjord is written down with the tide.")
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text, table.cell(0, 1).text = "Animal", "Place"
    table.cell(1, 0).text, table.cell(1, 1).text = "narwhal", "fjord mouth"
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


# name -> (bytes, a query from the file's own words)
FILES: dict[str, tuple[bytes, str]] = {
    "station.rst": (RST.encode(), "albatross cormorant"),
    "survey.docx": (_docx(), "narwhal fjord"),
    "keepers.csv": (
        (
            "Name;Post;Remark\r\nZoë;Pelican Point;“estuary” watch, 12 €\r\nJosé;Pelican Point;estuary\r\n"
        ).encode("cp1252"),
        "pelican estuary",
    ),
    "inventory.json": (
        b'{"stores": {"walrus_shed": {"items": [{"name": "tundra sledge", "count": 2}, "walrus rope"]}}}',
        "walrus tundra",
    ),
    "phare.txt": (
        "Le gardien du phare note chaque goéland qui se pose sur la falaise, même l'hiver, "
        "près de la fenêtre du côté de la mer.".encode("latin-1"),
        "goéland falaise",
    ),
    "rizhi.txt": (
        f"{CHINESE}\n\nThe sampan keeper logs every junk at dawn.".encode("gb18030"),
        "sampan junk",
    ),
}


async def _chunks(svc: Any, file_id: str) -> list[str]:
    async with svc.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT text FROM knowledge_chunks WHERE file_id = :id ORDER BY seq"), {"id": file_id}
        )
        return [row[0] for row in rows]


async def test_every_format_and_legacy_encoding_is_indexed_and_found_by_its_own_words(
    cluster: Cluster, knowledge_stores: dict[str, str]
) -> None:
    worker = cluster.start_worker(concurrency=3, **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, [(name, data) for name, (data, _) in FILES.items()])
        assert r.status_code == 202, r.text
        ids = {entry["filename"]: entry["id"] for entry in r.json()["files"]}
        assert set(ids) == set(FILES)

        async def all_indexed() -> dict[str, dict[str, Any]] | None:
            assert worker.alive()
            rows = {name: await file_row(svc, file_id) for name, file_id in ids.items()}
            failed = {n: row["error_message"] for n, row in rows.items() if row["status"].startswith("error")}
            assert not failed, failed
            return rows if all(row["status"] == "indexed" for row in rows.values()) else None

        rows = await wait_for(all_indexed, within=90, what="every file indexed")
        milvus = milvus_client(knowledge_stores)
        for name, (data, query) in FILES.items():
            file_type = file_type_of(name)
            assert file_type is not None and rows[name]["file_type"] == file_type
            expected = chunk_text(extract_text(data, file_type))
            assert await _chunks(svc, ids[name]) == expected, name
            assert rows[name]["chunk_count"] == len(expected) == vector_count(milvus, base, ids[name])
            r = await client.post(
                f"/knowledge/bases/{base}/search", json={"query": query, "top_k": 3}, headers=ALICE
            )
            assert r.status_code == 200, r.text
            hits = r.json()["hits"]
            assert hits and hits[0]["file_id"] == ids[name], (name, query, hits)
            assert all(word in hits[0]["text"].lower() for word in query.split()), (name, hits[0])

        # The legacy encodings were read as their writers meant, not as mojibake.
        [phare] = await _chunks(svc, ids["phare.txt"])
        assert "goéland qui se pose sur la falaise, même l'hiver" in phare
        [rizhi] = await _chunks(svc, ids["rizhi.txt"])
        assert rizhi.startswith(CHINESE)
        [keepers] = await _chunks(svc, ids["keepers.csv"])
        assert "Name: Zoë; Post: Pelican Point; Remark: “estuary” watch, 12 €" in keepers
        [station] = await _chunks(svc, ids["station.rst"])
        assert "The cormorant colony nests below the lamp room." in station and ":ref:" not in station
        [survey] = await _chunks(svc, ids["survey.docx"])
        assert "narwhal | fjord mouth" in survey


async def test_hostile_docx_files_end_error_parsing_at_the_limits_and_the_worker_goes_on(
    cluster: Cluster, knowledge_stores: dict[str, str]
) -> None:
    worker = cluster.start_worker(concurrency=3, DTASK_KNOWLEDGE_PARSE_MEMORY_MB="256", **knowledge_stores)
    await cluster.wait_worker_ready(worker)
    files = [
        ("bomb.docx", docx_bomb(320 * MB)),  # 2.5 MB zipped, 320 MB of XML for python-docx to read
        ("huge.docx", docx_bomb(24 * MB)),  # within memory, 24 million characters of text
        ("fine.docx", make_docx()),
    ]
    async with knowledge_api() as (client, svc):
        base = await create_base(client)
        r = await upload(client, base, files)
        assert r.status_code == 202, r.text
        ids = [entry["id"] for entry in r.json()["files"]]

        async def all_done() -> list[dict[str, Any]] | None:
            assert worker.alive()
            rows = [await file_row(svc, file_id) for file_id in ids]
            return rows if all(row["status"] in ("indexed", "error_parsing") for row in rows) else None

        bomb, huge, fine = await wait_for(all_done, within=90, what="every file indexed or error_parsing")
        assert (bomb["status"], bomb["error_message"]) == (
            "error_parsing",
            "the parser ran out of its 256 MB memory limit (DTASK_KNOWLEDGE_PARSE_MEMORY_MB)",
        )
        assert huge["status"] == "error_parsing"
        assert "limit of 4,000,000 characters (DTASK_KNOWLEDGE_MAX_CHARS)" in huge["error_message"]
        assert fine["status"] == "indexed" and fine["chunk_count"] == 1
        assert worker.alive()
