"""CHANGELOG.md in Keep a Changelog 1.1.0's form (https://keepachangelog.com/en/1.1.0/): its title and intro, an
`[Unreleased]` section, then one `## [X.Y.Z] - YYYY-MM-DD` section per release, newest first, the package's own
version among them, each made of Keep a Changelog's six kinds of change, written for operators, not trackers."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from kvserve import __version__

CHANGELOG = Path(__file__).parent.parent / "CHANGELOG.md"
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
INTRO = (
    "The format is based on [Keep a Changelog](https://keepachangelog.com/en/1.1.0/), and this project adheres to\n"
    "[Semantic Versioning](https://semver.org/spec/v2.0.0.html)."
)
RELEASE = re.compile(r"\[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d\d-\d\d)")
TRACKER = re.compile(r"(?<![\w&])#\d+\b|\b(?:issue|ticket|PR|pull request)s?\s+#?\d+", re.IGNORECASE)


def sections(text: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """(version heading, [(kind heading, its lines)]) in order; the lines before the first `##` are left out."""
    found: list[tuple[str, list[tuple[str, list[str]]]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            found.append((line[3:], []))
        elif line.startswith("### "):
            assert found, f"{line!r} before any version heading"
            found[-1][1].append((line[4:], []))
        elif found and line.strip():
            assert found[-1][1], f"{found[-1][0]}: text outside a kind of change: {line!r}"
            found[-1][1][-1][1].append(line)
    return found


def problems(text: str) -> list[str]:
    """Everything in `text` that breaks the form above (empty: none)."""
    wrong = []
    if not text.startswith("# Changelog\n"):
        wrong.append("the title is not `# Changelog`")
    if INTRO not in text.split("\n## ", 1)[0]:
        wrong.append("the intro does not link Keep a Changelog 1.1.0 and Semantic Versioning 2.0.0")
    parsed = sections(text)
    headings = [heading for heading, _ in parsed]
    if not headings or headings[0] != "[Unreleased]" or headings.count("[Unreleased]") != 1:
        wrong.append("`## [Unreleased]` is not the first version heading, once")
    versions = []
    for heading in headings[1:]:
        match = RELEASE.fullmatch(heading)
        if match is None:
            wrong.append(f"`## {heading}` is not `## [X.Y.Z] - YYYY-MM-DD`")
            continue
        try:
            datetime.date.fromisoformat(match[4])
        except ValueError:
            wrong.append(f"`## {heading}`: {match[4]} is not a date")
        versions.append((tuple(int(part) for part in match.groups()[:3]), match[4]))
    if [v for v, _ in versions] != sorted({v for v, _ in versions}, reverse=True):
        wrong.append("the versions are not newest first, each once")
    if [d for _, d in versions] != sorted((d for _, d in versions), reverse=True):
        wrong.append("the dates are not newest first")
    if tuple(int(part) for part in __version__.split(".")) not in [v for v, _ in versions]:
        wrong.append(f"the package's version {__version__} has no section")
    for heading, kinds in parsed:
        if heading != "[Unreleased]" and not kinds:
            wrong.append(f"`## {heading}` lists no change")
        names = [kind for kind, _ in kinds]
        for kind in names:
            if kind not in KINDS:
                wrong.append(f"`## {heading}`: `### {kind}` is not one of {', '.join(KINDS)}")
        if len(set(names)) != len(names):
            wrong.append(f"`## {heading}`: a kind of change appears twice")
        if [k for k in KINDS if k in names] != [k for k in names if k in KINDS]:
            wrong.append(f"`## {heading}`: the kinds are not in Keep a Changelog's order")
        for kind, lines in kinds:
            if not lines or not lines[0].startswith("- "):
                wrong.append(f"`## {heading}` / `### {kind}`: not a list of changes")
            for line in lines:
                if not (line.startswith("- ") or line.startswith("  ")):
                    wrong.append(f"`## {heading}` / `### {kind}`: prose outside the bullets: {line!r}")
    for number, line in enumerate(text.splitlines(), 1):
        if TRACKER.search(line):
            wrong.append(f"line {number} cites a tracker number: {line.strip()!r}")
    return wrong


def test_the_changelog_keeps_the_form():
    assert problems(CHANGELOG.read_text()) == []


def test_the_newest_release_is_the_packages_version():
    releases = RELEASE.findall(CHANGELOG.read_text())
    assert ".".join(releases[0][:3]) == __version__


GOOD = f"""# Changelog

All notable changes to kvserve are documented in this file.

{INTRO}

## [Unreleased]

## [{__version__}] - 2026-12-01

### Added

- A setting.

### Fixed

- A bug.
"""


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t.replace("# Changelog", "# Changes"), "title"),
        (lambda t: t.replace("keepachangelog.com/en/1.1.0/", "example.com"), "intro"),
        (lambda t: t.replace("## [Unreleased]\n", ""), "Unreleased"),
        (lambda t: t.replace("] - 2026-12-01", "] 2026-12-01"), "is not `## [X.Y.Z] - YYYY-MM-DD`"),
        (lambda t: t.replace("] - 2026-12-01", "] - 2026-13-01"), "is not a date"),
        (lambda t: t + "\n## [9.9.9] - 2026-01-01\n\n### Added\n\n- Later.\n", "newest first"),
        (lambda t: t.replace(f"[{__version__}]", "[0.0.1]"), "has no section"),
        (lambda t: t.replace("### Fixed", "### Measured"), "is not one of"),
        (lambda t: t.replace("### Added", "### Fixed", 1).replace("### Fixed\n\n- A bug.", "### Added\n\n- A bug."),
         "order"),
        (lambda t: t.replace("- A bug.", "Some prose about a bug."), "not a list of changes"),
        (lambda t: t.replace("- A bug.", "- A bug (#76)."), "tracker number"),
        (lambda t: t.replace("- A bug.", "- A bug, issue 76."), "tracker number"),
    ],
)  # fmt: skip
def test_each_break_of_the_form_is_found(change, named):
    assert problems(GOOD) == []
    assert any(named in problem for problem in problems(change(GOOD)))
