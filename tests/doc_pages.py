"""The documentation's pages as the site builds them: every markdown file under docs/ that mkdocs.yml does not exclude
(its `exclude_docs`, the result files and training records), which ones are generated, and the README's hand-written
part. Shared by the tests that read pages (tests/test_pages.py, tests/test_doc_commands.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
BENCHMARKS = DOCS / "benchmarks.md"  # written by `kvserve report`
REFERENCE = DOCS / "reference"  # written by `python -m kvserve.tools.reference`


def site_config() -> dict:
    """mkdocs.yml (plain YAML: no `!!python` tags)."""
    return yaml.safe_load(MKDOCS.read_text())


def site_pages() -> list[Path]:
    """Every markdown file under docs/ the site builds, generated pages included: mkdocs.yml's `exclude_docs` is
    gitignore-style, read here by pathspec as mkdocs (whose dependency it is) reads it."""
    import pathspec

    patterns = [line for line in site_config().get("exclude_docs", "").splitlines() if line.strip()]
    left_out = pathspec.GitIgnoreSpec.from_lines(patterns)
    return sorted(page for page in DOCS.rglob("*.md") if not left_out.match_file(page.relative_to(DOCS).as_posix()))


def generated(page: Path) -> bool:
    return page == BENCHMARKS or REFERENCE in page.parents


def hand_pages() -> list[Path]:
    """The pages people write: the site's pages less the generated ones (the README is counted on its own)."""
    return [page for page in site_pages() if not generated(page)]


def readme_by_hand() -> str:
    """The README less its results block, which `kvserve report` writes."""
    from kvserve.tools.report import readme

    text = README.read_text()
    return text[: text.index(readme.START)] + text[text.index(readme.END) :]
