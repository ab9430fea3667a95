"""Printing a table of figures: one header line, a rule, one line per row."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

# A column: (title, width, cell) where cell formats one row's value; the title and cells
# are right-aligned to the width (a negative width left-aligns).
Column = tuple[str, int, Callable[[Any], str]]


def fmt(value: Any, spec: str, none: str = "-") -> str:
    """``format(value, spec)``, or ``none`` for None."""
    return none if value is None else format(value, spec)


def _align(text: str, width: int) -> str:
    return f"{text:<{-width}}" if width < 0 else f"{text:>{width}}"


def print_table(columns: Sequence[Column], rows: Sequence[Any] | Mapping[Any, Any],
                title: str | None = None, rule: str = "-", markdown: bool = False) -> None:
    """Print ``rows`` (a sequence, or a mapping's values) under ``columns``, after an
    optional ``title`` line: aligned text under a ``rule`` line (none when empty), or with
    ``markdown`` a Markdown table (widths only say the alignment)."""
    if title:
        print(title)
    values = rows.values() if isinstance(rows, Mapping) else rows
    if markdown:
        print("| " + " | ".join(name for name, _, _ in columns) + " |")
        print("| " + " | ".join("---" if width < 0 else "---:" for _, width, _ in columns)
              + " |")
        for row in values:
            print("| " + " | ".join(cell(row) for _, _, cell in columns) + " |")
        return
    header = "".join(_align(name, width) for name, width, _ in columns)
    print(header)
    if rule:
        print(rule * len(header))
    for row in values:
        print("".join(_align(cell(row), width) for _, width, cell in columns))
