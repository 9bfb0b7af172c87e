"""Every `dtask bench` workload, tiny (`--quick`), end to end, so none of them can rot.

These check that each workload runs its variants, cleans up, and writes a result with the agreed
shape and positive numbers; they assert nothing about performance. Each spawns real worker
processes against a temporary database on the session's PostgreSQL (DTASK_TEST_ADMIN_URL) and a
private embedded Redis, so a concurrent test session's Redis DB indices are never touched.
The full-size runs are `dtask bench WORKLOAD` without `--quick` (see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tasks_core.devkit.bench import peers
from tasks_core.devkit.bench.cli import bench_app
from tests.tools import require_rabbitmq

EXPECTED_VARIANTS = {
    # Quick throughput: capacity 2 and capacity = concurrency 3; pgbench with 1 and 3 clients.
    "throughput": {"durable-cap2", "durable-cap3", "durable-cap3-via-broker", "plain-celery", "pgbench-c1",
                   "pgbench-c3"},
    "latency": {"idle", "busy", "saturated", "plain-celery"},
    "recovery": {"kill-worker", "kill-child"},
    "scale": {"small", "large"},
    "soak": {"durable", "plain-celery"},
    "density": {"prefork-4", "dense-4", "prefork-noop", "dense-noop"},
    "submit": {"inproc-single", "inproc-batch100", "inproc-batch1000", "http-healthz", "http-single",
               "http-batch1000", "httpx-healthz", "httpx-single", "httpx-batch1000"},
}
# Peers join the throughput, submit and density runs where installed (the bench extra; scripts/bench-peers).
PEER_VARIANTS = {
    "throughput": {"procrastinate": peers.procrastinate_version, "arq": peers.peers_python},
    "submit": {"procrastinate-single": peers.procrastinate_version,
               "procrastinate-batch1000": peers.procrastinate_version},
    "density": {"procrastinate-4": peers.procrastinate_version, "arq-4": peers.peers_python},
    "latency": {"procrastinate": peers.procrastinate_version, "arq": peers.peers_python},
}
# The headline number of each variant (a median across rounds) that must be positive.
HEADLINE = {
    "throughput": ["tasks_per_s"],
    "latency": ["to_running_p50_ms", "to_running_p99_ms", "to_terminal_p50_ms"],
    "recovery": ["p50_recovery_seconds", "max_recovery_seconds", "bound_seconds"],
    "scale": [f"{op}_median_ms" for op in ("insert", "claim", "finish", "publish", "summary", "view")],
    "soak": ["rss_start_mb", "rss_end_mb", "tasks_per_s"],
    "density": ["seconds_until_all_running", "running_rss_mb", "running_pss_mb", "pss_mb_per_task"],
    "submit": ["seconds", "intents_per_s"],
    # A variant that measures something else names its own headline.
    "density:prefork-noop": ["tasks_per_s"],
    "density:dense-noop": ["tasks_per_s"],
    "submit:http-healthz": ["seconds", "requests_per_s"],
    "submit:httpx-healthz": ["seconds", "requests_per_s"],
    # Their one time stamp is the run: no separate terminal.
    "latency:plain-celery": ["to_running_p50_ms", "to_running_p99_ms"],
    "latency:arq": ["to_running_p50_ms", "to_running_p99_ms"],
}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tasks_core.devkit.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("bench-redis"))
    url = server.start()
    try:
        yield url.rsplit("/", 1)[0]
    finally:
        server.stop()


def _root() -> typer.Typer:
    # Mounted exactly as the main CLI mounts it.
    root = typer.Typer()
    root.callback()(lambda: None)
    root.add_typer(bench_app, name="bench")
    return root


def run_bench(workload: str, tmp_path: Path, redis_url: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{workload}.json"
    result = CliRunner().invoke(
        _root(), ["bench", workload, "--quick", "--out", str(out), "--redis-url", redis_url, *extra]
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert f"result: {out}" in result.output
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def check_shape(data: dict[str, Any], workload: str) -> None:
    assert data["workload"] == workload
    assert data["quick"] is True
    assert data["machine"]["cpu_count"] == os.cpu_count()
    assert data["elapsed_seconds"] > 0
    assert data["settings"]["rounds"] == 1
    installed = {name for name, probe in PEER_VARIANTS.get(workload, {}).items() if probe() is not None}
    assert set(data["variants"]) == EXPECTED_VARIANTS[workload] | installed
    for name, variant in data["variants"].items():
        assert variant["description"]
        assert len(variant["rounds"]) == 1, name
        for key in HEADLINE.get(f"{workload}:{name}", HEADLINE[workload]):
            assert variant["median"][key] > 0, (name, key, variant["median"])
    assert data["ratios"]
    for name, value in data["ratios"].items():
        assert isinstance(value, int | float) and value > 0, (name, value)
    table = data["table"]
    assert table["columns"] and len(table["rows"]) >= 2


@pytest.mark.system
def test_throughput(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("throughput", tmp_path, redis_url)
    check_shape(data, "throughput")
    durable = data["variants"]["durable-cap2"]["rounds"][0]
    assert durable["succeeded"] == durable["tasks"] == data["settings"]["tasks"]
    assert data["settings"]["worker_settings"]["durable-cap2"]["env"]["capacity"] == 2
    assert data["settings"]["worker_settings"]["durable-cap3-via-broker"]["env"]["worker_run_next"] == 0
    assert data["settings"]["worker_settings"]["durable-cap3"]["env"]["worker_run_next"] > 0
    assert data["settings"]["celery"]["worker_disable_prefetch"] is True
    # Where the CPU went, per task: the durable pool children claim, run and finish, PostgreSQL serves
    # them; the plain worker touches no database.
    assert durable["cpu_worker_children_ms"] > 0 and durable["cpu_postgres_ms"] > 0
    plain = data["variants"]["plain-celery"]["rounds"][0]
    assert plain["cpu_worker_main_ms"] > 0 and plain["cpu_worker_children_ms"] > 0
    assert any(note.startswith("CPU ms per task, durable-cap2:") for note in data["notes"])
    # A peer that is not installed is named in one line, and the run goes on without it.
    for peer, missing in (("procrastinate", peers.PROCRASTINATE_MISSING), ("arq", peers.ARQ_MISSING)):
        assert (missing in data["notes"]) == (peer not in data["variants"])
        if peer in data["variants"]:
            assert data["ratios"][f"durable-cap2 / {peer}"] > 0


@pytest.mark.system
def test_submit(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("submit", tmp_path, redis_url)
    check_shape(data, "submit")
    settings = data["settings"]
    for name, variant in data["variants"].items():
        one = variant["rounds"][0]
        assert one["refused"] == one["failed"] == 0, (name, one)
        if name.startswith("inproc"):
            n = settings["single"] if name.endswith("single") else settings["intents"]
            assert one["intents"] == one["pending_rows"] == n
    batch = data["variants"]["http-batch1000"]["rounds"][0]
    assert batch["intents"] == batch["pending_rows"] == settings["http_batches"] * 1000
    single = data["variants"]["http-single"]["rounds"][0]
    assert single["intents"] == single["pending_rows"] == settings["http_requests"]
    assert data["ratios"]["http-single / http-healthz (requests/s)"] > 0
    assert data["ratios"]["httpx-single / httpx-healthz (requests/s)"] > 0
    httpx_single = data["variants"]["httpx-single"]["rounds"][0]
    assert httpx_single["intents"] == httpx_single["pending_rows"] == settings["http_requests"]
    # Who spent the CPU of a request: a submission costs the api and PostgreSQL, healthz no database.
    assert single["cpu_api_ms"] > 0 and single["cpu_postgres_ms"] > 0 and single["cpu_client_ms"] > 0
    assert any(note.startswith("CPU ms per request, http-single:") for note in data["notes"])


@pytest.mark.system
def test_latency(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("latency", tmp_path, redis_url)
    check_shape(data, "latency")
    for variant in data["variants"].values():
        pooled = variant["pooled"]["submit_to_running_ms"]
        assert pooled["n"] == data["settings"]["samples"]
        assert 0 < pooled["p50"] <= pooled["p99"]
        assert variant["rounds"][0]["succeeded"] == pooled["n"]
    # one hand-off per no-op: each was claimed in a slot a finished task had freed
    handoff = data["variants"]["saturated"]["pooled"]["relay_handoff_ms"]
    assert handoff["n"] == data["settings"]["samples"]
    assert 0 < handoff["p50"] <= handoff["p99"]
    # Idle beside the peers that ran; a missing one is named in one line.
    for peer in ("plain-celery", "procrastinate", "arq"):
        assert (f"idle / {peer} (submit-to-running p50)" in data["ratios"]) == (peer in data["variants"])
    for peer, missing in (("procrastinate", peers.PROCRASTINATE_MISSING), ("arq", peers.ARQ_MISSING)):
        assert (missing in data["notes"]) == (peer not in data["variants"])
    procrastinate = data["variants"].get("procrastinate")
    if procrastinate is not None:  # its own events: started before succeeded
        pooled = procrastinate["pooled"]
        assert pooled["submit_to_running_ms"]["p50"] <= pooled["submit_to_terminal_ms"]["p50"]


@pytest.mark.system
def test_recovery(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("recovery", tmp_path, redis_url)
    check_shape(data, "recovery")
    settings = data["settings"]
    assert settings["bound_seconds"] == settings["lease_seconds"] + settings["reconcile_seconds"]
    worker = data["variants"]["kill-worker"]["rounds"][0]
    assert worker["tasks_killed"] == data["settings"]["tasks"]
    assert data["variants"]["kill-child"]["rounds"][0]["tasks_killed"] == 1
    for variant in data["variants"].values():
        assert variant["rounds"][0]["outcomes"] == ["failed:lease_expired"]


def test_scale(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("scale", tmp_path, redis_url)
    check_shape(data, "scale")
    for name in ("small", "large"):
        assert data["variants"][name]["load_seconds"] > 0
        assert data["variants"][name]["pooled_ms"]["claim"]["n"] == data["settings"]["ops"]


@pytest.mark.system
def test_soak(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("soak", tmp_path, redis_url)
    check_shape(data, "soak")
    for variant in data["variants"].values():
        series = variant["series"][0]
        assert series and series[-1]["done"] == data["settings"]["tasks"]
        assert all(s["rss_kb"] > 0 and s["processes"] > 1 for s in series)


@pytest.mark.system
def test_density(tmp_path: Path, redis_url: str) -> None:
    data = run_bench("density", tmp_path, redis_url)
    check_shape(data, "density")
    for mode in ("prefork", "dense"):
        assert data["variants"][f"{mode}-4"]["rounds"][0]["tasks"] == 4
        noop = data["variants"][f"{mode}-noop"]["rounds"][0]
        assert noop["succeeded"] == noop["tasks"] == 20 and noop["tasks_per_s"] > 0
    # Peers run the same 4 sleeps where installed, and a missing one is named in one line.
    for peer, missing in (("procrastinate", peers.PROCRASTINATE_MISSING), ("arq", peers.ARQ_MISSING)):
        assert (missing in data["notes"]) == (f"{peer}-4" not in data["variants"])
        if f"{peer}-4" in data["variants"]:
            assert data["variants"][f"{peer}-4"]["rounds"][0]["tasks"] == 4
            assert data["ratios"][f"{peer}-4 / dense-4 (PSS per task)"] > 0


@pytest.mark.benchmark
def test_throughput_on_rabbitmq(tmp_path: Path, redis_url: str) -> None:
    """`--broker amqp://…`: the same comparison through a vhost of the run's own, deleted at the end
    (about 20 s even this small, so with the full-size runs: `pytest -m benchmark`)."""
    import subprocess

    require_rabbitmq()
    data = run_bench("throughput", tmp_path, redis_url, "--tasks", "20", "--warmup", "2",
                     "--pgbench-clients", "1", "--pgbench-seconds", "1", "--no-peers",
                     "--broker", "amqp://guest:guest@127.0.0.1:5672/")
    broker = data["settings"]["broker"]
    assert broker["kind"] == "rabbitmq" and broker["url"] == "amqp://guest:***@127.0.0.1:5672/", broker
    assert set(data["variants"]) == {
        "durable-cap2", "durable-cap3", "durable-cap3-via-broker", "plain-celery", "pgbench-c1"}
    durable = data["variants"]["durable-cap2"]["rounds"][0]
    assert durable["succeeded"] == durable["tasks"] == 20
    assert data["variants"]["plain-celery"]["median"]["tasks_per_s"] > 0
    assert data["settings"]["worker_settings"]["durable-cap2"]["env"]["capacity"] == 2
    vhosts = subprocess.run(["rabbitmqctl", "--quiet", "list_vhosts"], capture_output=True, text=True,
                            check=True, timeout=60).stdout.split()
    assert broker["vhost"] not in vhosts


def test_refuses_a_redis_db_in_use(tmp_path: Path, redis_url: str) -> None:
    """Someone else's keys in the chosen DB index stop the run before anything is created."""
    import redis

    client = redis.Redis.from_url(f"{redis_url}/12")
    client.set("someone-else", "1")
    try:
        result = CliRunner().invoke(_root(), ["bench", "scale", "--quick", "--out", str(tmp_path / "x.json"),
                                              "--redis-url", redis_url, "--redis-db", "12"])
        assert result.exit_code == 1
        assert "holds 1 keys" in result.output
        assert client.get("someone-else") == b"1"
        assert not (tmp_path / "x.json").exists()
    finally:
        client.flushdb()
        client.close()


@pytest.mark.benchmark
@pytest.mark.parametrize("workload", sorted(EXPECTED_VARIANTS))
def test_full_size(workload: str, tmp_path: Path) -> None:
    """The real benchmark (minutes each; `pytest -m benchmark`), on the machine's Redis DB 13."""
    out = tmp_path / f"{workload}.json"
    result = CliRunner().invoke(_root(), ["bench", workload, "--out", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert json.loads(out.read_text())["workload"] == workload
