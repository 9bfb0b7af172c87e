"""Text -> overlapping chunks, paragraph by paragraph, deterministic (same text, same chunks).

Paragraphs (separated by blank lines) are packed into chunks of at most ``max_chars``; each chunk
after the first starts with the tail of the previous one (about ``overlap_chars``) so a passage
cut at a boundary is still found whole in one of them. A paragraph longer than a chunk is split
at sentence, then word, boundaries.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

MAX_CHARS = 1000
OVERLAP_CHARS = 200


def paragraphs(text: str) -> list[str]:
    parts = re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return [p for p in (re.sub(r"\s+", " ", part).strip() for part in parts) if p]


def _split_long(paragraph: str, limit: int) -> list[str]:
    """Pieces of at most ``limit`` characters, cut after a sentence if possible, else a word.

    ``paragraph`` comes from ``paragraphs()`` (stripped). Searched and sliced by index, never by
    copying the rest of the paragraph at each cut: that was quadratic in the paragraph's length.
    """
    pieces: list[str] = []
    start, end = 0, len(paragraph)

    def last(sub: str, stop: int) -> int:  # as window.rfind(sub), relative to the window
        found = paragraph.rfind(sub, start, stop)
        return found - start if found >= 0 else -1

    while end - start > limit:
        stop = start + limit
        cut = max(last(". ", stop), last("! ", stop), last("? ", stop))
        if cut < limit // 2:
            cut = last(" ", stop)
        cut = cut + 1 if cut >= limit // 4 else limit  # no usable boundary: hard cut
        pieces.append(paragraph[start : start + cut].strip())
        start += cut
        while start < end and paragraph[start].isspace():
            start += 1
    if start < end:
        pieces.append(paragraph[start:end])
    return pieces


def _tail(text: str, size: int) -> str:
    """The last ``size`` characters or so, starting at a word boundary."""
    if len(text) <= size:
        return text
    tail = text[-size:]
    space = tail.find(" ")
    return tail[space + 1 :] if 0 <= space < size // 2 else tail


def iter_chunks(text: str, max_chars: int = MAX_CHARS, overlap_chars: int = OVERLAP_CHARS) -> Iterator[str]:
    """The chunks one by one, so a caller with a limit can stop at it."""
    if overlap_chars >= max_chars // 2:
        raise ValueError("overlap must be under half a chunk")
    current: list[str] = []
    size = 0
    for paragraph in paragraphs(text):
        for unit in _split_long(paragraph, max_chars - overlap_chars):
            if current and size + len(unit) + 2 > max_chars:
                chunk = "\n\n".join(current)
                yield chunk
                overlap = _tail(chunk, overlap_chars)
                current, size = [overlap], len(overlap)
            current.append(unit)
            size += len(unit) + 2
    if current:
        yield "\n\n".join(current)


def chunk_text(text: str, max_chars: int = MAX_CHARS, overlap_chars: int = OVERLAP_CHARS) -> list[str]:
    return list(iter_chunks(text, max_chars, overlap_chars))
