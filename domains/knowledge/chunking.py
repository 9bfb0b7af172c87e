"""Text -> overlapping chunks, paragraph by paragraph, deterministic (same text, same chunks).

Paragraphs (separated by blank lines) are packed into chunks of at most ``max_chars`` characters;
each chunk after the first starts with the tail of the previous one (about ``overlap_chars``) so a
passage cut at a boundary is still found whole in one of them. A paragraph longer than a chunk is
split at a sentence end, else a word or clause boundary, else at any sentence end at all; only a
piece with none of these is cut hard.

Chinese and Japanese put no spaces between words or after a sentence: their sentence ends
(``。！？；…``) and clause marks (``，、：``) are boundaries by themselves, and a line break between
two CJK characters (hard-wrapped text, PDF lines) joins them without a space.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from domains.cjk import CJK_CHARS

MAX_CHARS = 1000
OVERLAP_CHARS = 200

# Latin sentence ends count only before a space ("3.14", "e.g.x" are not ends); CJK ones alone.
LATIN_SENTENCE_ENDS = (". ", "! ", "? ")
CJK_SENTENCE_ENDS = ("。", "！", "？", "；", "…")
CJK_CLAUSE_MARKS = ("，", "、", "：")
# What may follow a CJK sentence end and still belong to its sentence: 他说：“好。” / ……
_CLOSERS = frozenset("”’」』）》】〕〉…\"')")
# CJK characters, radicals, CJK and full-width punctuation: a line break between two of them is no space.
_CJK = CJK_CHARS + "\u2e80-\u2fdf\u3000-\u303f\uff00-\uffef"
# The character before the break is matched, not looked behind at: a lookbehind at every position of
# a Latin text was most of the cost of chunking it.
_CJK_LINE_BREAK = re.compile(f"([{_CJK}])[^\\S\n]*\n\\s*(?=[{_CJK}])")


def paragraphs(text: str) -> list[str]:
    parts = re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return [p for p in (re.sub(r"\s+", " ", _CJK_LINE_BREAK.sub(r"\1", part)).strip() for part in parts) if p]


def _split_long(paragraph: str, limit: int) -> list[str]:
    """Pieces of at most ``limit`` characters, each cut at the best boundary its window has.

    ``paragraph`` comes from ``paragraphs()`` (stripped). Searched and sliced by index, never by
    copying the rest of the paragraph at each cut: that was quadratic in the paragraph's length.
    """
    pieces: list[str] = []
    start, end = 0, len(paragraph)

    def last(subs: tuple[str, ...], stop: int) -> int:  # the window's last of ``subs``, window-relative
        return max(paragraph.rfind(sub, start, stop) for sub in subs) - start if subs else -1

    while end - start > limit:
        stop = start + limit
        latin = last(LATIN_SENTENCE_ENDS, stop)
        cjk = _after_closers(paragraph, start, last(CJK_SENTENCE_ENDS, stop), stop)
        sentence = max(latin, cjk)
        if sentence >= limit // 2:
            cut = sentence + 1
        else:
            word = max(last((" ",), stop), last(CJK_CLAUSE_MARKS, stop))
            if word >= limit // 4:
                cut = word + 1
            elif sentence >= 0:
                cut = sentence + 1  # a short piece, rather than a cut inside a sentence
            else:
                cut = limit  # no boundary at all: hard cut
        pieces.append(paragraph[start : start + cut].strip())
        start += cut
        while start < end and paragraph[start].isspace():
            start += 1
    if start < end:
        pieces.append(paragraph[start:end])
    return pieces


def _after_closers(paragraph: str, start: int, found: int, stop: int) -> int:
    """A CJK sentence end at window position ``found``, moved over the quotes and brackets that
    close its sentence (-1 stays -1)."""
    if found < 0:
        return found
    at = start + found
    while at + 1 < stop and paragraph[at + 1] in _CLOSERS:
        at += 1
    return at - start


def _tail(text: str, size: int) -> str:
    """The last ``size`` characters or so, starting at a word boundary, or (text without spaces)
    just after a CJK sentence end or clause mark."""
    if len(text) <= size:
        return text
    tail = text[-size:]
    space = tail.find(" ")
    if 0 <= space < size // 2:
        return tail[space + 1 :]
    for marks in (CJK_SENTENCE_ENDS, CJK_CLAUSE_MARKS):
        found = [i for i in (tail.find(m, 0, size // 2) for m in marks) if i >= 0]
        if found:
            at = min(found)
            while at + 1 < len(tail) and tail[at + 1] in _CLOSERS:
                at += 1
            return tail[at + 1 :].lstrip()
    return tail


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
                # The overlap and its separator must leave room for the unit (a tail with no
                # space in it is the full ``overlap_chars``).
                room = min(overlap_chars, max_chars - len(unit) - 2)
                overlap = _tail(chunk, room) if room > 0 else ""
                current, size = ([overlap], len(overlap)) if overlap else ([], 0)
            current.append(unit)
            size += len(unit) + 2
    if current:
        yield "\n\n".join(current)


def chunk_text(text: str, max_chars: int = MAX_CHARS, overlap_chars: int = OVERLAP_CHARS) -> list[str]:
    return list(iter_chunks(text, max_chars, overlap_chars))
