"""Per-file limits on the text and the chunks a file may give (in process: the pure work the
parse process runs)."""

from __future__ import annotations

import pytest

from domains.knowledge.chunking import chunk_text
from domains.knowledge.hostile import many_operators_bomb
from domains.knowledge.parse_child import parse
from domains.knowledge.parse_process import ParseLimits
from domains.knowledge.parsing import LimitExceeded, ParseError, extract_text
from domains.knowledge.settings import KnowledgeSettings
from tasks_core.settings import Settings
from tests.knowledge_helpers import make_pdf


def test_the_defaults_refuse_a_16_mb_one_line_text_by_its_characters() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    line = b"x" * settings.max_upload_bytes  # the largest file an upload accepts, one line
    limits = ParseLimits.from_settings(KnowledgeSettings(_env_file=None))  # type: ignore[call-arg]
    assert limits.max_chars < len(line)
    with pytest.raises(LimitExceeded) as caught:
        parse(line, "txt", limits.max_chars, limits.max_chunks)
    assert str(caught.value) == (
        f"the file's text is longer than the limit of {limits.max_chars:,} characters "
        "(DTASK_KNOWLEDGE_MAX_CHARS)"
    )


def test_characters_are_counted_after_decoding_and_markup_does_not_count() -> None:
    assert extract_text("é".encode() * 1000, "txt", max_chars=1000) == "é" * 1000  # 2,000 bytes
    with pytest.raises(LimitExceeded, match="1,000 characters"):
        extract_text(b"a" * 1001, "md", max_chars=1000)
    page = b"<p>" + b"a" * 990 + b"</p><script>" + b"x" * 5000 + b"</script><style>y</style>"
    assert extract_text(page, "html", max_chars=1000) == "a" * 990
    with pytest.raises(LimitExceeded):
        extract_text(b"<p>" + b"a" * 1001 + b"</p>", "html", max_chars=1000)


def test_a_pdf_over_the_character_limit_is_refused() -> None:
    pdf = make_pdf(["x" * 80] * 20)  # ~1,600 characters
    assert len(extract_text(pdf, "pdf")) > 1000
    with pytest.raises(LimitExceeded, match="DTASK_KNOWLEDGE_MAX_CHARS"):
        extract_text(pdf, "pdf", max_chars=1000)
    # An amplifying font (one byte shows 255 characters): 10 million characters from 2 KB.
    with pytest.raises(LimitExceeded, match="100,000 characters"):
        extract_text(many_operators_bomb(40_000), "pdf", max_chars=100_000)


def test_an_ordinary_file_under_the_limits_gives_the_chunks_it_always_did() -> None:
    text = "\n\n".join(f"Paragraph {i}. " + "Some words of prose here. " * 30 for i in range(40))
    chunks = chunk_text(text)
    assert parse(text.encode(), "txt", len(text), len(chunks)) == chunks


def test_a_file_over_the_chunk_limit_is_refused_naming_it() -> None:
    text = "\n\n".join("word " * 180 for _ in range(30))  # a chunk each (900 characters)
    assert len(chunk_text(text)) > 10
    with pytest.raises(LimitExceeded) as caught:
        parse(text.encode(), "txt", len(text), 10)
    assert str(caught.value) == "the file gives more than 10 chunks (DTASK_KNOWLEDGE_MAX_CHUNKS)"


def test_unreadable_files_still_say_why() -> None:
    with pytest.raises(ParseError, match="not a text file") as caught:
        parse(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "txt", 1000, 100)
    assert not isinstance(caught.value, LimitExceeded)
