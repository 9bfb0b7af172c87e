"""Uploaded bytes -> plain text, per file type. CPU-heavy (PDF especially) and, on a hostile file,
unbounded: the handler runs it in a child process with limits (``parse_process``).

A file that cannot give text raises ``ParseError`` with a message a user can act on; the handler
stores it in ``error_message`` with the ``error_parsing`` state. The libraries of each format are
imported on its first file, so a child that only ever sees text files never loads them.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from html.parser import HTMLParser
from typing import Any

log = logging.getLogger(__name__)

# model.OTHER, the type an upload of no supported type is stored as (importing the model would load
# SQLAlchemy into the parse process).
OTHER = "other"
EXTENSIONS = {
    ".txt": "txt",
    ".text": "txt",
    ".md": "md",
    ".markdown": "md",
    ".rst": "rst",
    ".rest": "rst",
    ".html": "html",
    ".htm": "html",
    ".pdf": "pdf",
    ".docx": "docx",
    ".csv": "csv",
    ".json": "json",
}
# The originals are stored as uploaded, in whatever encoding they came: no charset is claimed.
CONTENT_TYPES = {
    "txt": "text/plain",
    "md": "text/markdown",
    "rst": "text/x-rst",
    "html": "text/html",
    "pdf": "application/pdf",
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "csv": "text/csv",
    "json": "application/json",
    OTHER: "application/octet-stream",
}
SUPPORTED = ", ".join(EXTENSIONS)


class ParseError(ValueError):
    """The file gave no usable text; the message says why."""


class LimitExceeded(ParseError):
    """The file is over a per-file limit; the message names the limit and its setting."""


def too_long(max_chars: int) -> LimitExceeded:
    return LimitExceeded(
        f"the file's text is longer than the limit of {max_chars:,} characters (DTASK_KNOWLEDGE_MAX_CHARS)"
    )


def file_type_of(filename: str) -> str | None:
    """The supported type named by the file's extension, or None."""
    dot = filename.rfind(".")
    return EXTENSIONS.get(filename[dot:].lower()) if dot > 0 else None


def extract_text(data: bytes, file_type: str, max_chars: int | None = None) -> str:
    """The file's text; over ``max_chars`` characters raises ``LimitExceeded`` (a PDF, a .docx, a
    CSV or JSON file as soon as it passes the limit, not once all of it is extracted)."""
    if file_type not in CONTENT_TYPES or file_type == OTHER:
        raise ParseError(f"this type of file is not supported (supported: {SUPPORTED})")
    if not data:
        raise ParseError("the file is empty")
    if file_type in ("txt", "md"):
        text = decode_text(data)
    elif file_type == "rst":
        from domains.knowledge.rst_text import rst_text

        source = decode_text(data)
        # Its text is no longer than its source but for substitutions, and docutils takes seconds
        # a megabyte (minutes for the largest upload): a source over the limit is refused first.
        if max_chars is not None and len(source) > max_chars:
            raise too_long(max_chars)
        text = rst_text(source)
    elif file_type == "html":
        text = html_text(decode_text(data))
    elif file_type == "pdf":
        text = pdf_text(data, max_chars)
    elif file_type == "docx":
        from domains.knowledge.docx_text import docx_text

        text = docx_text(data, max_chars)
    elif file_type == "csv":
        from domains.knowledge.data_text import csv_text

        text = csv_text(decode_text(data), max_chars)
    else:
        from domains.knowledge.data_text import json_text

        text = json_text(decode_text(data), max_chars)
    text = text.replace("\x00", "")  # PostgreSQL text cannot hold U+0000
    if max_chars is not None and len(text) > max_chars:
        raise too_long(max_chars)
    if not text.strip():
        raise ParseError("no text found in the file")
    return text


class Budget:
    """Characters given so far against ``max_chars``: an extractor whose output can be far larger
    than its input (a JSON leaf's path, a CSV row's headers) stops at the limit, not after it."""

    def __init__(self, max_chars: int | None) -> None:
        self.max_chars = max_chars
        self.used = 0

    def take(self, text: str) -> str:
        self.used += len(text)
        if self.max_chars is not None and self.used > self.max_chars:
            raise too_long(self.max_chars)
        return text


# ------------------------------------------------------------------------------------------------ encodings

# UTF-32's little-endian mark starts with UTF-16's: it is tried first.
_UNICODE_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
# The legacy encodings of the WHATWG Encoding Standard (those a browser decodes; "latin-1" there
# means Windows-1252): what text people have is in. Detection tries them first, and the rest of
# what charset-normalizer knows (DOS, HP, Mac code pages...) only when none fits: of its 90-odd
# candidates, an exotic one often reads a short text with a hair less "mess" than the right one.
_COMMON = (
    "cp1252", "cp1250", "cp1251", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258",
    "iso8859_2", "iso8859_3", "iso8859_4", "iso8859_5", "iso8859_6", "iso8859_7", "iso8859_8",
    "iso8859_10", "iso8859_13", "iso8859_14", "iso8859_15", "iso8859_16", "cp866", "cp874",
    "koi8_r", "koi8_u", "mac_roman", "mac_cyrillic", "gb18030", "gbk", "big5", "euc_jp",
    "iso2022_jp", "shift_jis", "euc_kr",
)  # fmt: skip
# Decodings this close in mess ratio (charset-normalizer's measure of how garbled a decoding
# reads, 0 to 1) are told apart by noise on a short text: among them the most widely used
# encoding wins (a short French text reads as well in cp1250 as in Windows-1252). Most used first.
_CLOSE = 0.02
_PREFERRED = ("cp1252", "gb18030", "shift_jis", "cp1251", "euc_kr", "big5", "cp1250")


def decode_text(data: bytes) -> str:
    """Text in UTF-8 (with or without a BOM) or, failing that, the encoding charset-normalizer
    finds likeliest; bytes no encoding explains, or with NUL bytes outside UTF-16/32, are binary."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    else:
        if "\x00" not in text:
            return text
    for bom, encoding in _UNICODE_BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)  # the codec reads the mark and drops it
            except UnicodeDecodeError:
                raise _binary() from None
    # A NUL byte is how git and grep tell a binary file; only UTF-16/32 text has them, behind a BOM.
    if b"\x00" in data:
        raise _binary()
    if (damaged := _mostly_utf8(data)) is not None:
        return damaged
    from charset_normalizer import from_bytes

    matches = from_bytes(data, cp_isolation=list(_COMMON))
    if matches.best() is None:
        matches = from_bytes(data)
    best = matches.best()
    if best is None:
        raise _binary()
    close = [m for m in matches if m.chaos <= best.chaos + _CLOSE]
    for encoding in _PREFERRED:
        for match in close:
            if encoding in match.could_be_from_charset:
                try:
                    return data.decode(encoding)
                except UnicodeDecodeError:  # the library judged it on samples of the bytes
                    break
    return str(best)


def _mostly_utf8(data: bytes) -> str | None:
    """UTF-8 with a few invalid bytes (a stray Latin-1 byte in a UTF-8 file), each read as U+FFFD:
    at least four valid multi-byte characters for each invalid sequence. Legacy text decodes to
    almost none (an 8-bit letter is rarely followed by what UTF-8 takes as its continuation)."""
    text = data.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd")
    valid = len(text) - len(text.encode("ascii", errors="ignore")) - invalid
    return text if valid >= 4 * invalid else None


def _binary() -> ParseError:
    return ParseError("not a text file (binary data, or text in an encoding that could not be detected)")


# ------------------------------------------------------------------------------------------------ HTML

# Content that is never text a reader sees.
_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "iframe", "object", "canvas"})
# Elements that end a paragraph (their text must not run into the next block's).
_BLOCKS = frozenset({
    "p", "div", "br", "hr", "li", "ul", "ol", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "tr", "td", "th", "thead", "tbody", "section", "article", "aside", "header", "footer",
    "nav", "main", "blockquote", "pre", "figure", "figcaption", "title", "address", "details", "summary",
})  # fmt: skip
_VOID = frozenset(
    {
        "br",
        "hr",
        "img",
        "input",
        "meta",
        "link",
        "area",
        "base",
        "col",
        "embed",
        "source",
        "track",
        "wbr",
        "param",
    }
)


class _TextExtractor(HTMLParser):
    """The stdlib's tolerant HTML tokenizer; we only decide which text counts and where blocks end."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP:
            self._skipping.append(tag)
        elif tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if self._skipping and tag == self._skipping[-1]:
            self._skipping.pop()
        elif tag in _BLOCKS and not self._skipping:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def html_text(markup: str) -> str:
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    # Within a block, markup line breaks are just spaces; blank lines separate blocks.
    blocks = (re.sub(r"\s+", " ", block).strip() for block in "".join(parser.parts).split("\n\n"))
    return "\n\n".join(b for b in blocks if b)


# ------------------------------------------------------------------------------------------------ PDF


def pdf_text(data: bytes, max_chars: int | None = None) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError, PyPdfError

    shown = 0

    def count(text: str, *_: Any) -> None:
        # pypdf calls this with each run of text as a page's content stream shows it, so a file
        # that expands past the limit stops there rather than at the end of its page. One text
        # operator can still expand to a billion characters before this is called: the parse
        # process's memory limit is what stops that.
        nonlocal shown
        shown += len(text)
        if max_chars is not None and shown > max_chars:
            raise too_long(max_chars)

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            raise ParseError("the PDF is encrypted")
        visitor = count if max_chars is not None else None
        pages = [page.extract_text(visitor_text=visitor) or "" for page in reader.pages]
    except (ParseError, MemoryError):
        raise
    except (PdfReadError, PyPdfError) as exc:
        raise ParseError(f"not a readable PDF: {exc}") from None
    except Exception as exc:  # pypdf raises assorted errors on damaged files
        log.info("pypdf failed on a damaged file", exc_info=True)
        raise ParseError(f"not a readable PDF ({type(exc).__name__}: {exc})") from None
    if not pages:
        raise ParseError("the PDF has no pages")
    if not any(p.strip() for p in pages):
        raise ParseError("the PDF has no extractable text (a scanned document needs OCR first)")
    return "\n\n".join(p.strip() for p in pages if p.strip())
