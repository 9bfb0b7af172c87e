"""Hostile documents for the benchmarks and tests: small files whose text is enormous, or slow
to extract, built in memory (nothing here is used to serve requests).

Each one is within the upload limit and ends ``error_parsing`` at a parsing limit: the point of
building them is to show that it does, and what it costs everyone else meanwhile
(``dtask bench knowledge-ingest --beside-hostile``, ``tests/system/test_knowledge_parsing.py``).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

# One byte of an amplification PDF's content stream shows this many characters.
EXPANSION = 255
# The default DTASK_MAX_UPLOAD_BYTES: the largest file an upload accepts.
LINE_BYTES = 16 * 1024 * 1024


def _pdf(objects: Sequence[bytes]) -> bytes:
    """Objects numbered from 1 (the first is the catalog), with their cross-reference table."""
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def _stream(data: bytes, *, compress: bool = False) -> bytes:
    if compress:
        data = zlib.compress(data, 9)
    extra = b" /Filter /FlateDecode" if compress else b""
    return b"<< /Length %d%s >>\nstream\n" % (len(data), extra) + data + b"\nendstream"


def _pages_sharing(content: bytes, pages: int, font: bytes, *extra: bytes) -> bytes:
    """``pages`` pages that all draw the same flate-compressed content stream with font /F1 (object
    4 + pages); ``extra`` objects follow it."""
    first_page = 4
    kids = " ".join(f"{first_page + i} 0 R" for i in range(pages)).encode()
    font_ref = b"%d 0 R" % (first_page + pages)
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
        b"/Resources << /Font << /F1 " + font_ref + b" >> >> >>"
    )
    return _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
            _stream(content, compress=True),
            *([page] * pages),
            font,
            *extra,
        ]
    )


def amplification_pdf(content: bytes) -> bytes:
    """A one-page PDF whose font maps the byte ``A`` to ``EXPANSION`` characters (a ToUnicode
    CMap); ``content`` is the page's content stream."""
    target = ("0058" * EXPANSION).encode()  # UTF-16BE "X" x 255
    cmap = (
        b"/CIDInit /ProcSet findresource begin\n12 dict begin\nbegincmap\n"
        b"/CIDSystemInfo << /Registry (Adobe) /Ordering (UCS) /Supplement 0 >> def\n"
        b"/CMapName /Adobe-Identity-UCS def\n/CMapType 2 def\n"
        b"1 begincodespacerange\n<00> <FF>\nendcodespacerange\n"
        b"1 beginbfchar\n<41> <" + target + b">\nendbfchar\n"
        b"endcmap\nCMapName currentdict /CMap defineresource pop\nend\nend\n"
    )
    font = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 6 0 R >>"
    return _pages_sharing(content, 1, font, _stream(cmap))


def one_operator_bomb(size: int = 4 * 1024 * 1024) -> bytes:
    """One text-showing operator over ``size`` bytes: ``EXPANSION`` x ``size`` characters at once
    (4 MB: 1.07 billion characters from a 6 KB file)."""
    return amplification_pdf(b"BT /F1 12 Tf 50 700 Td (" + b"A" * size + b") Tj ET")


def many_operators_bomb(size: int = 4 * 1024 * 1024, run: int = 1000) -> bytes:
    """The same amplification spread over text objects of ``run`` bytes each."""
    block = b"BT /F1 12 Tf 50 700 Td (" + b"A" * run + b") Tj ET\n"
    return amplification_pdf(block * (size // run))


def slow_pdf(pages: int, operators: int = 10_000) -> bytes:
    """Pages that each show one character in ``operators`` separate text objects: little text
    and little memory, but pypdf's extraction is slow (about 0.7 s a page of 10,000 here)."""
    content = b"BT /F1 12 Tf 50 700 Td (a) Tj ET\n" * operators
    return _pages_sharing(content, pages, b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")


def one_line_text(size: int = LINE_BYTES) -> bytes:
    """A text of one line of ``size`` bytes, no paragraph to cut it at (16 MB: 16.8 million
    characters, over the default character limit)."""
    return b"x" * size


def hostile_set() -> list[tuple[str, bytes]]:
    """(file name, content) of the three hostile uploads the isolation benchmark sends: each ends
    ``error_parsing`` under the default limits, the first at the memory limit, the others at the
    character limit."""
    return [
        ("one-operator.pdf", one_operator_bomb()),
        ("many-operators.pdf", many_operators_bomb()),
        ("line.txt", one_line_text()),
    ]
