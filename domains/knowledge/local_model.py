"""An in-process model: ``DTASK_EMBEDDER=sentence-transformers:PATH`` (the ``local-model`` extra).

PATH is a sentence-transformers model directory on disk (what ``SentenceTransformer.save`` writes, or
a downloaded Hugging Face snapshot of one). It is never fetched from a hub: a path that is not a
model directory is refused rather than taken for a model id to download.

Building the embedder reads only the directory (its name, dimension and weights' digest): callers
build it on their event loop, and importing torch and loading the model takes seconds, many more
when several pool processes start at once, which would stall their lease heartbeats. The model is
loaded by the first ``embed`` call, which ``embed_texts`` runs in a thread, and checked against
the dimension the directory declares. A directory whose dimension cannot be read from its
configuration is loaded at once instead.

The name a base records is ``sentence-transformers:<directory name>@<digest of the weights>``, so two
different models that happen to sit in directories of the same name are not mistaken for one
another, and the same model copied elsewhere keeps its name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXTRA = "pip install 'durable-tasks[local-model]'"
# A sentence-transformers directory has modules.json; a plain transformers one (sentence-transformers
# then adds mean pooling) has config.json.
MARKERS = ("modules.json", "config.json")
WEIGHTS = ("*.safetensors", "*.bin", "*.onnx")
DIGEST_CHARS = 12
_OLD_POOLING_FLAGS = (
    "pooling_mode_cls_token",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)


class LocalModelError(ValueError):
    """The model cannot be used (one line saying why); a ValueError like every unusable DTASK_EMBEDDER."""


def weights_digest(directory: Path) -> str:
    """A short digest of the model's weight files, names included, in a stable order."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in WEIGHTS for p in directory.rglob(pattern) if p.is_file()})
    for path in files:
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:DIGEST_CHARS]


def _config(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def declared_dimension(directory: Path) -> int | None:
    """The length of the model's vectors as its modules.json and their configuration files declare
    it: the last module that sets one (a Dense layer's outputs, a pooling's modes times the token
    dimension, the transformer's hidden size). None without modules.json (a plain transformers
    directory, whose pooling sentence-transformers makes up at load) or past a module of another
    kind."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    for module in reversed(modules if isinstance(modules, list) else []):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        config = _config(directory / str(module.get("path") or "") / "config.json")
        if kind in ("Normalize", "Dropout", "LayerNorm"):  # the dimension of what they follow
            continue
        if kind == "Dense":
            value = config.get("out_features")
        elif kind == "Pooling":
            size = config.get("embedding_dimension", config.get("word_embedding_dimension"))
            mode = config.get("pooling_mode")  # newer configurations; older ones have one flag per mode
            modes = [mode] if isinstance(mode, str) else mode if isinstance(mode, list) else None
            count = len(modes) if modes is not None else sum(bool(config.get(f)) for f in _OLD_POOLING_FLAGS)
            value = size * count if isinstance(size, int) else None
        elif kind == "Transformer":
            value = config.get("hidden_size")
        else:
            return None
        return value if isinstance(value, int) and value > 0 else None
    return None


class SentenceTransformerEmbedder:
    """A sentence-transformers model on this machine's CPU (or GPU, where torch finds one).

    ``embed`` is CPU work (``embed_texts`` runs it in a thread); calls are serialised, since a
    fast tokenizer refuses concurrent use and torch already spreads one batch over the cores.
    """

    def __init__(self, path: str) -> None:
        if not path:
            raise LocalModelError("sentence-transformers:PATH needs the path of a model directory")
        directory = Path(path).expanduser()
        if not directory.is_dir() or not any((directory / m).is_file() for m in MARKERS):
            raise LocalModelError(f"{path} is not a sentence-transformers model directory (no modules.json)")
        missing = [m for m in ("sentence_transformers", "torch") if importlib.util.find_spec(m) is None]
        if missing:  # found without importing them: that is the first embed's work
            raise LocalModelError(
                f"sentence-transformers:PATH needs the local-model extra ({EXTRA}): no {missing[0]}"
            )
        if not any(next(directory.rglob(pattern), None) for pattern in WEIGHTS):
            raise LocalModelError(f"{path} holds no model weights (*.safetensors, *.bin, *.onnx)")
        self.path = directory
        self.name = f"sentence-transformers:{directory.resolve().name}@{weights_digest(directory)}"
        self._lock = threading.Lock()
        self._model: Any = None
        try:
            declared = declared_dimension(directory)
        except (OSError, ValueError, AttributeError) as exc:
            raise LocalModelError(f"{path}: modules.json is not readable: {exc}") from None
        if declared is None:
            self._model = self._load()
            declared = self._model.get_embedding_dimension()
        if not declared:
            raise LocalModelError(f"{path}: the model does not say its embedding dimension")
        self.dimension = int(declared)

    def _load(self) -> Any:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise LocalModelError(
                f"sentence-transformers:PATH needs the local-model extra ({EXTRA}): {exc}"
            ) from None
        try:
            return SentenceTransformer(str(self.path), local_files_only=True)
        except Exception as exc:  # whatever the library raises for a broken directory
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LocalModelError(f"{self.path}: the model does not load: {first}") from None

    def model(self) -> Any:
        """The loaded model (loaded now if it was not), checked against the declared dimension."""
        with self._lock:
            if self._model is None:
                model = self._load()
                if model.get_embedding_dimension() != self.dimension:
                    raise LocalModelError(
                        f"{self.path}: the model gives {model.get_embedding_dimension()} dimensions, "
                        f"its configuration declares {self.dimension}"
                    )
                self._model = model
            return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        model = self.model()
        with self._lock:
            vectors = model.encode(
                list(texts), normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
        out: list[list[float]] = vectors.tolist()
        return out
