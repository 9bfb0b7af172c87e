"""Uploaded bytes -> plain text, per file type. CPU-heavy (PDF especially) and, on a hostile file,
unbounded: the handler runs it in a child process with limits (``parse_process``).

A file that cannot give text raises ``ParseError`` with a message a user can act on; the handler
stores it in ``error_message`` with the ``error_parsing`` state.
"""

from __future__ import annotations

import io
import logging
import re
from html.parser import HTMLParser
from typing import Any

log = logging.getLogger(__name__)

EXTENSIONS = {
    ".txt": "txt",
    ".text": "txt",
    ".md": "md",
    ".markdown": "md",
    ".html": "html",
    ".htm": "html",
    ".pdf": "pdf",
}
CONTENT_TYPES = {
    "txt": "text/plain; charset=utf-8",
    "md": "text/markdown; charset=utf-8",
    "html": "text/html; charset=utf-8",
    "pdf": "application/pdf",
}


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
    """The file's text; over ``max_chars`` characters raises ``LimitExceeded`` (a PDF as soon as
    it passes the limit, not once all of it is extracted)."""
    if not data:
        raise ParseError("the file is empty")
    if file_type in ("txt", "md"):
        text = _decode(data)
    elif file_type == "html":
        text = html_text(_decode(data))
    elif file_type == "pdf":
        text = pdf_text(data, max_chars)
    else:
        raise ParseError(f"unsupported file type {file_type!r}")
    text = text.replace("\x00", "")  # PostgreSQL text cannot hold U+0000
    if max_chars is not None and len(text) > max_chars:
        raise too_long(max_chars)
    if not text.strip():
        raise ParseError("no text found in the file")
    return text


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ParseError(f"not UTF-8 text (invalid byte at offset {exc.start})") from None


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
