"""`dtask bench knowledge-ingest --base-size N …`: the same batch of new files into bases of N files.

For each round and each N: a base is created over HTTP and pre-filled with N indexed files
(``bench_pipeline.prefill``: originals, vectors and rows written directly, in bulk); once the Milvus
server is idle again (a pre-fill leaves it flushing and building indexes, which a base that grew over
weeks finished long ago), the batch of ``--files`` new files is uploaded over HTTP and timed until
indexed, exactly as the plain bench times its round; then as many other new files go through the
plain pipeline (``bench_pipeline.run_plain``: no task system, as many processes as the capacity)
into the same base. The two alternate which goes first, round by round.

Reported per N: the durable batch's per-file upload-to-indexed p50/p99, its files/s, the median task
run (claim to end, the index call's own cost without the wait for a slot), and the plain pipeline's
files/s; ratios: p50 at the largest N over p50 at the smallest, and durable over plain files/s.
"""

from __future__ import annotations

import asyncio
import time

from domains.knowledge.bench import _create_base, _settle, _Stack, _timed_upload, named_document, tree_cpu
from domains.knowledge.bench_pipeline import Target, base_counts, prefill, run_plain
from domains.knowledge.stores import StoreConfig
from tasks_core.devkit.bench.report import Document, Rounds, ratio, summarize

# Document numbers: pre-fill files are 0..N-1; a round's new files start past every base size.
DURABLE_FIRST = 10_000_000
PLAIN_FIRST = 20_000_000
# Idle: the server used under this share of a core over a second, for at most IDLE_WAIT seconds.
IDLE_CPU_PERCENT = 10.0
IDLE_WAIT = 300.0


def durable(n: int) -> str:
    return f"durable-N{n}"


def plain(n: int) -> str:
    return f"plain-N{n}"


def p50_ratio_name(small: int, large: int) -> str:
    return f"durable p50 at N={large} / at N={small}"


def throughput_ratio_name(n: int) -> str:
    return f"durable / plain files/s at N={n}"


async def run(
    stack: _Stack, doc: Document, stores: StoreConfig, db_url: str, servers: dict[str, int | None]
) -> None:
    opts = stack.opts
    sizes = sorted(set(opts.base_sizes))
    doc.settings["base_sizes"] = sizes
    batch = f"{stack.files} new files of {opts.size} bytes"
    workers = f"one celery worker (prefork -c {opts.concurrency}), DTASK_CAPACITY={opts.capacity}"
    descriptions: dict[str, str] = {}
    for n in sizes:
        descriptions[durable(n)] = (
            f"base of {n} files; {batch}, {opts.batch} per request over HTTP; {workers}"
        )
        descriptions[plain(n)] = (
            f"base of {n} files; {batch} through the plain pipeline, {opts.capacity} processes"
        )
    rounds = Rounds(descriptions)
    # Untimed: the worker's processes pay their imports, connections and parse processes here.
    warm_base = await _create_base(stack.client, "warmup")
    _, _, warm_tasks = await _timed_upload(
        stack, warm_base, DURABLE_FIRST, min(stack.files, 4 * opts.capacity)
    )
    await _settle(stack, warm_tasks)
    pooled: dict[str, list[float]] = {name: [] for name in descriptions}
    seq = 0
    for round_no in range(1, opts.rounds + 1):
        for n in sizes:
            r = await stack.client.post(
                "/knowledge/bases", json={"name": f"n{n}-{round_no}-{time.time_ns()}"}
            )
            base = r.json()
            target = Target(stores, db_url, base["id"], int(base["dimension"]))
            started = time.monotonic()
            await prefill(target, lambda k: named_document(k, opts.size), n)
            prefill_seconds = time.monotonic() - started
            prefilled = await base_counts(target)
            idle_seconds = await _until_idle(servers.get("milvus"))
            order = [durable, plain] if round_no % 2 else [plain, durable]
            for variant in order:
                seq += 1
                pids = {
                    **servers,
                    **(
                        {"api": stack.procs[0].pid, "worker": stack.procs[1].pid}
                        if variant is durable
                        else {}
                    ),
                }
                cpu = _Cpu(pids)
                if variant is durable:
                    data, latencies, tasks = await _timed_upload(stack, target.base_id, DURABLE_FIRST + n)
                    await _settle(stack, tasks)
                else:
                    docs = [
                        named_document(k, opts.size)
                        for k in range(PLAIN_FIRST + n, PLAIN_FIRST + n + stack.files)
                    ]
                    run = await asyncio.to_thread(run_plain, target, docs, opts.capacity)
                    elapsed, latencies = run.seconds, [s * 1000 for s in run.done]
                    cpu.add("plain", run.cpu_seconds)
                    stats = summarize(latencies)
                    data = {
                        "files": len(docs),
                        "files_per_s": len(docs) / elapsed if elapsed > 0 else None,
                        "elapsed_seconds": elapsed,
                        "p50_ms": stats.get("p50"),
                        "p99_ms": stats.get("p99"),
                    }
                data.update(
                    base_files=n,
                    prefill_seconds=prefill_seconds,
                    milvus_idle_wait_seconds=idle_seconds,
                    prefilled=prefilled,
                    cpu_ms_per_file=cpu.per_file(int(data["files"])),
                )
                data["cpu_ms_per_file_total"] = sum(data["cpu_ms_per_file"].values())
                pooled[variant(n)] += latencies
                rounds.add(variant(n), round_no, seq, data)
    _report(doc, rounds, pooled, sizes)


def _report(doc: Document, rounds: Rounds, pooled: dict[str, list[float]], sizes: list[int]) -> None:
    stats = {name: summarize(values) for name, values in pooled.items()}
    for name, summary in stats.items():
        rounds.extra[name]["pooled_upload_to_indexed_ms"] = summary
    doc.data["variants"] = rounds.to_json()
    if len(sizes) > 1:
        doc.data["ratios"][p50_ratio_name(sizes[0], sizes[-1])] = ratio(
            stats[durable(sizes[-1])].get("p50"), stats[durable(sizes[0])].get("p50")
        )
    rows = []
    for n in sizes:
        d, p = rounds.medians(durable(n)), rounds.medians(plain(n))
        doc.data["ratios"][throughput_ratio_name(n)] = ratio(d.get("files_per_s"), p.get("files_per_s"))
        rows.append(
            [
                n,
                d.get("files_per_s"),
                stats[durable(n)].get("p50"),
                stats[durable(n)].get("p99"),
                d.get("task_run_p50_ms"),
                d.get("cpu_ms_per_file_total"),
                p.get("files_per_s"),
                stats[plain(n)].get("p50"),
                p.get("cpu_ms_per_file_total"),
                doc.data["ratios"][throughput_ratio_name(n)],
            ]
        )
    doc.table(
        "a batch of new files into a base of N files: durable (HTTP, tasks) beside the plain pipeline",
        [
            "base files",
            "durable files/s",
            "p50 ms",
            "p99 ms",
            "task run p50 ms",
            "CPU ms/file",
            "plain files/s",
            "plain p50 ms",
            "plain CPU ms/file",
            "durable/plain",
        ],
        rows,
    )
    doc.note(
        "targets: durable p50 at the largest N at most 1.3x at the smallest; "
        "durable/plain files/s at least 0.7"
    )
    doc.note(
        "CPU ms/file: api, worker (with its parse processes), Milvus and S3 servers, the bench process "
        "and the plain pipeline's processes (their start-up excluded); PostgreSQL, shared, not counted"
    )
    doc.note(
        "p50/p99: per file, from its request (durable) or the batch's start (plain) until it was indexed, so "
        "both include the wait for one of the capacity's slots or processes"
    )


class _Cpu:
    """CPU seconds spent from now on by each named process tree and by this process (``bench``),
    plus what is added (the plain pipeline's processes); PostgreSQL, a shared server, is not
    counted."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = {name: pid for name, pid in pids.items() if pid is not None}
        self.added: dict[str, float] = {}
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        out = {name: tree_cpu(pid) for name, pid in self.pids.items()}
        out["bench"] = time.process_time()
        return out

    def add(self, name: str, seconds: float) -> None:
        self.added[name] = self.added.get(name, 0.0) + seconds

    def per_file(self, files: int) -> dict[str, float]:
        end = self._now()
        spent = {name: end[name] - self.start[name] for name in end} | self.added
        return {name: 1000 * seconds / max(1, files) for name, seconds in spent.items()}


async def _until_idle(pid: int | None) -> float:
    """Seconds until the Milvus server's CPU use falls under IDLE_CPU_PERCENT (at most IDLE_WAIT)."""
    import psutil

    if pid is None:
        return 0.0
    started = time.monotonic()
    proc = psutil.Process(pid)
    proc.cpu_percent(None)
    while time.monotonic() - started < IDLE_WAIT:
        await asyncio.sleep(1.0)
        if proc.cpu_percent(None) < IDLE_CPU_PERCENT:
            break
    return time.monotonic() - started
