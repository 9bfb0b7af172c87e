"""`dtask bench submit`: how fast intents are committed and made runnable, in process and over HTTP.

No worker runs: this times submission alone. Variants, in alternating rounds:

- in process, through ``Submitter`` on the bench's own services (pool of 5):
  ``inproc-single`` (``submit`` one by one, one caller), ``inproc-batch100`` and ``inproc-batch1000``
  (``submit_many``). Each call commits, then publishes what capacity can take (the relay carries
  the rest as slots free). Intents/s = intents / wall time of the calls.
- over HTTP against one real ``dtask api`` process (``--clients`` concurrent aiohttp clients):
  ``http-healthz`` (GET /healthz: the api's own ceiling in this run), ``http-single`` (POST /tasks),
  ``http-batch1000`` (POST /tasks/batch of 1,000). Rates are reported as ratios to healthz, with
  request p50/p99 and the refused (4xx) and failed (5xx, transport) counts, and the CPU each request
  cost the api process, PostgreSQL, Redis and the bench's own clients: where the clients keep a
  core busy, the load generator, not the api, set the rate (and the ratio). These clients are
  aiohttp's, which spend about 0.1 ms of CPU per request: the api sets the rates.
- ``httpx-healthz``, ``httpx-single``, ``httpx-batch1000``: the same requests from httpx clients,
  the client most users' scripts use. httpx spends 1.1-1.6 ms of CPU per
  request, more than the api, so these clients set healthz's rate: the ratio says how the api
  keeps up with such a client, not what the api itself can do.
- ``procrastinate-single`` / ``procrastinate-batch1000``: Procrastinate's ``defer_async`` and
  ``batch_defer_async`` on the same PostgreSQL, when it is installed (``pip install -e .[bench]``).

The task tables are emptied between rounds, so every round submits into the same state.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from tasks_core.devkit.bench import cpu, peers
from tasks_core.devkit.bench.common import (
    BenchEnv,
    BenchError,
    CommonOptions,
    Proc,
    durable_services,
    effective_settings,
    poll,
    public_options,
)
from tasks_core.devkit.bench.report import Document, Rounds, alternate, ratio, summarize

NOOP = "diagnostics.noop"
BATCH = 1000


@dataclass
class SubmitOptions(CommonOptions):
    single: int = 1000  # intents submitted one by one per in-process round
    intents: int = 10000  # intents per in-process batch round (a multiple of 1,000 is exact)
    clients: int = 32
    http_requests: int = 3000  # GET /healthz and POST /tasks requests per round
    http_batches: int = 64  # POST /tasks/batch calls of 1,000 per round
    capacity: int = 4


QUICK = {"single": 20, "intents": 200, "clients": 4, "http_requests": 40, "http_batches": 2, "rounds": 1}


def run(opts: SubmitOptions) -> dict[str, Any]:
    if opts.clients < 1 or opts.http_requests < opts.clients or opts.http_batches < 1:
        raise ValueError("--http-requests must be at least --clients, and --http-batches at least 1")
    return asyncio.run(_run(opts))


def _variants(opts: SubmitOptions, with_procrastinate: bool) -> dict[str, str]:
    n = opts.intents
    variants = {
        "inproc-single": f"Submitter.submit one by one, {opts.single} intents, one caller",
        "inproc-batch100": f"Submitter.submit_many in batches of 100, {n} intents",
        "inproc-batch1000": f"Submitter.submit_many in batches of 1,000, {n} intents",
        "http-healthz": f"GET /healthz x {opts.http_requests}, {opts.clients} clients (the api's ceiling)",
        "http-single": f"POST /tasks x {opts.http_requests}, {opts.clients} clients",
        "http-batch1000": f"POST /tasks/batch of 1,000 x {opts.http_batches}, {opts.clients} clients",
        "httpx-healthz": f"GET /healthz x {opts.http_requests}, {opts.clients} httpx clients",
        "httpx-single": f"POST /tasks x {opts.http_requests}, {opts.clients} httpx clients",
        "httpx-batch1000": f"POST /tasks/batch of 1,000 x {opts.http_batches}, {opts.clients} httpx clients",
    }
    if with_procrastinate:
        variants["procrastinate-single"] = f"procrastinate defer_async one by one, {opts.single} jobs"
        variants["procrastinate-batch1000"] = f"procrastinate batch_defer_async of 1,000, {n} jobs"
    return variants


async def _run(opts: SubmitOptions) -> dict[str, Any]:
    import httpx

    try:
        import aiohttp
    except ImportError:
        raise BenchError("the HTTP variants' clients need aiohttp: pip install -e '.[bench]'") from None

    from tasks_core.devkit.processes import free_port

    pv = peers.procrastinate_version()
    variants = _variants(opts, pv is not None)
    doc = Document("submit", public_options(opts), quick=opts.quick)
    rounds = Rounds(variants)
    pooled: dict[str, list[float]] = {v: [] for v in variants if v.startswith("http")}
    async with BenchEnv("submit", opts) as env:
        db_url = await env.create_database("submit")
        services = durable_services(env, db_url, capacity=opts.capacity)
        secret = secrets.token_urlsafe(24)
        settings = env.dtask_settings(db_url, capacity=opts.capacity)
        doc.settings.update(api_env=effective_settings(settings), celery=env.celery_settings())
        settings["DTASK_API_KEYS"] = f"bench:{secret}:admin"  # admin: may submit diagnostics types
        port = free_port()
        api = env.start_api(settings, port)
        doc.settings["api_argv"] = api.argv
        pq = peers.Procrastinate(db_url) if pv is not None else None
        # Idle keep-alive connections are dropped by the client before uvicorn's 5 s keep-alive
        # timeout closes them: with the same 5 s on both sides, the first request of a round that
        # follows a long in-process round could meet a socket the server just closed.
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {secret}"}
        connector = aiohttp.TCPConnector(limit=opts.clients, keepalive_timeout=2.0)
        limits = httpx.Limits(max_connections=opts.clients, max_keepalive_connections=opts.clients,
                              keepalive_expiry=2.0)
        try:
            async with (
                aiohttp.ClientSession(base, connector=connector, timeout=aiohttp.ClientTimeout(total=120),
                                      headers=auth) as session,
                httpx.AsyncClient(base_url=base, timeout=120, limits=limits, headers=auth) as client,
            ):
                senders = {"http": _aiohttp_sender(session), "httpx": _httpx_sender(client)}
                await _wait_api(env, senders["http"], api)
                if pq is not None:
                    await pq.open()
                    doc.settings["procrastinate"] = pv
                for round_no, seq, name in alternate(list(variants), opts.rounds):
                    await _reset(env, services.engine, pq)
                    if name.startswith("inproc-"):
                        data = await _inproc(services, name, opts)
                    elif name.startswith("http"):
                        data, latencies = await _http(senders[name.split("-")[0]], name, opts, api, env)
                        pooled[name] += latencies
                        if "intents" in data:  # every accepted intent is a committed pending row
                            data["pending_rows"] = await _pending(services.engine)
                            if data["pending_rows"] < data["intents"]:
                                raise BenchError(f"{name}: {data['intents']} intents accepted but only "
                                                 f"{data['pending_rows']} pending rows")
                            # a request that failed in transit may still have committed
                            data["committed_unanswered"] = data["pending_rows"] - data["intents"]
                    else:
                        assert pq is not None
                        data = await pq.defer_round(opts.single if name.endswith("single") else opts.intents,
                                                    batch=1 if name.endswith("single") else BATCH)
                    rounds.add(name, round_no, seq, data)
        finally:
            if pq is not None:
                await pq.close()
            await services.close()
    return _finish(doc, rounds, pooled, opts, pv)


# (status, body) of one request; a transport failure raises one of _transport_errors().
Send = Callable[[str, str, Any], Awaitable[tuple[int, bytes]]]


def _aiohttp_sender(session: Any) -> Send:
    async def send(method: str, path: str, body: Any) -> tuple[int, bytes]:
        async with session.request(method, path, json=body) as response:
            return int(response.status), bytes(await response.read())

    return send


def _httpx_sender(client: Any) -> Send:
    async def send(method: str, path: str, body: Any) -> tuple[int, bytes]:
        response = await client.request(method, path, json=body)
        return int(response.status_code), bytes(response.content)

    return send


def _transport_errors() -> tuple[type[Exception], ...]:
    import aiohttp
    import httpx

    return aiohttp.ClientError, httpx.HTTPError


async def _wait_api(env: BenchEnv, send: Send, api: Proc) -> None:
    async def answers() -> bool:
        try:
            return (await send("GET", "/healthz", None))[0] == 200
        except _transport_errors():
            return False

    await poll(answers, within=60, interval=0.2, what="the api to answer", check=lambda: env.check_alive(api))


async def _reset(env: BenchEnv, engine: Any, pq: peers.Procrastinate | None) -> None:
    """Empty the tables and queues, without ending the api's pooled sessions (it keeps serving)."""
    env.clear_queues()
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE tasks, task_attempts, task_slots, idempotency_keys CASCADE"))
    if pq is not None:
        await pq.truncate(engine)


async def _inproc(services: Any, name: str, opts: SubmitOptions) -> dict[str, Any]:
    from tasks_core.submission import Submitter, TaskIntent

    submitter = Submitter(services)
    refused = unpublished = 0
    if name == "inproc-single":
        n = opts.single
        started = time.perf_counter()
        for _ in range(n):
            outcome = await submitter.submit(TaskIntent(NOOP, {}), owner="bench")
            unpublished += outcome.publish_error is not None
        elapsed = time.perf_counter() - started
    else:
        size = int(name.removeprefix("inproc-batch"))
        n = 0
        started = time.perf_counter()
        while n < opts.intents:
            batch = [TaskIntent(NOOP, {}) for _ in range(min(size, opts.intents - n))]
            for result in await submitter.submit_many(batch, owner="bench"):
                if isinstance(result, Exception):
                    refused += 1
                else:
                    unpublished += result.publish_error is not None
            n += len(batch)
        elapsed = time.perf_counter() - started
    pending = await _pending(services.engine)
    if pending != n - refused:
        raise BenchError(f"{name}: {n - refused} intents accepted but {pending} pending rows")
    return {"intents": n, "seconds": elapsed, "intents_per_s": n / elapsed, "refused": refused,
            "failed": unpublished, "pending_rows": pending}


async def _pending(engine: Any) -> int:
    async with engine.connect() as conn:
        query = text("SELECT count(*) FROM tasks WHERE status = 'pending'")
        return int((await conn.execute(query)).scalar_one())


async def _http(
    send: Send, name: str, opts: SubmitOptions, api: Proc, env: BenchEnv
) -> tuple[dict[str, Any], list[float]]:
    single_body = {"task_type": NOOP, "payload": {}}
    method, path, body, per_call, ok_status = {
        "healthz": ("GET", "/healthz", None, 0, 200),
        "single": ("POST", "/tasks", single_body, 1, 202),
        "batch1000": ("POST", "/tasks/batch", {"tasks": [single_body] * BATCH}, BATCH, 202),
    }[name.split("-", 1)[1]]
    total = opts.http_batches if per_call > 1 else opts.http_requests

    latencies: list[float] = []
    counts = {"ok": 0, "refused": 0, "failed": 0, "accepted": 0}
    remaining = total
    errors: list[str] = []

    async def one_client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t = time.perf_counter()
            try:
                code, answer = await send(method, path, body)
            except _transport_errors() as exc:
                counts["failed"] += 1
                errors.append(repr(exc))
                continue
            latencies.append((time.perf_counter() - t) * 1000)
            if code == ok_status:
                counts["ok"] += 1
                if per_call > 1:
                    counts["accepted"] += int(json.loads(answer)["accepted"])
                else:
                    counts["accepted"] += per_call
            elif 400 <= code < 500:
                counts["refused"] += 1
                errors.append(f"{code} {answer[:200]!r}")
            else:
                counts["failed"] += 1
                errors.append(f"{code} {answer[:200]!r}")

    log_start = api.log.stat().st_size
    cpu_before, client_before = cpu.snapshot([api.pid]), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(opts.clients)))
    elapsed = time.perf_counter() - started
    spent = cpu.ms_per_task(cpu_before, cpu.snapshot([api.pid]), total)
    client_ms = 1000 * (time.process_time() - client_before) / total
    env.check_alive(api)
    stats = summarize(latencies)
    data: dict[str, Any] = {
        "requests": total, "seconds": elapsed, "requests_per_s": total / elapsed,
        "p50_ms": stats.get("p50"), "p99_ms": stats.get("p99"), "ok": counts["ok"],
        "refused": counts["refused"], "failed": counts["failed"], "errors": errors[:5],
        # CPU per request: the api process, PostgreSQL, Redis, and the bench's own clients;
        # client_cores near 1 means the load generator, not the api, set the rate.
        "cpu_api_ms": spent["cpu_worker_main_ms"] + spent["cpu_worker_children_ms"],
        "cpu_postgres_ms": spent["cpu_postgres_ms"], "cpu_redis_ms": spent["cpu_redis_ms"],
        "cpu_client_ms": round(client_ms, 3), "client_cores": round(client_ms * total / elapsed / 1000, 3),
    }
    if counts["failed"]:
        data["api_errors"] = _first_error(api, log_start)
    if per_call:
        data["intents"] = counts["accepted"]
        data["intents_per_s"] = counts["accepted"] / elapsed
    return data, latencies


def _first_error(api: Proc, offset: int, lines: int = 40) -> str:
    """The api's first error of the round (its traceback), from the log written since ``offset``."""
    with api.log.open("rb") as f:
        f.seek(offset)
        text_lines = f.read().decode(errors="replace").splitlines()
    marks = [i for i, line in enumerate(text_lines) if "Traceback" in line or line.startswith("ERROR")]
    if not marks:
        return "(no error in the api log)"
    block = [text_lines[marks[0]]]
    for line in text_lines[marks[0] + 1:]:
        if line.startswith("INFO:"):  # the next access-log line ends the traceback
            break
        block.append(line)
    # The frames that say what failed are at the end of a traceback.
    return "\n".join(block if len(block) <= lines else [*block[:3], "...", *block[-lines:]])


def _finish(
    doc: Document, rounds: Rounds, pooled: dict[str, list[float]], opts: SubmitOptions, pv: str | None
) -> dict[str, Any]:
    for name, values in pooled.items():
        rounds.extra[name]["pooled_request_ms"] = summarize(values)
    doc.data["variants"] = rounds.to_json()
    # Each client's requests are divided by the same client's healthz rate.
    healthz = {kind: rounds.median(f"{kind}-healthz", "requests_per_s") for kind in ("http", "httpx")}
    single = rounds.median("inproc-single", "intents_per_s")
    ratios = doc.data["ratios"]
    for kind in ("http", "httpx"):
        ratios[f"{kind}-single / {kind}-healthz (requests/s)"] = ratio(
            rounds.median(f"{kind}-single", "requests_per_s"), healthz[kind])
        ratios[f"{kind}-batch1000 / {kind}-healthz (intents/s per requests/s)"] = ratio(
            rounds.median(f"{kind}-batch1000", "intents_per_s"), healthz[kind])
    for size in (100, 1000):
        ratios[f"inproc-batch{size} / inproc-single"] = ratio(
            rounds.median(f"inproc-batch{size}", "intents_per_s"), single)
    if pv is not None:
        ratios["inproc-batch1000 / procrastinate-batch1000"] = ratio(
            rounds.median("inproc-batch1000", "intents_per_s"),
            rounds.median("procrastinate-batch1000", "intents_per_s"))
        ratios["inproc-single / procrastinate-single"] = ratio(
            single, rounds.median("procrastinate-single", "intents_per_s"))
    rows = []
    for name in rounds.descriptions:
        m = rounds.medians(name)
        latency = rounds.extra[name].get("pooled_request_ms", {})
        # healthz submits nothing: its rate is requests/s, the ceiling the others are divided by
        rate = m.get("requests_per_s") if name.endswith("-healthz") else m.get("intents_per_s")
        ceiling = healthz.get(name.split("-")[0])
        rows.append([
            name, rate, ratio(rate, ceiling) if ceiling else None, latency.get("p50"), latency.get("p99"),
            sum(r.get("refused", 0) for r in rounds.rounds[name]),
            sum(r.get("failed", 0) for r in rounds.rounds[name]),
        ])
    doc.table("submit: median intents/s over rounds (healthz: requests/s)",
              ["variant", "intents/s", "x healthz", "p50 ms", "p99 ms", "refused", "failed"], rows)
    doc.note(f"one `dtask api` process, no worker, {opts.clients} concurrent clients in the bench process "
             "(http-: aiohttp, httpx-: httpx); ratios to GET /healthz of the same api and clients, same run")
    for name in rounds.descriptions:
        m = rounds.medians(name)
        if "cpu_api_ms" in m:
            doc.note(f"CPU ms per request, {name}: api {m['cpu_api_ms']:.2f}, postgres "
                     f"{m.get('cpu_postgres_ms', 0):.2f}, redis {m.get('cpu_redis_ms', 0):.2f}, client "
                     f"{m['cpu_client_ms']:.2f} (client busy {m['client_cores']:.2f} of a core)")
    doc.note("failed counts in-process intents left unpublished by a broker error, and HTTP 5xx/transport "
             "errors; refused counts 4xx answers and refused batch entries")
    for name in rounds.descriptions:
        failed = [r for r in rounds.rounds[name] if r.get("failed")]
        if failed:
            doc.note(f"{name}: {sum(r['failed'] for r in failed)} failed in {len(failed)} round(s); first "
                     f"answers {failed[0].get('errors')}; the api's traceback is in the round's api_errors")
    if pv is None:
        doc.note(peers.PROCRASTINATE_MISSING)
    return doc.finish()
