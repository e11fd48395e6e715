"""Markdown tables (one header row, a separator, then the rows, cells already formatted), and generated blocks
between marker lines in a hand-written page."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x"


def with_block(page: str, start: str, end: str, block: str, what: str) -> str:
    """`page` with the text from its `start` marker to its `end` marker replaced by `block` (which carries both);
    ValueError naming `what` if the page has no such markers."""
    begin, finish = page.find(start), page.find(end)
    if begin < 0 or finish < begin:
        raise ValueError(f"{what} (a line {start!r}, then {end!r})")
    return page[:begin] + block + page[finish + len(end) :]
