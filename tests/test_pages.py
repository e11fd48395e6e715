"""The pages an operator reads: each within its word budget, all of them in the site's nav, the site built with
`mkdocs build --strict` (broken links and anchors fail it), and no measured number typed by hand.

A measured number is a share (`91%`), a ratio (`1.98x`), a rate (`55.7 tokens/s`) or a measured time or size with a
decimal (`0.115 s`, `13.3 minutes`). The user's guide quotes none: it links the section of the generated benchmarks
page that holds it. Any other page may quote one only where the generated benchmarks page (or the gates' training
record) holds it and the page links the benchmarks page, so a number that drifts from the data fails here. What is
not a measurement is told apart by its form: a confidence level (`95% interval`), a compression ratio that is
arithmetic (`a 4k-token prompt at B=512 is 8x smaller`), a download size `kvserve/catalog.py` declares.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import (
    BENCHMARKS,
    DOCS,
    README,
    ROOT,
    hand_pages,
    readme_by_hand,
    site_config,
    site_pages,
)

PAGE_WORDS = 3_000
PAGES_WORDS = 15_000  # every hand-written page together, the README aside
README_WORDS = 1_000
GUIDE = DOCS / "guide"

SHARE = r"\b\d+(?:\.\d+)?%"
RATIO = r"\b\d+(?:\.\d+)?x\b"
RATE = r"\b\d[\d,]*(?:\.\d+)? ?(?:tokens/s|tok/s|requests/s)"
MEASURED = r"\b\d+\.\d+ ?(?:s|ms|min|minutes|h|GB|GiB|MB|MiB)\b"
NUMBER = re.compile("|".join(f"(?:{kind})" for kind in (SHARE, RATIO, RATE, MEASURED)))
CONFIDENCE = re.compile(r"\b(?:90|95|99)% (?:interval|confidence)")
# "a 4k-token prompt at B=512 is 8x smaller": the ratio is the prompt over the budget, checked below
COMPRESSION = re.compile(r"\b(\d+)k-token prompt at B=(\d+) is (\d+)x\b")


def words(text: str) -> int:
    return len(text.split())  # as `wc -w` counts


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def nav_pages(entries) -> list[str]:
    """The files mkdocs.yml's nav names, at any depth."""
    found = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def derived(text: str, catalog_sizes: set[str]) -> list[str]:
    """The numbers of `text` that have the form of a measurement but are not one: confidence levels, arithmetic
    compression ratios (wrong arithmetic is not derived, so it fails as typed by hand), declared download sizes."""
    found = [match.group(0).split()[0] for match in CONFIDENCE.finditer(text)]
    for match in COMPRESSION.finditer(text):
        tokens, budget, ratio = (int(group) for group in match.groups())
        if tokens * 1024 // budget == ratio:
            found.append(f"{ratio}x")
    found += [size for size in catalog_sizes if size in text]
    return found


def typed_numbers(text: str) -> list[str]:
    """The measured numbers of a text that nothing derives (see the module docstring); a link's target is an
    address, not a quote (`benchmarks.md#how-much-quality-do-i-keep-at-8x`)."""
    text = re.sub(r"\]\([^)\s]*\)", "]()", text)
    quoted = [match.group(0) for match in NUMBER.finditer(text)]
    for number in derived(text, catalog_sizes()):
        if number in quoted:
            quoted.remove(number)
    return quoted


def catalog_sizes() -> set[str]:
    """The GGUF download size of each model `kvserve setup-model` fetches, as the models page prints it."""
    from kvserve.catalog import SLICED_MODELS

    return {f"{model.size / 1e9:.2f} GB" for model in SLICED_MODELS.values()}


def in_data(number: str, data: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}", data) is not None


def test_the_site_holds_the_pages_it_should():
    """The page list the tests read is what the site builds (a broken exclude would empty the checks below)."""
    pages = {name(page) for page in site_pages()}
    assert {"docs/index.md", "docs/guide/serving.md", "docs/benchmarks.md", "docs/contributing.md"} <= pages
    assert not any(page.startswith(("docs/eval/", "docs/gates/")) for page in pages)
    assert len(hand_pages()) >= 10


def test_every_page_is_in_the_nav_and_the_nav_names_only_pages():
    config = site_config()
    assert config["docs_dir"] == "docs" and config["theme"]["name"] == "material"
    in_nav = nav_pages(config["nav"])
    built = [page.relative_to(DOCS).as_posix() for page in site_pages()]
    assert sorted(set(built) - set(in_nav)) == [], "pages the nav leaves out"
    generated_in_nav = [page for page in in_nav if page.startswith("reference/") or page == "benchmarks.md"]
    # the generated pages are named whether or not their generator has run yet: the site build then finds them
    assert sorted(set(in_nav) - set(built) - set(generated_in_nav)) == [], "nav entries with no page"
    assert len(in_nav) == len(set(in_nav))


@pytest.mark.parametrize("page", hand_pages(), ids=name)
def test_each_page_reads_within_its_budget(page):
    assert words(page.read_text()) <= PAGE_WORDS, f"{name(page)}: {words(page.read_text())} words"


def test_the_pages_together_and_the_readme_read_within_their_budgets():
    total = {name(page): words(page.read_text()) for page in hand_pages()}
    assert sum(total.values()) <= PAGES_WORDS, total
    assert words(README.read_text()) <= README_WORDS


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: every nav entry, link and anchor resolves (the `docs` extra installs mkdocs)."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),  # (Material's notice about MkDocs 2, not a page's warning)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (tmp_path / "site" / "guide" / "serving" / "index.html").exists()


def test_the_guide_quotes_no_measured_number():
    """The user's guide links the benchmarks page's sections instead of quoting what they measured."""
    quoted = {name(page): typed_numbers(page.read_text()) for page in sorted(GUIDE.glob("*.md"))}
    guide_in_nav = {f"docs/{page}" for page in nav_pages(site_config()["nav"]) if page.startswith("guide/")}
    assert set(quoted) == guide_in_nav  # every guide page, read here
    assert {page: numbers for page, numbers in quoted.items() if numbers} == {}
    linked = [page for page in GUIDE.glob("*.md") if "../benchmarks.md#" in page.read_text()]
    assert len(linked) >= 4, "the guide points at the measurements it does not quote"


def test_every_other_page_quotes_only_numbers_the_data_holds():
    """Outside the guide, a measured number stands on the generated benchmarks page or in the gates' training record,
    and the page links the benchmarks page; the README's hand-written part quotes none."""
    data = BENCHMARKS.read_text() + (DOCS / "gates" / "findings.md").read_text()
    wrong = {}
    for page in hand_pages():
        if GUIDE in page.parents:
            continue
        text = page.read_text()
        quoted = typed_numbers(text)
        unknown = [number for number in quoted if not in_data(number, data)]
        if unknown or (quoted and "benchmarks.md" not in text):
            wrong[name(page)] = unknown or ["(quotes measurements without linking the benchmarks page)"]
    assert wrong == {}
    assert typed_numbers(readme_by_hand()) == []


@pytest.mark.parametrize(
    "text, typed",
    [
        ("SnapKV keeps 91% of full at B=256", ["91%"]),
        ("it serves 1.98x vanilla's output tokens/s", ["1.98x"]),
        ("vanilla served 55.7 tokens/s", ["55.7 tokens/s"]),
        ("each question starts in 0.115 s", ["0.115 s"]),
        ("calibrating took 13.3 minutes", ["13.3 minutes"]),
        ("a 4k-token prompt at B=512 is 16x smaller", ["16x"]),  # wrong arithmetic is typed by hand
        ("a 4k-token prompt at B=512 is 8x smaller, with a 95% interval", []),
        ("a 1,024-token prompt at B=256 and 2 x layers x KV heads", []),
        ("[the quality table](../benchmarks.md#how-much-quality-do-i-keep-at-8x)", []),
    ],
)
def test_the_number_rule_tells_measurements_from_the_rest(text, typed):
    assert typed_numbers(text) == typed


def test_the_models_page_gives_each_download_size_the_catalog_declares():
    """The Qwen model's size is stated once, from `kvserve/catalog.py` (pages once said 0.5 GB and 1.2 GB)."""
    text = (GUIDE / "models.md").read_text()
    assert sorted(re.findall(r"\b\d+\.\d+ GB\b", text)) == sorted(catalog_sizes())


def test_every_series_a_page_names_is_served_under_its_current_name():
    """A page that names a kvserve series names one `/metrics` serves, not a deprecated one."""
    from kvserve import metrics

    series = vars(metrics._series()).values()
    served = {metrics.served_name(one) for one in series}
    served |= {one._name + suffix for one in series if one._type == "histogram" for suffix in ("_bucket", "_sum")}
    deprecated = set(getattr(metrics, "DEPRECATED_METRICS", {}))
    named = {
        (name(page), found)
        for page in [README, *hand_pages()]
        for found in re.findall(r"kvserve:[a-z_]+", page.read_text())
    }
    assert named, "the pages name no series (a broken pattern would pass vacuously)"
    assert sorted((page, found) for page, found in named if found not in served or found in deprecated) == []


def test_no_page_or_code_string_points_at_the_old_guide():
    """docs/guide.md was split into docs/guide/; nothing shipped still sends a reader there."""
    stale = []
    for path in [README, *hand_pages(), *(ROOT / "kvserve").rglob("*.py"), *(ROOT / "configs").glob("*.yaml")]:
        if "docs/guide.md" in path.read_text() or "](guide.md" in path.read_text():
            stale.append(name(path))
    for path in [*(ROOT / "deploy").rglob("*.yaml")]:
        if "docs/guide.md" in path.read_text():
            stale.append(name(path))
    assert stale == []
