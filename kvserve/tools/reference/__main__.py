"""`python -m kvserve.tools.reference [-o docs/reference] [--check]`: write the reference pages, or with --check
exit 1 showing the difference where the committed pages are not what the code declares."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path

from kvserve.tools.reference import cli, environment, metrics, settings
from kvserve.tools.reference.common import COMMAND, REPOSITORY

# each module's pages: file name -> text
PAGES: tuple[Callable[[], dict[str, str]], ...] = (
    lambda: {"settings.md": settings.page()},
    cli.pages,
    lambda: {"metrics.md": metrics.page()},
    lambda: {"environment.md": environment.page()},
)
OUT = REPOSITORY / "docs" / "reference"


def generate() -> dict[str, str]:
    """File name -> the page as the code declares it now."""
    return {name: text for pages in PAGES for name, text in pages().items()}


def differences(pages: dict[str, str], folder: Path) -> str:
    """A unified diff of each page in `folder` against `pages` ("" when they are equal)."""
    diff = []
    for name, text in pages.items():
        path = folder / name
        committed = path.read_text() if path.exists() else ""
        diff += difflib.unified_diff(
            committed.splitlines(keepends=True), text.splitlines(keepends=True), str(path), f"{name} (generated)"
        )
    return "".join(diff)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.tools.reference", description=__doc__)
    parser.add_argument("-o", "--out", type=Path, default=OUT, help="the folder of the pages")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if the pages differ")
    args = parser.parse_args(argv)
    pages = generate()
    if args.check:
        diff = differences(pages, args.out)
        if diff:
            sys.stdout.write(diff)
            raise SystemExit(f"{args.out}: the reference pages differ from the code; run `{COMMAND}`")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (args.out / name).write_text(text)
        print(args.out / name)


if __name__ == "__main__":
    main()
