"""Parsing, chunking and the default embedder: pure functions, no services."""

from __future__ import annotations

import itertools
import math

import pytest

from domains.knowledge.chunking import chunk_text, paragraphs
from domains.knowledge.embedding import HashingEmbedder, load_embedder
from domains.knowledge.parsing import ParseError, extract_text, file_type_of
from tests.knowledge_helpers import make_pdf


def test_file_types_come_from_the_extension() -> None:
    assert [file_type_of(n) for n in ("a.TXT", "b.md", "c.markdown", "d.htm", "e.html", "f.pdf")] == [
        "txt",
        "md",
        "md",
        "html",
        "html",
        "pdf",
    ]
    assert (
        file_type_of("report.docx") is None and file_type_of(".pdf") is None and file_type_of("pdf") is None
    )


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
        (b"\xff\xfe\x00bad", "txt", "not UTF-8"),
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
