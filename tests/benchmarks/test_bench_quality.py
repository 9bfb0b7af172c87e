"""`dtask bench knowledge-quality` (and `knowledge-ingest --embedder`): the corpus format, the ranks
and scores, and the bench end to end on the shipped English corpus with the hashing embedder beside
a real all-MiniLM-L6-v2, through its own api, worker, milvus-lite and SeaweedFS on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from domains.knowledge import bench_model
from domains.knowledge.bench import IngestOptions
from domains.knowledge.bench import run as run_ingest
from domains.knowledge.bench_quality import DEFAULT_CORPUS, load_corpus, rank, scores
from tests.benchmarks.test_bench_smoke import _root
from tests.domains.knowledge.test_local_model import model_dir


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tasks_core.devkit.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("bench-redis"))
    url = server.start()
    try:
        yield url.rsplit("/", 1)[0]
    finally:
        server.stop()


def test_the_shipped_corpus_has_distinct_documents_each_asked_about() -> None:
    corpus = load_corpus(DEFAULT_CORPUS)
    assert corpus.name == "en_corpus"
    assert len(corpus.documents) >= 20 and len(corpus.questions) >= 40
    assert len({content for _, content in corpus.documents}) == len(corpus.documents)
    asked = {a for q in corpus.questions for a in q.answers}
    assert asked == {name for name, _ in corpus.documents}
    assert len({q.text for q in corpus.questions}) == len(corpus.questions)


def write_corpus(root: Path, questions: str, docs: dict[str, str] | None = None) -> Path:
    (root / "docs").mkdir(parents=True)
    for name, body in (docs if docs is not None else {"a.txt": "alpha", "b.txt": "beta"}).items():
        (root / "docs" / name).write_text(body)
    (root / "questions.jsonl").write_text(questions)
    return root


def test_a_corpus_takes_one_answer_or_several(tmp_path: Path) -> None:
    lines = (
        '{"question": "first?", "answer": "a.txt"}\n\n{"question": "both?", "answer": ["a.txt", "b.txt"]}\n'
    )
    corpus = load_corpus(write_corpus(tmp_path / "c", lines))
    assert [(q.text, sorted(q.answers)) for q in corpus.questions] == [
        ("first?", ["a.txt"]),
        ("both?", ["a.txt", "b.txt"]),
    ]


@pytest.mark.parametrize(
    ("questions", "docs", "message"),
    [
        (
            '{"question": "q?", "answer": "missing.txt"}\n',
            None,
            r"line 1: no such document \['missing.txt'\]",
        ),
        ('{"question": "q?", "answer": "a.txt"}\n{"question": "q?"}\n', None, "line 2: KeyError"),
        ("not json\n", None, "line 1: JSONDecodeError"),
        ('{"question": " ", "answer": "a.txt"}\n', None, "line 1"),
        ("\n", None, "holds no question"),
        ('{"question": "q?", "answer": "a.txt"}\n', {}, "docs/ holds no file"),
    ],
)
def test_a_malformed_corpus_is_refused_with_the_line(
    tmp_path: Path, questions: str, docs: dict[str, str] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_corpus(write_corpus(tmp_path / "c", questions, docs))


def test_a_directory_without_the_corpus_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs docs/ and questions\.jsonl"):
        load_corpus(tmp_path)


def test_ranks_count_distinct_files_and_scores_average_them() -> None:
    hits = ["b.txt", "b.txt", "c.txt", "a.txt", "c.txt"]
    assert rank(frozenset({"a.txt"}), hits) == 3
    assert rank(frozenset({"c.txt", "a.txt"}), hits) == 2
    assert rank(frozenset({"z.txt"}), hits) is None
    assert scores([1, 2, None, 5, 10]) == {
        "mrr": (1 + 0.5 + 0.2 + 0.1) / 5,
        "hit@1": 0.2,
        "hit@5": 0.6,
    }


def test_ingest_takes_an_embedder_only_for_the_plain_ingest() -> None:
    for extra in ({"beside_hostile": True}, {"base_sizes": (0, 10)}):
        with pytest.raises(ValueError, match="--embedder goes with the plain ingest"):
            run_ingest(IngestOptions(embedder="hashing", **extra))  # type: ignore[arg-type]


def test_the_model_cost_is_measured_on_the_chunks_an_ingest_makes() -> None:
    from domains.knowledge.bench import named_document

    texts = bench_model.chunks_of([named_document(n, 4096) for n in range(3)])
    assert len(texts) >= 3 and all(len(t) <= 1000 for t in texts)
    cost = bench_model.model_cost(f"sentence-transformers:{model_dir()}", texts)
    assert cost.name.startswith("sentence-transformers:model@") and cost.chunks == len(texts)
    assert cost.cpu_seconds > 0 and cost.seconds > 0 and cost.load_seconds > 0


def test_only_the_embedding_servers_variables_are_passed() -> None:
    environ = {"DTASK_EMBEDDING_URL": "http://127.0.0.1:7997/v1", "DTASK_DATABASE_URL": "x", "HOME": "/root"}
    assert bench_model.passed_environment(environ) == {"DTASK_EMBEDDING_URL": "http://127.0.0.1:7997/v1"}


@pytest.mark.system
@pytest.mark.benchmark  # a minute of model loading and indexing: `pytest -m benchmark`
def test_knowledge_quality_a_real_model_beats_hashing_on_paraphrases(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "quality.json"
    model = f"sentence-transformers:{model_dir()}"
    args = ["bench", "knowledge-quality", "--quick", "--embedder", "hashing", "--embedder", model]
    result = CliRunner().invoke(_root(), [*args, "--out", str(out), "--redis-url", redis_url])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    assert data["workload"] == "knowledge-quality"
    hashing, minilm = data["variants"]["hashing / en_corpus"], data["variants"][f"{model} / en_corpus"]
    corpus = load_corpus(DEFAULT_CORPUS)
    for variant in (hashing, minilm):
        assert variant["questions"] == len(variant["items"]) == len(corpus.questions)
        assert variant["chunks"] >= len(corpus.documents) and variant["index_seconds"] > 0
        assert scores([i["rank"] for i in variant["items"]])["mrr"] == variant["mrr"]
    # The base recorded each embedder's own name, so each was used end to end.
    assert hashing["embedder_name"] == "hashing-v2-1024" and hashing["dimension"] == 1024
    assert minilm["embedder_name"].startswith("sentence-transformers:model@") and minilm["dimension"] == 384
    # What the model buys: paraphrased questions find their document.
    assert minilm["mrr"] >= 0.9 and minilm["hit@5"] >= 0.95
    assert minilm["mrr"] > hashing["mrr"] and minilm["hit@1"] > hashing["hit@1"]
    assert [row[0] for row in data["table"]["rows"]] == ["hashing-v2-1024", minilm["embedder_name"]]


@pytest.mark.benchmark
def test_knowledge_ingest_with_a_real_model_reports_its_share(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "ingest.json"
    args = ["bench", "knowledge-ingest", "--quick", "--embedder", f"sentence-transformers:{model_dir()}"]
    result = CliRunner().invoke(_root(), [*args, "--out", str(out), "--redis-url", redis_url])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    [round_] = data["variants"]["batch-upload"]["rounds"]
    assert round_["files"] == round_["indexed"] == data["settings"]["files"] and round_["errors"] == 0
    model = data["model"]
    assert model["embedder"].startswith("sentence-transformers:model@") and model["chunks_per_s"] > 0
    assert data["settings"]["worker_env"]["embedder"].startswith("sentence-transformers:")
    assert 0 < data["ratios"]["model share of the worker's CPU"] <= 1.5
