"""CJK text, shared by the knowledge, graph and evaluation domains: which characters are CJK, and
jieba (Chinese word segmentation and part-of-speech tagging) loaded once per process.

Chinese, Japanese and Korean runs are read differently from space-separated scripts, so every
module that splits text into words agrees here on what a CJK run is.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

# Hangul jamo, kana (with the phonetic extensions), Han (extension A, unified, compatibility) and
# Hangul syllables. Punctuation is not in it: a full stop or comma ends a run.
CJK_CHARS = "\u1100-\u11ff\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
CJK_RUN = re.compile(f"[{CJK_CHARS}]+")

_lock = threading.Lock()
_tokenizer: Any = None
_tagger: Any = None


def jieba_tokenizer() -> Any:
    """jieba's segmenter; its dictionary (in the wheel) loads on first use, about a second."""
    global _tokenizer
    with _lock:
        if _tokenizer is None:
            import jieba

            jieba.setLogLevel(logging.WARNING)  # not its "Building prefix dict" lines in worker logs
            jieba.dt.initialize()
            _tokenizer = jieba.dt
    return _tokenizer


def jieba_tagger() -> Any:
    """jieba's part-of-speech tagger (over the same dictionary)."""
    global _tagger
    jieba_tokenizer()
    with _lock:
        if _tagger is None:
            import jieba.posseg

            _tagger = jieba.posseg.dt
    return _tagger
