"""Word (.docx) -> plain text through python-docx: the body's paragraphs and tables in document
order, a table row as one line of its cells (a merged cell once), nested tables in their cell.

A .docx is a zip of XML parts that python-docx reads whole: a small upload can declare parts of
gigabytes. Nothing here bounds that; the parse process's memory limit and deadline do, and the
character limit is checked as the text is gathered. lxml as python-docx sets it up resolves no
entities and refuses nesting deeper than its default limit.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

from domains.knowledge.parsing import Budget, ParseError

log = logging.getLogger(__name__)


def docx_text(data: bytes, max_chars: int | None = None) -> str:
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    budget = Budget(max_chars)
    try:
        document = docx.Document(io.BytesIO(data))
        return "\n\n".join(budget.take(block) for block in _blocks(document))
    except (ParseError, MemoryError):
        raise
    except (PackageNotFoundError, KeyError) as exc:  # KeyError: a part the package names is missing
        raise ParseError(f"not a readable .docx file (not a Word document package: {exc})") from None
    except Exception as exc:  # zipfile, lxml and python-docx raise assorted errors on damaged files
        log.info("python-docx failed on a damaged file", exc_info=True)
        raise ParseError(f"not a readable .docx file ({type(exc).__name__}: {exc})") from None


def _blocks(container: Any) -> Iterator[str]:
    from docx.table import Table

    for item in container.iter_inner_content():
        if isinstance(item, Table):
            yield from _rows(item)
        elif text := item.text.strip():
            yield text


def _rows(table: Any) -> Iterator[str]:
    for row in table.rows:
        cells, seen = [], set()
        for cell in row.cells:
            if id(cell._tc) in seen:  # a cell merged across columns appears once per column
                continue
            seen.add(id(cell._tc))
            if text := " ".join(_blocks(cell)):
                cells.append(text)
        if cells:
            yield " | ".join(cells)
