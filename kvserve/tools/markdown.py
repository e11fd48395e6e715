"""Markdown tables: one header row, a separator, then the rows (cells already formatted)."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x"
