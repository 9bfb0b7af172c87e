"""CSV and JSON -> searchable lines, through the standard library's parsers.

A CSV row becomes one paragraph of ``header: value`` pairs (the first row names the columns), so
a row found by a search says what each of its values is. A JSON document becomes one
``path: value`` line per leaf (``store.books[0].title: Dune``). Either can give far more text than
its bytes (long headers repeated on every row, deep paths repeated on every leaf), so the
character limit is checked line by line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from domains.knowledge.parsing import Budget, ParseError

# The sniffer's regular expressions run over the sample: a bounded one, cut at a line end.
SNIFF_CHARS = 64 * 1024
DELIMITERS = ",;\t|"


def csv_text(text: str, max_chars: int | None = None) -> str:
    budget = Budget(max_chars)
    return "\n\n".join(budget.take(line) for line in _csv_lines(text))


def _dialect(text: str) -> type[csv.Dialect] | csv.Dialect:
    sample = text[:SNIFF_CHARS]
    if len(text) > SNIFF_CHARS and "\n" in sample:
        sample = sample[: sample.rindex("\n")]
    try:
        return csv.Sniffer().sniff(sample, delimiters=DELIMITERS)
    except csv.Error:  # one column, or no pattern the sniffer is sure of
        return csv.excel


def _csv_lines(text: str) -> Iterator[str]:
    reader = csv.reader(io.StringIO(text, newline=""), _dialect(text))
    header: list[str] | None = None
    rows = 0
    try:
        for row in reader:
            if not any(field.strip() for field in row):
                continue
            if header is None:
                header = [name.strip() for name in row]
                continue
            rows += 1
            pairs = (
                f"{header[i] if i < len(header) and header[i] else f'column {i + 1}'}: {value.strip()}"
                for i, value in enumerate(row)
                if value.strip()
            )
            yield "; ".join(pairs)
    except csv.Error as exc:
        raise ParseError(f"not a readable CSV file (line {reader.line_num}: {exc})") from None
    if header is not None and rows == 0:  # only the header: its names are the text
        yield "; ".join(name for name in header if name)


def json_text(text: str, max_chars: int | None = None) -> str:
    try:
        value = json.loads(text)
    except RecursionError:
        raise ParseError("not a readable JSON file (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of too many digits
        raise ParseError(f"not valid JSON ({exc})") from None
    budget = Budget(max_chars)
    return "\n\n".join(budget.take(line) for line in _leaves(value))


def _leaves(value: Any) -> Iterator[str]:
    """``path: value`` for each leaf in document order (iteratively: no recursion limit)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            stack.extend(reversed([(f"{path}.{key}" if path else key, v) for key, v in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(f"{path}[{i}]", v) for i, v in enumerate(item)]))
        else:
            shown = item if isinstance(item, str) else json.dumps(item)
            if shown.strip():
                yield f"{path}: {shown}" if path else shown
