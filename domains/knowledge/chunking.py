"""Text -> overlapping chunks, paragraph by paragraph, deterministic (same text, same chunks).

Paragraphs (separated by blank lines) are packed into chunks of at most ``max_chars``; each chunk
after the first starts with the tail of the previous one (about ``overlap_chars``) so a passage
cut at a boundary is still found whole in one of them. A paragraph longer than a chunk is split
at sentence, then word, boundaries.
"""

from __future__ import annotations

import re

MAX_CHARS = 1000
OVERLAP_CHARS = 200


def paragraphs(text: str) -> list[str]:
    parts = re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return [p for p in (re.sub(r"\s+", " ", part).strip() for part in parts) if p]


def _split_long(paragraph: str, limit: int) -> list[str]:
    """Pieces of at most ``limit`` characters, cut after a sentence if possible, else a word."""
    pieces: list[str] = []
    rest = paragraph
    while len(rest) > limit:
        window = rest[:limit]
        cut = max(window.rfind(". "), window.rfind("! "), window.rfind("? "))
        if cut < limit // 2:
            cut = window.rfind(" ")
        cut = cut + 1 if cut >= limit // 4 else limit  # no usable boundary: hard cut
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        pieces.append(rest)
    return pieces


def _tail(text: str, size: int) -> str:
    """The last ``size`` characters or so, starting at a word boundary."""
    if len(text) <= size:
        return text
    tail = text[-size:]
    space = tail.find(" ")
    return tail[space + 1 :] if 0 <= space < size // 2 else tail


def chunk_text(text: str, max_chars: int = MAX_CHARS, overlap_chars: int = OVERLAP_CHARS) -> list[str]:
    if overlap_chars >= max_chars // 2:
        raise ValueError("overlap must be under half a chunk")
    units: list[str] = []
    for paragraph in paragraphs(text):
        units.extend(_split_long(paragraph, max_chars - overlap_chars))
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for unit in units:
        if current and size + len(unit) + 2 > max_chars:
            chunks.append("\n\n".join(current))
            overlap = _tail(chunks[-1], overlap_chars)
            current, size = [overlap], len(overlap)
        current.append(unit)
        size += len(unit) + 2
    if current:
        chunks.append("\n\n".join(current))
    return chunks
