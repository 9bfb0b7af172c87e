"""Parsing, chunking and the default embedder: pure functions, no services."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from domains.knowledge.chunking import (
    CJK_CLAUSE_MARKS,
    CJK_SENTENCE_ENDS,
    LATIN_SENTENCE_ENDS,
    _split_long,
    chunk_text,
    paragraphs,
)
from domains.knowledge.embedding import HashingEmbedder, load_embedder
from domains.knowledge.hashing import features
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


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_latin_text_has_the_word_and_trigram_features_it_always_had() -> None:
    # Latin vectors are those of the words-only embedder: English search works exactly as before.
    assert features("Lease lease, keeper!") == {
        "w:lease": 2, "c:^le": 2, "c:lea": 2, "c:eas": 2, "c:ase": 2, "c:se$": 2,
        "w:keeper": 1, "c:^ke": 1, "c:kee": 1, "c:eep": 1, "c:epe": 1, "c:per": 1, "c:er$": 1,
    }  # fmt: skip


def test_cjk_runs_give_characters_and_bigrams_and_never_glue_to_latin_words() -> None:
    got = features("Owner统一定义的租约")
    assert got["w:owner"] == 1 and not any(k.startswith("w:") and len(k) > 7 for k in got)
    assert {"b:统一", "b:一定", "b:定义", "b:义的", "b:的租", "b:租约"} <= set(got)
    assert {"u:统", "u:租", "u:约"} <= set(got) and "u:的" not in got  # a function character alone
    # Punctuation ends a run: no bigram across a full stop or a comma.
    assert "b:约。" not in features("租约。任务") and "b:约任" not in features("租约。任务")
    assert set(features("かな カナ 한국어")) >= {"b:かな", "b:カナ", "b:한국", "b:국어"}


def test_a_chinese_query_finds_the_chinese_passage_that_uses_its_words() -> None:
    embedder = HashingEmbedder()
    docs = [
        "工作进程在执行期间必须定期续约，租约过期后任务会被重新放回队列。",
        "签订租房合同时要写明月租金和押金。",
        "0000 1f8b 0800 0000 0000 0003 ed5d 5b73 dbb6 15fe 2b3c",  # a hex dump: what matched before
        "Leases expire when a worker stops renewing them.",
    ]
    vectors = embedder.embed(docs)
    for query, best in (("租约", 0), ("租约过期以后任务怎么办", 0), ("押金和租金", 1)):
        [q] = embedder.embed([query])
        scores = [_cosine(q, v) for v in vectors]
        assert scores.index(max(scores)) == best, (query, scores)
        assert scores[best] > 0.2 and scores[2] < 0.05


def test_embedders_load_by_name_or_path() -> None:
    assert load_embedder("hashing").dimension == 1024
    # The version in the name: bases built with the words-only "hashing-N" are refused, not mixed.
    assert load_embedder("hashing:64").name == "hashing-v2-64"
    assert load_embedder("domains.knowledge.embedding:HashingEmbedder").name == "hashing-v2-1024"
    with pytest.raises(ValueError, match="not an Embedder"):
        load_embedder("domains.knowledge.chunking:MAX_CHARS")


def test_text_without_spaces_is_cut_after_its_sentences_not_inside_them() -> None:
    text = "灯塔看守人每天晚上点亮灯塔。" * 100  # 1,400 characters, one paragraph, no space
    chunks = chunk_text(text, max_chars=300, overlap_chars=60)
    assert len(chunks) > 4 and all(len(c) <= 300 for c in chunks)
    assert all(c.endswith("。") for c in chunks)
    # The overlap starts at a sentence too (no space needed to find where).
    assert all(c.startswith("灯塔看守人") for c in chunks)
    assert "".join(chunks).count("灯塔看守人每天晚上点亮灯塔。") > 100  # every sentence, some twice


def test_cjk_sentence_ends_keep_their_closing_quotes_and_clause_marks_are_the_next_boundary() -> None:
    quoted = "他说：“今天天气很好。”然后我们出发了。" * 30
    pieces = _split_long(quoted, 100)
    assert all(p.endswith(("。”", "了。")) for p in pieces[:-1]) and not any(
        p.startswith("”") for p in pieces
    )
    # One long sentence with commas: cut after a comma, not inside a word.
    clauses = "，".join(["一路向北经过很多城市"] * 40) + "。"
    assert all(p.endswith("，") for p in _split_long(clauses, 100)[:-1])
    # Nothing but a sentence end early in the window: a short piece, not a hard cut mid-sentence.
    early = "短句。" + "没有任何标点的一句很长的话" * 20
    assert _split_long(early, 100)[0] == "短句。"
    # With no boundary at all there is nothing else to do but cut at the size.
    assert [len(p) for p in _split_long("字" * 250, 100)] == [100, 100, 50]


def test_line_breaks_inside_chinese_join_without_a_space_and_latin_lines_keep_theirs() -> None:
    assert paragraphs("这是一段被\n硬换行的文字，\r\n下一行。\nEnglish line\nnext 中文\n\n第二段") == [
        "这是一段被硬换行的文字，下一行。 English line next 中文",
        "第二段",
    ]


def test_mixed_chinese_and_latin_text_chunks_within_the_size() -> None:
    text = "\n\n".join(f"第{i}段：使用 AWS CLI 上传文件到 Amazon S3，然后检查结果。" * 12 for i in range(12))
    for size, overlap in ((1000, 200), (300, 60), (120, 50)):
        chunks = chunk_text(text, size, overlap)
        assert all(0 < len(c) <= size for c in chunks)
        assert all(f"第{i}段" in "".join(chunks) for i in range(12))


# ------------------------------------------------------------------------------------- linear chunking


def _reference_split_long(paragraph: str, limit: int) -> list[str]:
    """The splitter's rules written the plain (quadratic) way: the chunks it gives are the contract."""
    closers = "”’」』）》】〕〉…\"')"
    pieces: list[str] = []
    rest = paragraph
    while len(rest) > limit:
        window = rest[:limit]
        latin = max(window.rfind(e) for e in LATIN_SENTENCE_ENDS)
        cjk = max(window.rfind(e) for e in CJK_SENTENCE_ENDS)
        while 0 <= cjk < limit - 1 and window[cjk + 1] in closers:
            cjk += 1
        sentence = max(latin, cjk)
        word = max(window.rfind(" "), *(window.rfind(m) for m in CJK_CLAUSE_MARKS))
        if sentence >= limit // 2:
            cut = sentence + 1
        elif word >= limit // 4:
            cut = word + 1
        elif sentence >= 0:
            cut = sentence + 1
        else:
            cut = limit
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    if rest:
        pieces.append(rest)
    return pieces


def _texts() -> list[str]:
    """Ordinary and awkward texts: prose, one long paragraph, no spaces, CJK, odd whitespace."""
    rng = random.Random(7)
    words = ["lighthouse", "a", "keeper's", "log.", "Fresnel!", "lens?", "x" * 300, "第二", "—", "end."]
    words += ["灯塔看守人的日志。", "他说：“好。”", "一路向北，", "省略……", "无标点" * 80, "、"]
    out = []
    for n in (0, 1, 5, 50, 400, 3000):
        out.append(" ".join(rng.choice(words) for _ in range(n)))
        paras = (" ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(n // 10 + 1))
        out.append("\n\n".join(paras))
    out += ["y" * 5000, "灯塔看守人的日志。" * 700, " \t\n".join(["word"] * 900), "a. " * 2000]
    out += ["他说：“今天天气很好。”然后我们出发了，一路向北" * 60, "字" * 3000 + "。" + "字" * 10]
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
