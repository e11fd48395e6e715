"""What every reference page shares: the banner that says where it comes from, and cells that stay in their table."""

from __future__ import annotations

from pathlib import Path

from kvserve.model import cache_dir

REPOSITORY = Path(__file__).resolve().parents[3]
COMMAND = "python -m kvserve.tools.reference -o docs/reference"


def banner(title: str, source: str) -> str:
    return (
        f"# {title}\n\nGenerated from {source} by `{COMMAND}`; edit the declarations, not this page "
        "(tests/test_reference.py fails when the two differ).\n"
    )


def cell(text: object) -> str:
    """`text` as one Markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: object) -> str:
    return f"`{text}`" if str(text) else ""


def machine_free(text: str) -> str:
    """A default as any machine would show it: this machine's cache folder, home and checkout named, not spelled."""
    text = text.replace(str(cache_dir()), "$KVSERVE_CACHE")
    text = text.replace(str(REPOSITORY) + "/", "")
    return text.replace(str(Path.home()), "~")
