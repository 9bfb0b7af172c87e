"""`dtask bench knowledge-ingest --embedder SPEC`: the plain ingest with that embedder, and its model's share.

The api and the worker run with ``DTASK_EMBEDDER=SPEC`` (and the caller's ``DTASK_EMBEDDING_*``
variables, for the ``openai`` embedder's server). An untimed warm-up batch first lets the worker's
pool processes load the model, as a deployment's have long before; then the bench's rounds run as
without the option, while the CPU time of the worker's process tree is read around them.

The model's share: the rounds' documents are chunked as an ingest chunks them (the parse process's
own function) and embedded here, in this process, in the indexing handler's batches; those CPU
seconds per chunk over the worker's CPU seconds per chunk are the share of indexing work spent in
the model. For an embedder that calls a server, the share is the client's, not the server's.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from domains.knowledge.bench import VARIANT, named_document, tree_cpu
from tasks_core.devkit.bench.report import Document, ratio

PASSED_PREFIX = "DTASK_EMBEDDING_"
# Untimed warm-up files per worker pool process: enough that each is likely to have taken one.
WARMUP_PER_PROCESS = 2
WARMUP_STALL_SECONDS = 600.0


def passed_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's DTASK_EMBEDDING_* variables (the bench's processes get no other DTASK_* of its)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(PASSED_PREFIX)}


@dataclass(frozen=True)
class ModelCost:
    """One process's cost of an embedder: its load, and embedding ``chunks`` texts."""

    name: str
    chunks: int
    load_cpu_seconds: float
    load_seconds: float
    cpu_seconds: float
    seconds: float


def model_cost(spec: str, texts: Sequence[str]) -> ModelCost:
    """Load the embedder ``spec`` in this process and embed ``texts`` in the handler's batches, on an
    event loop of this thread's own, through ``embed_texts`` as the handler does.

    The load includes a first one-text call: a local model loads at its first embed, and a client
    connects at its first request."""
    return asyncio.run(_model_cost(spec, texts))


async def _model_cost(spec: str, texts: Sequence[str]) -> ModelCost:
    from domains.knowledge.embedding import embed_texts, load_embedder
    from domains.knowledge.handlers import EMBED_BATCH

    cpu, wall = time.process_time(), time.monotonic()
    embedder = load_embedder(spec)
    await embed_texts(embedder, ["warm-up"])
    load_cpu, load = time.process_time() - cpu, time.monotonic() - wall
    cpu, wall = time.process_time(), time.monotonic()
    for start in range(0, len(texts), EMBED_BATCH):
        await embed_texts(embedder, texts[start : start + EMBED_BATCH])
    return ModelCost(
        embedder.name, len(texts), load_cpu, load, time.process_time() - cpu, time.monotonic() - wall
    )


def chunks_of(documents: Sequence[tuple[str, bytes]]) -> list[str]:
    """The chunks an ingest makes of these text documents (the parse process's function)."""
    from domains.knowledge.parse_child import parse
    from domains.knowledge.parse_process import ParseLimits
    from domains.knowledge.settings import get_knowledge_settings

    limits = ParseLimits.from_settings(get_knowledge_settings())
    return [c for _, data in documents for c in parse(data, "txt", limits.max_chars, limits.max_chunks)]


async def run(
    stack: Any, doc: Document, worker_pid: int, ingest: Callable[[Any, Document], Awaitable[None]]
) -> None:
    """``ingest`` (the plain bench's rounds) after a warm-up, with the model's share beside its figures."""
    opts = stack.opts
    warmup_files = WARMUP_PER_PROCESS * opts.concurrency
    started = time.monotonic()
    scratch = Document("knowledge-ingest-warmup", {}, quick=opts.quick)
    # The first files of each pool process wait for its model to load: minutes on a busy machine.
    warm = replace(opts, rounds=1, stall_seconds=max(opts.stall_seconds, WARMUP_STALL_SECONDS))
    await ingest(replace(stack, files=warmup_files, opts=warm), scratch)
    doc.settings["warmup"] = {"files": warmup_files, "seconds": time.monotonic() - started}
    before = tree_cpu(worker_pid)
    await ingest(stack, doc)
    worker_cpu = tree_cpu(worker_pid) - before
    # The same documents every round (into a base of its own): one round's chunks, embedded here.
    texts = chunks_of([named_document(n, opts.size) for n in range(stack.files)])
    cost = await asyncio.to_thread(model_cost, opts.embedder, texts)
    report(doc, cost, worker_cpu, opts.rounds)


def report(doc: Document, cost: ModelCost, worker_cpu: float, rounds: int) -> None:
    variant = doc.data["variants"][VARIANT]
    median, pooled = variant["median"], variant["pooled_upload_to_indexed_ms"]
    files = median.get("files") or 0
    chunks_per_file = cost.chunks / files if files else None
    chunks_per_s = (
        median["files_per_s"] * chunks_per_file if median.get("files_per_s") and chunks_per_file else None
    )
    indexed_chunks = cost.chunks * rounds
    worker_ms = 1000 * worker_cpu / indexed_chunks if indexed_chunks else None
    model_ms = 1000 * cost.cpu_seconds / cost.chunks if cost.chunks else None
    share = ratio(model_ms, worker_ms)
    doc.data["model"] = {
        "embedder": cost.name,
        "chunks_per_round": cost.chunks,
        "chunks_per_file": chunks_per_file,
        "chunks_per_s": chunks_per_s,
        "worker_cpu_seconds": worker_cpu,
        "worker_cpu_ms_per_chunk": worker_ms,
        "model_cpu_ms_per_chunk": model_ms,
        "model_ms_per_chunk": 1000 * cost.seconds / cost.chunks if cost.chunks else None,
        "model_load_cpu_seconds": cost.load_cpu_seconds,
        "model_load_seconds": cost.load_seconds,
    }
    doc.data["ratios"]["model share of the worker's CPU"] = share
    doc.table(
        f"knowledge ingest with {cost.name} (upload to indexed)",
        ["variant", "files/s", "chunks/s", "p50 ms", "p99 ms", "worker CPU ms/chunk", "model CPU ms/chunk",
         "model share"],
        [[VARIANT, median.get("files_per_s"), chunks_per_s, pooled.get("p50"), pooled.get("p99"), worker_ms,
          model_ms, share]],
    )  # fmt: skip
    doc.note(
        "model CPU ms/chunk: the same chunks embedded in the bench's process in the handler's batches; "
        "worker CPU ms/chunk: the worker's process tree (main, pool and parse processes) over the rounds"
    )
    doc.note(
        f"loading the model took {cost.load_seconds:.1f} s ({cost.load_cpu_seconds:.1f} s CPU) in one "
        "process; an untimed warm-up batch let the pool processes pay it before the rounds"
    )
