"""Parsing, chunking and the default embedder: pure functions, no services."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from domains.knowledge.chunking import _split_long, chunk_text, paragraphs
from domains.knowledge.embedding import HashingEmbedder, load_embedder
from domains.knowledge.parsing import ParseError, extract_text, file_type_of
from tests.knowledge_helpers import make_pdf


def test_file_types_come_from_the_extension() -> None:
    names = ("a.TXT", "b.md", "c.markdown", "d.htm", "e.html", "f.pdf", "g.rst", "h.REST", "i.docx")
    assert [file_type_of(n) for n in (*names, "j.csv", "k.json")] == [
        "txt", "md", "md", "html", "html", "pdf", "rst", "rst", "docx", "csv", "json",
    ]  # fmt: skip
    assert all(file_type_of(n) is None for n in ("report.doc", "sheet.xlsx", ".pdf", "pdf", "a.json.gz"))


def test_html_drops_scripts_styles_and_keeps_blocks_apart() -> None:
    html = (
        b"<html><head><title>Title</title><style>p { x: 1 }</style></head><body>"
        b"<script>alert('no')</script><p>First <b>para</b>graph</p><ul><li>one</li><li>two</li></ul>"
        b"<template>hidden</template>caf&eacute; &amp; tea</body></html>"
    )
    assert extract_text(html, "html") == "Title\n\nFirst paragraph\n\none\n\ntwo\n\ncafé & tea"


@pytest.mark.parametrize(
    ("data", "file_type", "why"),
    [
        (b"", "txt", "empty"),
        (b" \n\t\n", "md", "no text"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "txt", "not a text file"),
        (b"<style>x</style><script>y</script>", "html", "no text"),
        (b"%PDF-1.4 truncated", "pdf", "not a readable PDF"),
        (b"not a pdf", "pdf", "not a readable PDF"),
    ],
)
def test_unreadable_files_say_why(data: bytes, file_type: str, why: str) -> None:
    with pytest.raises(ParseError, match=why):
        extract_text(data, file_type)


def test_pdf_text_is_extracted() -> None:
    text = extract_text(make_pdf(["Lighthouse keeper log", "Fresnel lens (second order)"]), "pdf")
    assert "Lighthouse keeper log" in text and "Fresnel lens (second order)" in text


def test_chunks_pack_paragraphs_overlap_and_respect_the_size() -> None:
    paras = [f"paragraph {i} " + "word " * 40 for i in range(30)]  # ~215 characters each
    chunks = chunk_text("\n\n".join(paras), max_chars=1000, overlap_chars=200)
    assert len(chunks) > 5 and all(len(c) <= 1000 for c in chunks)
    for previous, current in itertools.pairwise(chunks):
        assert current.startswith(previous[-100:].split(" ", 1)[1][:50])  # starts with the previous tail
    joined = " ".join(chunks)
    assert all(f"paragraph {i} " in joined for i in range(30))
    assert chunk_text("\n\n".join(paras)) == chunk_text("\n\n".join(paras))  # deterministic


def test_a_paragraph_longer_than_a_chunk_is_cut_at_sentences_or_words() -> None:
    long = " ".join(f"Sentence number {i} ends here." for i in range(200))
    chunks = chunk_text(long, max_chars=500, overlap_chars=100)
    assert all(len(c) <= 500 for c in chunks)
    assert all(c.rstrip().endswith(".") for c in chunks[:-1])
    assert paragraphs("a\n\n\n b  c \r\n\r\nd") == ["a", "b c", "d"]


def test_hashing_embedder_is_deterministic_unit_length_and_lexical() -> None:
    embedder = HashingEmbedder(256)
    docs = ["quokka marsupial island burrow", "glacier moraine crevasse ice", "quokka island smiling"]
    vectors = embedder.embed(docs)
    assert vectors == HashingEmbedder(256).embed(docs)
    assert all(math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-9) for vec in vectors)
    [query] = embedder.embed(["quokka burrow"])

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    scores = [cosine(query, v) for v in vectors]
    assert scores[0] == max(scores) and scores[1] < scores[2]


def test_embedders_load_by_name_or_path() -> None:
    assert load_embedder("hashing").dimension == 1024
    assert load_embedder("hashing:64").name == "hashing-64"
    assert load_embedder("domains.knowledge.embedding:HashingEmbedder").name == "hashing-1024"
    with pytest.raises(ValueError, match="not an Embedder"):
        load_embedder("domains.knowledge.chunking:MAX_CHARS")


# ------------------------------------------------------------------------------------- linear chunking


def _reference_split_long(paragraph: str, limit: int) -> list[str]:
    """The splitter as it was before it was made linear: the chunks it gave are the contract."""
    pieces: list[str] = []
    rest = paragraph
    while len(rest) > limit:
        window = rest[:limit]
        cut = max(window.rfind(". "), window.rfind("! "), window.rfind("? "))
        if cut < limit // 2:
            cut = window.rfind(" ")
        cut = cut + 1 if cut >= limit // 4 else limit
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        pieces.append(rest)
    return pieces


def _texts() -> list[str]:
    """Ordinary and awkward texts: prose, one long paragraph, no spaces, CJK, odd whitespace."""
    rng = random.Random(7)
    words = ["lighthouse", "a", "keeper's", "log.", "Fresnel!", "lens?", "x" * 300, "第二", "—", "end."]
    out = []
    for n in (0, 1, 5, 50, 400, 3000):
        out.append(" ".join(rng.choice(words) for _ in range(n)))
        paras = (" ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(n // 10 + 1))
        out.append("\n\n".join(paras))
    out += ["y" * 5000, "灯塔看守人的日志。" * 700, " \t\n".join(["word"] * 900), "a. " * 2000]
    out.append("Z" + " " * 9 + "z" * 999)
    return out


@pytest.mark.parametrize("sizes", [(1000, 200), (500, 100), (300, 20), (120, 50)])
def test_the_linear_splitter_cuts_exactly_where_the_old_one_did(sizes: tuple[int, int]) -> None:
    limit = sizes[0] - sizes[1]  # what chunk_text gives the splitter
    for text in _texts():
        for paragraph in paragraphs(text):
            assert _split_long(paragraph, limit) == _reference_split_long(paragraph, limit)


class _CountingStr(str):
    """A str that adds up the characters of every slice taken of it (or of the slices' slices)."""

    copied = 0

    def __getitem__(self, key: Any) -> _CountingStr:
        piece = str.__getitem__(self, key)
        _CountingStr.copied += len(piece)
        return _CountingStr(piece)

    def strip(self, chars: str | None = None) -> _CountingStr:
        piece = str.strip(self, chars)
        _CountingStr.copied += len(piece)
        return _CountingStr(piece)


def test_splitting_one_long_paragraph_copies_each_character_a_bounded_number_of_times() -> None:
    # The old splitter copied the whole rest of the paragraph at every cut: for n characters in
    # pieces of 800 that is about n*n/1600 characters copied (a 16 MB one-line file took 19 s).
    paragraph = " ".join(f"word{i}" for i in range(40_000))  # ~390,000 characters, one paragraph
    _CountingStr.copied = 0
    pieces = _split_long(_CountingStr(paragraph), 800)
    assert "".join(pieces).replace(" ", "") == paragraph.replace(" ", "")
    assert _CountingStr.copied <= 4 * len(paragraph)
