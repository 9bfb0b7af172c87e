"""Check that PostgreSQL, Milvus and S3 agree about every file of a base, and repair what does not.

PostgreSQL says what a base holds. The verifier counts, per file, its chunk rows, its vectors (one
pass over the base's collection) and its original in the bucket, and reports each disagreement:

- an ``indexed`` file whose chunk rows or vectors are not its ``chunk_count``: re-queued (a
  ``knowledge.reindex`` task, as the reindex route makes), which replaces them;
- an ``indexed`` file whose original is gone: it cannot be rebuilt, so it ends ``error_parsing``
  (upload it again), its chunk rows and vectors removed;
- a file in an error state that still has chunk rows or vectors (a failed attempt's leftovers),
  vectors of files that no longer exist, objects under the base with no file row: removed;
- across bases: collections and object prefixes of bases that no longer exist: removed.

Files a task is working on are not judged. A verdict is acted on only if the file is still as it
was seen (same state, same ``updated_at``, no active task), so a reindex that starts meanwhile wins.
Objects younger than ``OBJECT_GRACE`` are left alone: an upload puts its originals before the
transaction that creates their rows commits.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from domains.knowledge import catalog, reindexing, vectors
from domains.knowledge.errors import CollectionMissing
from domains.knowledge.model import ERRORS, INDEXED
from domains.knowledge.storage import ObjectStore, object_key
from domains.knowledge.stores import KnowledgeStores, stores_for
from tasks_core.services import Services

OBJECT_GRACE = timedelta(hours=1)
LOST_ORIGINAL = "the original is missing from the object store; upload the file again"
# Bases one duty run may check before it hands on to the next run (which continues after them).
DUTY_BASES = 50
# ...and seconds it may spend: the duties queue must stay free for the publisher and reconciler.
DUTY_SECONDS = 20.0
CURSOR_KEY = "dtask:knowledge:verify-cursor"


@dataclass
class FileVerdict:
    file_id: str
    filename: str
    status: str
    chunk_count: int  # what the file row says
    chunk_rows: int  # rows in knowledge_chunks
    vectors: int  # vectors in Milvus
    original: bool  # the object is in the bucket
    problem: str
    action: str = ""  # what --repair did


@dataclass
class BaseReport:
    base_id: str
    files: int = 0  # files judged (not in progress)
    agreeing: int = 0
    problems: list[FileVerdict] = field(default_factory=list)
    stray_vectors: int = 0  # vectors of files that do not exist (any more)
    stray_objects: int = 0  # objects without a file row

    @property
    def agrees(self) -> bool:
        return not (self.problems or self.stray_vectors or self.stray_objects)


@dataclass
class Report:
    repair: bool
    bases: list[BaseReport] = field(default_factory=list)
    stray_collections: int = 0  # collections of bases that do not exist (any more)
    stray_prefixes: int = 0  # object prefixes of such bases

    @property
    def agrees(self) -> bool:
        return all(b.agrees for b in self.bases) and not (self.stray_collections or self.stray_prefixes)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agrees": self.agrees}


async def _vectors_by_file(stores: KnowledgeStores, base_id: str, dimension: int) -> Counter[str]:
    try:
        return await (await stores.index(base_id, dimension)).vectors_by_file()
    except CollectionMissing:
        stores.indexes.forget(base_id)
        return await (await stores.index(base_id, dimension)).vectors_by_file()


def _file_of(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _judge(row: dict[str, Any], vectors: int, original: bool) -> str | None:
    """What is wrong with a file that no task is working on, or None."""
    if row["status"] == INDEXED:
        if not original:
            return "original missing"
        if row["chunk_rows"] != row["chunk_count"] or vectors != row["chunk_count"]:
            return "chunks and vectors disagree"
    elif row["status"] in ERRORS and (row["chunk_rows"] or vectors):
        return "leftovers of a failed attempt"
    return None


async def verify_base(
    svc: Services,
    stores: KnowledgeStores,
    base_id: str,
    owner: str,
    *,
    repair: bool,
    object_grace: timedelta = OBJECT_GRACE,
) -> BaseReport:
    async with svc.engine.connect() as conn:
        base = await catalog.get_base(conn, base_id)
        if base is None:
            return BaseReport(base_id)
        rows = await catalog.files_to_verify(conn, base_id)
    counts = await _vectors_by_file(stores, base_id, base["dimension"])
    objects = await stores.objects()
    listed = dict(await objects.listing(f"{base_id}/"))
    report = BaseReport(base_id)
    known = {r["file_id"] for r in rows}
    for row in rows:
        if row["task_active"] or row["status"] not in (INDEXED, *ERRORS):
            continue  # a task is working on it: judged once it is done
        report.files += 1
        fid = row["file_id"]
        original = object_key(base_id, fid) in listed
        problem = _judge(row, counts.get(fid, 0), original)
        if problem is None:
            report.agreeing += 1
            continue
        verdict = FileVerdict(
            fid, row["filename"], row["status"], row["chunk_count"], row["chunk_rows"],
            counts.get(fid, 0), original, problem,
        )  # fmt: skip
        if repair:
            verdict.action = await _repair_file(svc, stores, base, owner, row, verdict)
        report.problems.append(verdict)
    cutoff = datetime.now(UTC) - object_grace
    stray_files = [fid for fid in counts if fid not in known]
    stray_keys = [
        key
        for key, modified in listed.items()
        if _file_of(key) not in known and (modified is None or modified < cutoff)
    ]
    # A file uploaded since its base's rows were read may be indexed already: only what still has
    # no row now is stray.
    async with svc.engine.connect() as conn:
        arrived = await catalog.existing_files(conn, [*stray_files, *map(_file_of, stray_keys)])
    stray_files = [fid for fid in stray_files if fid not in arrived]
    stray_keys = [key for key in stray_keys if _file_of(key) not in arrived]
    report.stray_vectors = sum(counts[fid] for fid in stray_files)
    report.stray_objects = len(stray_keys)
    if repair:
        index = await stores.index(base_id, base["dimension"])
        for fid in stray_files:
            await index.delete_file(fid)
        for key in stray_keys:
            await objects.delete(key)
    return report


async def _repair_file(
    svc: Services,
    stores: KnowledgeStores,
    base: dict[str, Any],
    owner: str,
    row: dict[str, Any],
    verdict: FileVerdict,
) -> str:
    fid, seen = row["file_id"], row["updated_at"]
    index = await stores.index(base["id"], base["dimension"])
    if verdict.problem == "chunks and vectors disagree":
        outcome = await reindexing.reindex_file(svc, fid, owner)
        if outcome is None or outcome.task_id is None:
            return "left: the file changed meanwhile"
        return f"re-queued as task {outcome.task_id}"
    async with svc.engine.begin() as conn:
        if verdict.problem == "original missing":
            if not await catalog.lose_original(conn, fid, seen, LOST_ORIGINAL):
                return "left: the file changed meanwhile"
        elif await catalog.unchanged(conn, fid, row["status"], seen):
            await catalog.drop_chunks(conn, fid)
        else:
            return "left: the file changed meanwhile"
    # Outside the transaction (never across a store call). A reindex that takes the file over from
    # here on starts by deleting its vectors too, and the next run re-checks whatever races it.
    await index.delete_file(fid)
    if verdict.problem == "original missing":
        return "marked error_parsing, chunks and vectors removed"
    return "chunks and vectors removed"


async def sweep_deleted_bases(svc: Services, stores: KnowledgeStores, report: Report) -> None:
    """Collections and object prefixes whose base row is gone (a delete that failed half-way, a
    collection created late by a stalled Milvus after its base was taken back)."""
    client = await stores.milvus()
    with_collection = await vectors.base_collections(client, stores.config.deadline)
    objects: ObjectStore = await stores.objects()
    prefixes = {name.rstrip("/") for name, _ in await objects.listing(recursive=False) if name.endswith("/")}
    async with svc.engine.connect() as conn:
        existing = await catalog.existing_bases(conn, sorted(with_collection | prefixes))
    gone_collections = sorted(with_collection - existing)
    # Some S3 servers (SeaweedFS) keep listing a "folder" after its last object went.
    gone_prefixes = [p for p in sorted(prefixes - existing) if await objects.listing(f"{p}/")]
    report.stray_collections, report.stray_prefixes = len(gone_collections), len(gone_prefixes)
    if report.repair:
        for base_id in gone_collections:
            await stores.drop(base_id)
        for base_id in gone_prefixes:
            await objects.delete_prefix(f"{base_id}/")


async def verify(
    svc: Services, *, base_id: str | None = None, repair: bool = False, object_grace: timedelta = OBJECT_GRACE
) -> Report:
    """Every base (or one), then the leftovers of deleted bases (only when checking every base)."""
    stores = stores_for(svc.settings)
    stores.require()
    report = Report(repair)
    async with svc.engine.connect() as conn:
        if base_id is not None:
            base = await catalog.get_base(conn, base_id)
            bases = [] if base is None else [base]
        else:
            bases = await catalog.base_ids_after(conn, "", 1_000_000)
    for base in bases:
        checked = await verify_base(
            svc, stores, base["id"], base["owner"], repair=repair, object_grace=object_grace
        )
        report.bases.append(checked)
    if base_id is None:
        await sweep_deleted_bases(svc, stores, report)
    return report


async def duty(svc: Services) -> dict[str, int]:
    """The periodic verifier: repairs bases in id order, a bounded share per run (continuing where
    the last run stopped), then sweeps what deleted bases left. Skipped where no stores are set."""
    stores = stores_for(svc.settings)
    if stores.config.missing():
        return {"bases": 0}
    redis = svc.redis
    raw = await redis.get(CURSOR_KEY)
    after = raw.decode() if isinstance(raw, bytes) else (raw or "")
    started = time.monotonic()
    report = Report(repair=True)
    async with svc.engine.connect() as conn:
        bases = await catalog.base_ids_after(conn, after, DUTY_BASES)
    for base in bases:
        report.bases.append(await verify_base(svc, stores, base["id"], base["owner"], repair=True))
        after = base["id"]
        if time.monotonic() - started > DUTY_SECONDS:
            break
    if len(report.bases) == len(bases) < DUTY_BASES:
        after = ""  # the last bases were checked: the next run starts over
        await sweep_deleted_bases(svc, stores, report)
    await redis.set(CURSOR_KEY, after)
    return {
        "bases": len(report.bases),
        "files": sum(b.files for b in report.bases),
        "repaired": sum(len(b.problems) for b in report.bases),
        "stray_vectors": sum(b.stray_vectors for b in report.bases),
        "stray_objects": sum(b.stray_objects for b in report.bases),
        "stray_collections": report.stray_collections,
        "stray_prefixes": report.stray_prefixes,
    }
