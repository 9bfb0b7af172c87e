"""The formats beyond plain text: reStructuredText, Word, CSV, JSON, and text in legacy encodings.
Real documents made here (python-docx writes the .docx files), parsed in process and in the parse
child; a hostile .docx ends at the child's limits."""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from domains.knowledge import model, parse_process, rst_text
from domains.knowledge.chunking import chunk_text
from domains.knowledge.parse_process import ParseLimits, parse_file
from domains.knowledge.parsing import (
    CONTENT_TYPES,
    EXTENSIONS,
    OTHER,
    LimitExceeded,
    ParseError,
    extract_text,
    file_type_of,
)
from tests.domains.knowledge.test_parse_process import MB, _helpers, _peaks
from tests.knowledge_documents import docx_bomb, make_docx

LIMITS = ParseLimits(max_chars=4_000_000, max_chunks=10_000, memory_mb=256, seconds=60)
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00"


@pytest.fixture(autouse=True)
async def _no_helper_outlives_its_test() -> AsyncIterator[None]:
    yield
    await parse_process.close_idle()


def test_every_type_is_one_the_model_admits_and_other_is_refused_naming_the_supported_ones() -> None:
    assert OTHER == model.OTHER
    assert set(EXTENSIONS.values()) | {OTHER} == set(model.FILE_TYPES) == set(CONTENT_TYPES)
    assert file_type_of("notes.bin") is None  # the upload stores it as "other"
    with pytest.raises(ParseError) as caught:
        extract_text(b"anything", OTHER)
    assert str(caught.value) == (
        "this type of file is not supported (supported: .txt, .text, .md, .markdown, .rst, .rest, "
        ".html, .htm, .pdf, .docx, .csv, .json)"
    )


# ------------------------------------------------------------------------------------------- encodings

LATIN = "Le café de la gare est fermé le dimanche; la fenêtre donne sur le quai. Naïve façade, très bien."
CHINESE = "灯塔看守人的日志。第二个透镜在晚上点亮，海港的船只依靠它航行。㐀字在扩展区。"  # noqa: RUF001


@pytest.mark.parametrize("file_type", ["txt", "md"])
def test_latin1_text_is_decoded(file_type: str) -> None:
    assert extract_text(LATIN.encode("latin-1"), file_type) == LATIN
    # Too short for any detector to be sure: of the encodings that fit, the commonest is taken.
    assert extract_text(b"caf\xe9 au lait", file_type) == "café au lait"


def test_windows_1252_is_told_from_latin1_by_its_own_characters() -> None:
    text = "Prix : 12 € – « très » “cher” … c’est l’été"  # noqa: RUF001
    assert extract_text(text.encode("cp1252"), "txt") == text


def test_gb18030_text_is_decoded_four_byte_characters_included() -> None:
    data = CHINESE.encode("gb18030")
    assert "㐀".encode("gb18030") == b"\x81\x39\xee\x39"  # outside GBK: only GB18030 decodes it
    assert extract_text(data, "txt") == CHINESE


def test_utf8_with_a_stray_byte_stays_utf8() -> None:
    utf8 = ("Le café est fermé, 灯塔看守人的日志 — naïve. " * 5).encode()
    assert extract_text(utf8 + b"a stray \xe9 byte", "txt") == utf8.decode() + "a stray \ufffd byte"


# Short texts, where detection is hardest: charset-normalizer's own best guess was wrong for 12 of
# 24 such texts (these among them); the common encodings first and the tie-break fix 8 of them.
@pytest.mark.parametrize(
    ("text", "encoding"),
    [
        ("Le gardien du phare note chaque goéland qui se pose sur la falaise, même l'hiver.", "latin-1"),
        ("Grüße aus München, die Straße ist schön", "latin-1"),
        ("El niño comió una piña en la montaña. ¿Dónde está el señor?", "latin-1"),
        ("Příliš žluťoučký kůň úpěl ďábelské ódy.", "cp1250"),
        ("Zażółć gęślą jaźń, to jest polski tekst o latarni morskiej.", "cp1250"),
        ("Привет! Это проверка кодировки: смотритель маяка зажёг лампу.", "koi8_r"),
        ("Ο φάρος ανάβει κάθε βράδυ στο λιμάνι.", "cp1253"),  # noqa: RUF001
        ("المنارة تضاء كل مساء في الميناء.", "cp1256"),
        ("灯塔日志", "gb18030"),
        ("燈塔看守人的日誌，第二個透鏡在晚上點亮。", "big5"),  # noqa: RUF001
        ("日本語のテキストです。灯台守の日誌", "shift_jis"),
        ("등대지기의 일지입니다. 렌즈는 밤에 켜집니다.", "euc_kr"),
    ],
)
def test_short_texts_in_common_legacy_encodings_are_decoded(text: str, encoding: str) -> None:
    assert extract_text(text.encode(encoding), "txt") == text


def test_other_encodings_and_byte_order_marks() -> None:
    russian = "Привет! Это проверка кодировки: смотритель маяка зажёг лампу."
    assert extract_text(russian.encode("cp1251"), "txt") == russian
    assert extract_text("\ufeffUTF-8 with a BOM: ✓".encode(), "txt") == "UTF-8 with a BOM: ✓"
    utf16 = "UTF-16 with its BOM: ✓ 灯塔"
    assert extract_text(utf16.encode("utf-16"), "txt") == utf16
    html = f"<p>{LATIN}</p>".encode("latin-1")
    assert extract_text(html, "html") == LATIN


@pytest.mark.parametrize(
    "data",
    [
        PNG,
        os.urandom(4096),
        b"text with a NUL\x00 byte is binary, as git and grep judge it",
        zlib.compress(b"The keeper trims the wick at dusk. " * 50),
    ],
    ids=["png", "random", "nul", "deflated"],
)
@pytest.mark.parametrize("file_type", ["txt", "md", "rst", "html", "csv", "json"])
def test_binary_data_is_not_text_whatever_its_extension(data: bytes, file_type: str) -> None:
    with pytest.raises(ParseError, match=r"^not a text file \(binary data, or text in an encoding"):
        extract_text(data, file_type)


# ------------------------------------------------------------------------------------------------- rst

RST = """\
=================
Lighthouse Manual
=================

The keeper trims the *wick* at dusk; see :ref:`the lamp chapter <lamp>` and :func:`light_lamp`.

.. note::

   The Fresnel lens is cleaned every morning.

.. code-block:: python

   def light_lamp():
       return "beam"

+-----------+-----------+
| Part      | Material  |
+===========+===========+
| lens      | glass     |
+-----------+-----------+
| lamp      | brass     |
+-----------+-----------+

.. list-table:: Keepers
   :header-rows: 1

   * - Name
     - Years
   * - Ada
     - 12

.. toctree::
   :maxdepth: 2

   chapters

.. a comment nobody reads

:Author: Grace

.. |island| replace:: Rottnest island

The quokka lives on |island|.
"""


def test_rst_gives_its_text_without_markup_directives_and_tables_included() -> None:
    assert extract_text(RST.encode(), "rst") == (
        "Lighthouse Manual\n\n"
        "The keeper trims the wick at dusk; see the lamp chapter and light_lamp.\n\n"
        "The Fresnel lens is cleaned every morning.\n\n"
        'def light_lamp():\n    return "beam"\n\n'
        "Part | Material\n\nlens | glass\n\nlamp | brass\n\n"
        "Keepers\n\nName | Years\n\nAda | 12\n\n"
        "Author: Grace\n\n"
        "The quokka lives on Rottnest island."
    )


def test_rst_keeps_the_content_of_sphinx_directives_docutils_does_not_know() -> None:
    source = (
        "Intro.\n\n"
        ".. versionadded:: 1.2\n   The *albatross* option.\n\n"
        ".. glossary::\n   :sorted:\n\n   keeper\n      The person who tends the lamp.\n\n"
        ".. seealso::\n\n   The cormorant chapter, and :func:`trim_wick`.\n\n"
        ".. only:: html\n\n   Only in HTML: puffin.\n\n   .. tab:: Nested\n\n      Deep *gannet*.\n\n"
        ".. toctree::\n   :maxdepth: 2\n\n   intro\n   install\n\n"
        ".. autofunction:: light_lamp\n"
    )
    assert extract_text(source.encode(), "rst") == (
        "Intro.\n\nThe albatross option.\n\nkeeper\n\nThe person who tends the lamp.\n\n"
        "The cormorant chapter, and trim_wick.\n\nOnly in HTML: puffin.\n\nDeep gannet."
    )


def test_rst_with_errors_still_gives_its_text() -> None:
    broken = (
        "Title\n===\n\n"  # underline too short
        "Text with `an unclosed role and **bold\n\n"
        ".. unknown-directive:: argument\n\n   its body\n\n"
        "* a list\n continued badly\n\n"
        "Final paragraph about the albatross.\n"
    )
    text = extract_text(broken.encode(), "rst")
    assert "Title" in text and "an unclosed role" in text and "albatross" in text


def test_rst_docutils_cannot_parse_is_its_own_text() -> None:
    # docutils refuses a document with a line over its line-length limit as a whole.
    source = "Title\n=====\n\n" + "cormorant " * 2000 + "\n\nafter\n"
    assert extract_text(source.encode(), "rst") == source


def test_rst_reads_no_file_and_inserts_no_raw_markup(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret word is narwhal\n")
    source = (
        f"Visible paragraph.\n\n.. include:: {secret}\n\n"
        f".. raw:: html\n   :file: {secret}\n\n"
        f".. csv-table:: Leak\n   :file: {secret}\n\n"
        ".. raw:: html\n\n   <script>alert('x')</script>\n"
    )
    text = extract_text(source.encode(), "rst")
    assert text == "Visible paragraph."


def test_an_rst_source_over_the_character_limit_is_refused_before_docutils_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Docutils takes seconds a megabyte; its text is no longer than the source but for substitutions.
    source = "Title\n=====\n\n" + "\n\n".join(f"Paragraph {i} about the *lamp*." for i in range(40_000))

    def unread(source: str) -> str:
        raise AssertionError("docutils was given a source over the limit")

    monkeypatch.setattr(rst_text, "rst_text", unread)
    with pytest.raises(LimitExceeded, match="limit of 1,000,000 characters"):
        extract_text(source.encode(), "rst", max_chars=1_000_000)


def test_latin1_rst_is_decoded() -> None:
    source = f"Titre\n=====\n\n{LATIN}\n"
    assert extract_text(source.encode("latin-1"), "rst") == f"Titre\n\n{LATIN}"


# ------------------------------------------------------------------------------------------------ docx


def test_docx_gives_paragraphs_and_table_cells_in_document_order() -> None:
    assert extract_text(make_docx(), "docx") == (
        "Keeper handbook\n\n"
        "The lamp is lit at dusk.\n\n"
        "Part | Material | Note\n\n"
        "lens | glass, merged across two columns\n\n"
        "lamp | brass | polished\n\n"
        "After the table: café, 灯塔."
    )


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def _replace(data: bytes, name: str, content: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    return _zip({n: (content if n == name else source.read(n)) for n in source.namelist()})


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"plain text, not a zip", "BadZipFile"),
        (_zip({"hello.txt": b"a zip, but no Word document"}), "not a Word document package"),
        (make_docx()[:2000], "BadZipFile"),  # truncated
        (_replace(make_docx(), "word/document.xml", b"<w:document>not xml"), "XMLSyntaxError"),
    ],
    ids=["text", "other-zip", "truncated", "bad-xml"],
)
def test_a_damaged_docx_says_why(data: bytes, why: str) -> None:
    with pytest.raises(ParseError, match=rf"^not a readable \.docx file.*{why}"):
        extract_text(data, "docx")


def test_a_docx_with_more_text_than_the_limit_stops_at_it() -> None:
    data = docx_bomb(4 * MB)
    assert len(data) < 100_000
    with pytest.raises(LimitExceeded, match="limit of 1,000,000 characters"):
        extract_text(data, "docx", max_chars=1_000_000)


# ------------------------------------------------------------------------------------------------- csv


def test_a_windows_1252_csv_gives_a_line_of_header_value_pairs_per_row() -> None:
    table = (
        'Name;City;Remark\r\n"Zoë";Zürich;"costs 12 €; “fine”"\r\n'
        'José;;"two\r\nlines"\r\n\r\nAnn;Köln;ok;extra\r\n'
    )
    assert extract_text(table.encode("cp1252"), "csv") == (
        "Name: Zoë; City: Zürich; Remark: costs 12 €; “fine”\n\n"
        "Name: José; Remark: two\r\nlines\n\n"
        "Name: Ann; City: Köln; Remark: ok; column 4: extra"
    )


@pytest.mark.parametrize(
    ("table", "text"),
    [
        ("a\tb\n1\t2\n", "a: 1; b: 2"),
        ("a|b\n1|2\n", "a: 1; b: 2"),
        ("word\nalbatross\n", "word: albatross"),  # one column: no delimiter to sniff
        ("only,a,header\n", "only; a; header"),
    ],
)
def test_csv_dialects_are_sniffed(table: str, text: str) -> None:
    assert extract_text(table.encode(), "csv") == text


def test_csv_errors_and_amplification_stop_with_a_reason() -> None:
    with pytest.raises(ParseError, match=r"^not a readable CSV file \(line 2: field larger than"):
        extract_text(b'a,b\n"' + b"x" * 200_000 + b'",1\n', "csv")
    # Long headers repeated on every row: far more text than bytes, stopped at the limit.
    data = ",".join(f"header {'h' * 90} {i}" for i in range(100)).encode() + b"\n" + b"1," * 100 + b"\n"
    with pytest.raises(LimitExceeded):
        extract_text(data + (b"1," * 100 + b"\n") * 1000, "csv", max_chars=1_000_000)


# ------------------------------------------------------------------------------------------------ json


def test_nested_json_is_flattened_to_path_value_lines() -> None:
    document = (
        '{"store": {"name": "Caf\u00e9 Libre", "books": [{"title": "Dune", "year": 1965, '
        '"tags": ["sf", null]}, {"title": "灯塔", "price": 9.5, "used": false}], "empty": {}, "none": []},'
        ' "open": true}'
    )
    assert extract_text(document.encode(), "json") == (
        "store.name: Café Libre\n\n"
        "store.books[0].title: Dune\n\nstore.books[0].year: 1965\n\n"
        "store.books[0].tags[0]: sf\n\nstore.books[0].tags[1]: null\n\n"
        "store.books[1].title: 灯塔\n\nstore.books[1].price: 9.5\n\nstore.books[1].used: false\n\n"
        "open: true"
    )
    assert extract_text(b'"a lone string"', "json") == "a lone string"
    assert extract_text(b"[1, [2]]", "json") == "[0]: 1\n\n[1][0]: 2"
    latin = '{"café": {"fenêtre": "Le café de la gare est fermé le dimanche, très tôt."}}'
    assert extract_text(latin.encode("latin-1"), "json") == (
        "café.fenêtre: Le café de la gare est fermé le dimanche, très tôt."
    )


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"a": 1,}', r"^not valid JSON \(Expecting property name"),
        (b"[" * 100_000 + b"]" * 100_000, r"^not a readable JSON file \(nested too deeply\)"),
        (b"{}", "^no text found"),
    ],
)
def test_unreadable_json_says_why(data: bytes, why: str) -> None:
    with pytest.raises(ParseError, match=why):
        extract_text(data, "json")


def test_json_paths_longer_than_the_limit_stop_at_it() -> None:
    nested = '{"' + "k" * 10_000 + '": ' + "[" * 50 + ",".join(["1"] * 5000) + "]" * 50 + "}"
    with pytest.raises(LimitExceeded):
        extract_text(nested.encode(), "json", max_chars=1_000_000)


# ---------------------------------------------------------------------------------- in the parse child


async def test_every_format_parses_in_the_child_as_it_would_in_process() -> None:
    files = [
        (RST.encode(), "rst"),
        (make_docx(), "docx"),
        ("Name;City\nZoë;Zürich\n".encode("cp1252"), "csv"),
        (b'{"a": {"b": [1, "two"]}}', "json"),
        (LATIN.encode("latin-1"), "txt"),
        (CHINESE.encode("gb18030"), "md"),
    ]
    for data, file_type in files:
        assert await parse_file(data, file_type, LIMITS) == chunk_text(extract_text(data, file_type))
    assert len(_helpers()) == 1  # one warm child took them all, its libraries imported as needed


async def test_a_docx_zip_bomb_ends_at_the_memory_limit_and_the_parent_stays_small() -> None:
    bomb = docx_bomb(320 * MB)  # 2.5 MB that python-docx would inflate to 320 MB
    assert len(bomb) < 8 * MB
    outcome, child_peak, parent_growth = await _peaks(parse_file(bomb, "docx", LIMITS))
    assert isinstance(outcome, ParseError)
    assert str(outcome) == "the parser ran out of its 256 MB memory limit (DTASK_KNOWLEDGE_PARSE_MEMORY_MB)"
    assert 0 < child_peak < 256 * MB
    assert parent_growth < 50 * MB
    assert _helpers() == []  # replaced: the next file gets a fresh one
    assert await parse_file(make_docx(), "docx", LIMITS) == chunk_text(extract_text(make_docx(), "docx"))


async def test_a_docx_of_huge_xml_within_memory_ends_at_the_character_limit() -> None:
    outcome, child_peak, _ = await _peaks(parse_file(docx_bomb(24 * MB), "docx", LIMITS))
    assert isinstance(outcome, LimitExceeded)
    assert "limit of 4,000,000 characters (DTASK_KNOWLEDGE_MAX_CHARS)" in str(outcome)
    assert 0 < child_peak < 256 * MB
