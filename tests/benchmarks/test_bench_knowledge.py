"""`dtask bench knowledge-ingest`, tiny (`--quick`), end to end, so it cannot rot: plain, with
`--beside-hostile` and with `--base-size`; full size under `-m benchmark`. It starts its own api,
worker, milvus-lite and SeaweedFS on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from domains.knowledge.bench import ALONE, BESIDE, P99_RATIO, TIME_RATIO
from domains.knowledge.bench_scaling import durable, p50_ratio_name, plain, throughput_ratio_name
from tests.benchmarks.test_bench_smoke import _root


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tasks_core.devkit.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("bench-redis"))
    url = server.start()
    try:
        yield url.rsplit("/", 1)[0]
    finally:
        server.stop()


@pytest.mark.system
def test_knowledge_ingest_quick(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "ingest.json"
    result = CliRunner().invoke(
        _root(), ["bench", "knowledge-ingest", "--quick", "--out", str(out), "--redis-url", redis_url]
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    assert data["workload"] == "knowledge-ingest" and data["quick"] is True
    [round_] = data["variants"]["batch-upload"]["rounds"]
    assert round_["files"] == round_["indexed"] == data["settings"]["files"] and round_["errors"] == 0
    assert round_["files_per_s"] > 0 and 0 < round_["p50_ms"] <= round_["p99_ms"]
    assert data["variants"]["batch-upload"]["pooled_upload_to_indexed_ms"]["n"] == data["settings"]["files"]
    assert data["table"]["rows"] and "api_keys" not in json.dumps(data["settings"]["worker_env"])


@pytest.mark.system
def test_knowledge_ingest_beside_hostile_quick(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "isolation.json"
    args = ["bench", "knowledge-ingest", "--quick", "--beside-hostile", "--out", str(out)]
    result = CliRunner().invoke(_root(), [*args, "--redis-url", redis_url])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    files = data["settings"]["files"]
    assert set(data["variants"]) == {ALONE, BESIDE}
    for variant in data["variants"].values():
        [round_] = variant["rounds"]
        assert round_["files"] == round_["indexed"] == files and round_["errors"] == 0
        assert round_["files_per_s"] > 0 and round_["worker_peak_rss_mb"] > 0
        assert variant["pooled_upload_to_indexed_ms"]["n"] == files
    assert data["ratios"][TIME_RATIO] > 0 and data["ratios"][P99_RATIO] > 0
    # Every hostile file ends error_parsing, with a message naming the limit's setting.
    hostile = data["variants"][BESIDE]
    [round_] = hostile["rounds"]
    assert sorted(e["filename"] for e in round_["a_endings"]) == sorted(data["settings"]["hostile_files"])
    for ending in round_["a_endings"]:
        assert ending["status"] == "error_parsing" and "(DTASK_KNOWLEDGE_" in ending["error_message"], ending
    assert hostile["a_error_parsing"] == hostile["a_files"] == 3
    assert [row[0] for row in data["table"]["rows"]] == [ALONE, BESIDE]


@pytest.mark.system
def test_knowledge_ingest_base_sizes_quick(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "base-sizes.json"
    sizes = ["--base-size", "0", "--base-size", "40"]
    args = ["bench", "knowledge-ingest", "--quick", *sizes, "--out", str(out)]
    result = CliRunner().invoke(_root(), [*args, "--redis-url", redis_url])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    files = data["settings"]["files"]
    assert set(data["variants"]) == {durable(0), plain(0), durable(40), plain(40)}
    for n in (0, 40):
        [d] = data["variants"][durable(n)]["rounds"]
        assert d["files"] == d["indexed"] == files and d["errors"] == 0 and d["task_run_p50_ms"] > 0
        [p] = data["variants"][plain(n)]["rounds"]
        assert p["files"] == files and p["files_per_s"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"]
        # The pre-filled base is an honest one: every file indexed, a vector and an original each.
        filled = d["prefilled"]
        assert filled["indexed_files"] == filled["originals"] == n
        assert filled["vectors"] == filled["chunk_rows"] >= n
        assert d["cpu_ms_per_file"]["worker"] > 0 and p["cpu_ms_per_file"]["plain"] > 0
    assert data["ratios"][p50_ratio_name(0, 40)] > 0
    assert data["ratios"][throughput_ratio_name(40)] > 0
    assert [row[0] for row in data["table"]["rows"]] == [0, 40]


@pytest.mark.benchmark
def test_knowledge_ingest_full_size(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    result = CliRunner().invoke(_root(), ["bench", "knowledge-ingest", "--out", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert json.loads(out.read_text())["workload"] == "knowledge-ingest"
