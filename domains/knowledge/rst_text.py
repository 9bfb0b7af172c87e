"""reStructuredText -> plain text through docutils, the reference parser: its document tree's
text blocks (titles, paragraphs, list items, literal blocks, a line per table row and per field),
none of the markup. An uploaded .rst is untrusted: no directive may read a file or a URL, raw
output is off, and no docutils.conf is read.

A file docutils cannot make sense of still has text: reStructuredText is readable as it is, so
when docutils fails or finds nothing (a line over its line-length limit, nesting deeper than
Python's recursion limit) the source itself is the text. Sphinx's roles (``:ref:``, ``:func:``…)
are unknown to docutils, which keeps them as "problematic" raw text: their title is kept. So are
its directives, which docutils replaces by an error holding their source: their content is read
as reStructuredText in turn (``seealso``, ``versionadded``, ``glossary``, ``only``…), but for a
``toctree``'s, which lists file names.
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_SETTINGS = {
    "file_insertion_enabled": False,  # include, and raw / csv-table with :file: or :url:
    "raw_enabled": False,
    "_disable_config": True,
    "report_level": 5,  # no report is written anywhere
    "halt_level": 5,  # no error stops the parse: its messages in the tree are left out below
    "warning_stream": False,
    "traceback": True,  # an exception is raised to us, not turned into sys.exit
}
# :role:`title <target>` or :role:`text` as docutils keeps an unknown role.
_ROLE = re.compile(r"^:[\w.:+-]+:`(?P<text>.*)`$", re.DOTALL)
_TARGET = re.compile(r"\s*<[^<>]*>$")
_UNKNOWN_DIRECTIVE = re.compile(r'^Unknown directive type "(?P<name>[^"]+)"')
_NO_TEXT_DIRECTIVES = frozenset({"toctree"})


def rst_text(source: str) -> str:
    from docutils import nodes

    try:
        text = "\n\n".join(_render(source, nodes))
    except MemoryError:
        raise
    except Exception:
        log.info("docutils failed on a file; its source is its text", exc_info=True)
        return source
    return text if text.strip() else source


def _render(source: str, nodes: Any) -> Iterator[str]:
    from docutils.core import publish_doctree

    yield from _blocks(publish_doctree(source, settings_overrides=dict(_SETTINGS)), nodes)


def _blocks(document: Any, nodes: Any) -> Iterator[str]:
    """The text of each block element, in document order (iteratively: a tree as deep as docutils
    could build must not exhaust our stack)."""
    skip = (nodes.Invisible, nodes.raw, nodes.label, nodes.image)
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, skip):
            continue
        if isinstance(node, nodes.system_message):
            yield from _unknown_directive(node, nodes)
            continue
        if isinstance(node, nodes.row):
            cells = (" ".join(_blocks(entry, nodes)) for entry in node.children)
            yield " | ".join(c for c in cells if c)
        elif isinstance(node, nodes.field) and len(node.children) == 2:
            name, body = node.children
            yield f"{_inline(name, nodes).strip()}: {' '.join(_blocks(body, nodes))}"
        elif isinstance(node, nodes.TextElement):
            text = _inline(node, nodes).strip()
            if text:
                yield text
        elif isinstance(node, nodes.Element):
            stack.extend(reversed(node.children))


def _inline(node: Any, nodes: Any) -> str:
    if isinstance(node, nodes.Text):
        return str(node)
    if isinstance(node, nodes.problematic):
        raw = node.astext()
        role = _ROLE.match(raw)
        return _TARGET.sub("", role["text"]).lstrip("~!") if role else raw
    if isinstance(node, nodes.system_message):
        return ""
    return "".join(_inline(child, nodes) for child in node.children)


def _unknown_directive(message: Any, nodes: Any) -> Iterator[str]:
    """The blocks of the content of a directive docutils does not know (from the error it left in
    its place, which holds the directive's source); nothing for any other message."""
    if len(message.children) != 2:
        return
    said, source = message.children
    unknown = _UNKNOWN_DIRECTIVE.match(said.astext())
    if not unknown or unknown["name"] in _NO_TEXT_DIRECTIVES or not isinstance(source, nodes.literal_block):
        return
    lines = source.astext().splitlines()[1:]  # after ".. name:: arguments"
    while lines and lines[0].strip().startswith(":"):  # its options
        lines.pop(0)
    if content := textwrap.dedent("\n".join(lines)).strip():
        yield from _render(content, nodes)
