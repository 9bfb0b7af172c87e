"""`dtask bench knowledge-quality`: how well each embedder finds the answer, on corpora with known answers.

A corpus is a directory: ``docs/`` (the documents, each uploaded as one file) and ``questions.jsonl``
(one ``{"question": ..., "answer": "<file name in docs/>"}`` per line; ``answer`` may be a list when
several documents answer). The default is the repository's ``tests/data/en_corpus``.

Everything goes through the system as users run it: for each ``--embedder`` spec, a ``dtask api`` and
a ``celery worker`` start with ``DTASK_EMBEDDER`` set to it (Milvus and S3 servers and the database
are the run's own, shared by every embedder); each corpus is uploaded over HTTP into a base of its
own, indexed by the worker, and every question is asked through ``POST /knowledge/bases/{id}/search``.
A question's rank is the position of its answer among the distinct files of the hits, best first;
reported per embedder and corpus: MRR (0 when the answer is not among the hits), hit@1, hit@5, the
time from upload to indexed, and the search latency.

``DTASK_EMBEDDING_*`` variables of the caller's environment are passed to the processes (the
``openai`` embedder reads its server from them); every other DTASK_* variable is the run's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from domains.knowledge.bench import _wait_api
from domains.knowledge.bench_model import passed_environment
from tasks_core.db import make_engine
from tasks_core.devkit.bench.common import (
    ROOT,
    BenchEnv,
    BenchError,
    CommonOptions,
    Proc,
    public_options,
)
from tasks_core.devkit.bench.report import Document, summarize

DEFAULT_CORPUS = ROOT / "tests" / "data" / "en_corpus"
# Hits asked per question: ranks are counted over the distinct files among them.
TOP_K = 20
HIT_AT = (1, 5)
DONE = ("indexed", "error_parsing", "error_indexing")
# Passed through to the processes (bench_model.passed_environment); the key is not recorded.
SECRET = "DTASK_EMBEDDING_API_KEY"
# The api and the worker load a local model at start (seconds, on a busy machine).
READY_SECONDS = 180.0


@dataclass
class QualityOptions(CommonOptions):
    embedders: tuple[str, ...] = ("hashing",)
    corpora: tuple[str, ...] = field(default_factory=lambda: (str(DEFAULT_CORPUS),))
    top_k: int = TOP_K
    # The worker's pool: each pool process that indexes loads its own copy of a local model.
    capacity: int = 2
    concurrency: int = 2
    # The first files wait for each pool process to load a local model: minutes on a busy machine.
    stall_seconds: float = 600.0
    # Ranks do not change between rounds (every embedder here is deterministic): one is enough.
    rounds: int = 1


QUICK: dict[str, Any] = {"rounds": 1, "capacity": 1, "concurrency": 1}


@dataclass(frozen=True)
class Question:
    text: str
    answers: frozenset[str]


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: list[tuple[str, bytes]]
    questions: list[Question]


def load_corpus(path: str | Path) -> Corpus:
    """The corpus in ``path``; ValueError naming what is wrong with it."""
    root = Path(path)
    docs_dir, questions_file = root / "docs", root / "questions.jsonl"
    if not docs_dir.is_dir() or not questions_file.is_file():
        raise ValueError(f"corpus {path}: needs docs/ and questions.jsonl")
    documents = [(p.name, p.read_bytes()) for p in sorted(docs_dir.iterdir()) if p.is_file()]
    if not documents:
        raise ValueError(f"corpus {path}: docs/ holds no file")
    names = {name for name, _ in documents}
    questions: list[Question] = []
    for number, line in enumerate(questions_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            answer = item["answer"]
            answers = frozenset([answer] if isinstance(answer, str) else answer)
            question = Question(str(item["question"]), answers)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"corpus {path}: questions.jsonl line {number}: {exc!r}") from None
        unknown = sorted(answers - names)
        if not answers or unknown or not question.text.strip():
            raise ValueError(f"corpus {path}: questions.jsonl line {number}: no such document {unknown}")
        questions.append(question)
    if not questions:
        raise ValueError(f"corpus {path}: questions.jsonl holds no question")
    return Corpus(root.resolve().name, documents, questions)


def rank(answers: frozenset[str], filenames: Sequence[str]) -> int | None:
    """1-based position of the first answer among the distinct files, in hit order (None: absent)."""
    seen: list[str] = []
    for name in filenames:
        if name not in seen:
            seen.append(name)
            if name in answers:
                return len(seen)
    return None


def scores(ranks: Sequence[int | None]) -> dict[str, float]:
    """MRR and hit@k over the questions' ranks."""
    n = len(ranks)
    out = {"mrr": sum(1.0 / r for r in ranks if r is not None) / n if n else 0.0}
    for k in HIT_AT:
        out[f"hit@{k}"] = sum(1 for r in ranks if r is not None and r <= k) / n if n else 0.0
    return out


def run(opts: QualityOptions) -> dict[str, Any]:
    if not opts.embedders or opts.top_k < 1:
        raise ValueError("--embedder is needed (repeatable) and --top-k must be positive")
    corpora = [load_corpus(path) for path in opts.corpora]
    return asyncio.run(_run(opts, corpora))


async def _run(opts: QualityOptions, corpora: Sequence[Corpus]) -> dict[str, Any]:
    from tasks_core.devkit.embedded_stores import EmbeddedMilvus, EmbeddedS3
    from tasks_core.devkit.processes import free_port

    passed = passed_environment()
    doc = Document("knowledge-quality", public_options(opts), quick=opts.quick)
    doc.settings["passed_environment"] = {k: ("***" if k == SECRET else v) for k, v in passed.items()}
    doc.settings["corpora"] = {
        c.name: {"documents": len(c.documents), "questions": len(c.questions)} for c in corpora
    }
    results: list[dict[str, Any]] = []
    async with BenchEnv("knowledge-quality", opts) as env:
        milvus, s3 = EmbeddedMilvus(env.dir / "milvus"), EmbeddedS3(env.dir / "s3")
        try:
            uri = await asyncio.to_thread(milvus.start)
            endpoint = await asyncio.to_thread(s3.start)
            db_url = await env.create_database("knowledge")
            engine = make_engine(db_url, pool_size=2)
            try:
                for spec in opts.embedders:
                    secret = os.urandom(18).hex()
                    settings = env.dtask_settings(
                        db_url, capacity=opts.capacity, worker_concurrency=opts.concurrency
                    )
                    settings.update(
                        passed,
                        DTASK_MILVUS_URI=uri,
                        **endpoint.env(),
                        DTASK_MINIO_BUCKET="dtask-bench",
                        DTASK_EMBEDDER=spec,
                        DTASK_API_KEYS=f"bench:{secret}",
                    )
                    port = free_port()
                    api = env.start_api(settings, port)
                    worker = env.start_worker("worker", settings, concurrency=opts.concurrency)
                    try:
                        await env.wait_ready(worker, within=READY_SECONDS)
                        async with httpx.AsyncClient(
                            base_url=f"http://127.0.0.1:{port}",
                            headers={"Authorization": f"Bearer {secret}"},
                            timeout=READY_SECONDS,
                        ) as client:
                            await _wait_api(env, client, api)
                            for corpus in corpora:
                                results.append(
                                    await _evaluate(env, client, engine, [api, worker], opts, spec, corpus)
                                )
                    finally:
                        env.kill(api)
                        env.kill(worker)
            finally:
                await engine.dispose()
        finally:
            await asyncio.to_thread(milvus.stop)
            await asyncio.to_thread(s3.stop)
    _report(doc, results, opts)
    return doc.finish()


async def _evaluate(
    env: BenchEnv,
    client: httpx.AsyncClient,
    engine: Any,
    procs: Sequence[Proc],
    opts: QualityOptions,
    spec: str,
    corpus: Corpus,
) -> dict[str, Any]:
    r = await client.post("/knowledge/bases", json={"name": f"quality-{corpus.name}-{time.time_ns()}"})
    if r.status_code != 201:
        raise BenchError(f"creating a base with DTASK_EMBEDDER={spec} failed: {r.status_code} {r.text[:500]}")
    base = r.json()
    started = time.monotonic()
    parts = [("files", (name, content, "text/plain")) for name, content in corpus.documents]
    r = await client.post(f"/knowledge/bases/{base['id']}/files", files=parts)
    if r.status_code != 202:
        raise BenchError(f"upload failed: {r.status_code} {r.text[:500]}")
    await _wait_indexed(env, engine, procs, opts, [f["id"] for f in r.json()["files"]])
    index_seconds = time.monotonic() - started
    chunks = await _chunk_count(engine, base["id"])
    # Untimed: the api's first search loads a local model (an embedder loads at its first embed).
    r = await client.post(f"/knowledge/bases/{base['id']}/search", json={"query": "warm-up", "top_k": 1})
    if r.status_code != 200:
        raise BenchError(f"search failed: {r.status_code} {r.text[:500]}")
    items: list[dict[str, Any]] = []
    latencies: list[float] = []
    for question in corpus.questions:
        t0 = time.monotonic()
        r = await client.post(
            f"/knowledge/bases/{base['id']}/search", json={"query": question.text, "top_k": opts.top_k}
        )
        latencies.append((time.monotonic() - t0) * 1000)
        if r.status_code != 200:
            raise BenchError(f"search failed: {r.status_code} {r.text[:500]}")
        filenames = [hit["filename"] for hit in r.json()["hits"]]
        items.append(
            {
                "question": question.text,
                "answers": sorted(question.answers),
                "rank": rank(question.answers, filenames),
                "top": filenames[0] if filenames else None,
            }
        )
    return {
        "embedder": spec,
        "embedder_name": base["embedder"],
        "dimension": base["dimension"],
        "corpus": corpus.name,
        "documents": len(corpus.documents),
        "chunks": chunks,
        "questions": len(items),
        **scores([i["rank"] for i in items]),
        "index_seconds": index_seconds,
        "search_ms": summarize(latencies),
        "items": items,
    }


def _report(doc: Document, results: Sequence[dict[str, Any]], opts: QualityOptions) -> None:
    doc.data["variants"] = {f"{r['embedder']} / {r['corpus']}": r for r in results}
    doc.table(
        "retrieval quality: the answer's rank among the files of the hits",
        ["embedder", "corpus", "MRR", "hit@1", "hit@5", "questions", "chunks", "index s", "search p50 ms"],
        [
            [
                r["embedder_name"],
                r["corpus"],
                r["mrr"],
                r["hit@1"],
                r["hit@5"],
                r["questions"],
                r["chunks"],
                r["index_seconds"],
                r["search_ms"].get("p50"),
            ]
            for r in results
        ],
    )
    doc.note(
        f"each question asked once through POST /knowledge/bases/{{id}}/search (top_k {opts.top_k}); its "
        "rank is its answer's position among the distinct files of the hits (MRR counts 0 when absent)"
    )
    doc.note(
        f"index s: one multipart upload of the corpus until every file was indexed (one celery worker, "
        f"prefork -c {opts.concurrency}, DTASK_CAPACITY={opts.capacity}); a local model's load in the "
        "pool processes is inside it"
    )


async def _wait_indexed(
    env: BenchEnv, engine: Any, procs: Sequence[Proc], opts: QualityOptions, file_ids: Sequence[str]
) -> None:
    """Until every file is done; BenchError if one failed, or nothing moved for ``stall_seconds``."""
    query = text(
        "SELECT file_id, filename, status, error_message FROM knowledge_files WHERE file_id = ANY(:ids)"
    )
    last, changed = -1, time.monotonic()
    while True:
        env.check_alive(*procs)
        async with engine.connect() as conn:
            rows = (await conn.execute(query, {"ids": list(file_ids)})).all()
        done = [r for r in rows if r[2] in DONE]
        failed = [r for r in done if r[2] != "indexed"]
        if failed:
            raise BenchError(f"{failed[0][1]} ended {failed[0][2]}: {failed[0][3]}\n{env.logs()}")
        if len(done) == len(file_ids):
            return
        if len(done) != last:
            last, changed = len(done), time.monotonic()
        elif time.monotonic() - changed > opts.stall_seconds:
            raise BenchError(
                f"no file finished for {opts.stall_seconds:g} s ({len(done)} of {len(file_ids)});\n"
                + env.logs()
            )
        await asyncio.sleep(0.2)


async def _chunk_count(engine: Any, base_id: str) -> int:
    async with engine.connect() as conn:
        query = text("SELECT coalesce(sum(chunk_count), 0) FROM knowledge_files WHERE kb_id = :kb")
        return int((await conn.execute(query, {"kb": base_id})).scalar_one())
