"""No comment or docstring in kvserve/ or kernels/ quotes a measured share or ratio: a number typed by hand drifts
from the data, so a comment names the benchmarks page's section instead (`measured: docs/benchmarks.md, section
"..."`). Each check also runs on made-up text, so it can fail.

What counts as quoting a measurement, narrowly: a share (`N%`) or ratio (`Nx`) in a clause (the text between
punctuation) that also says what was measured against what: a share of `full`, a ratio to vanilla's, throughput,
faster, slower, a cost, an overhead, a profile's samples. Definitions and constants pass: a 95% interval, a budget
that compresses 8x, 10% of a learning rate, and anything in backticks (code, the format a table prints)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = (REPO / "kvserve", REPO / "kernels")

SHARE_OR_RATIO = re.compile(r"(?<![\w.])~?\d+(?:\.\d+)?(?:\s?%|x\b)")
CONFIDENCE = re.compile(r"\s*(?:Wilson\s+|confidence\s+)?(?:interval|band)", re.IGNORECASE)
MEASURED = re.compile(
    r"\bof `?full`?\b|\bfull`?'s\b|\bvanilla's\b|\bthroughput\b|\bfaster\b|\bslower\b|\bslowdown\b|\bmeasured\b"
    r"|\btook\b|\bsamples\b|tokens/s\b|\bcosts?\b|\blifted\b|\boverhead\b|\bbandwidth\b",
    re.IGNORECASE,
)
CLAUSE_END = re.compile(r"[;:?!()\[\]]|,\s|\.\s|\.$")


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    found = [
        (token.start[0], token.string[1:])
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    return found


def measured_quotes(text: str) -> list[str]:
    """The shares and ratios `text` quotes as measurements (see the module's docstring)."""
    prose = re.sub(r"`[^`]*`", " ", " ".join(text.split()))
    quotes = []
    for clause in CLAUSE_END.split(prose):
        if not MEASURED.search(clause):
            continue
        for number in SHARE_OR_RATIO.finditer(clause):
            if not CONFIDENCE.match(clause, number.end()):
                quotes.append(number.group().strip())
    return quotes


def breaches(files: dict[str, str]) -> list[str]:
    """`file:line: quote` for every measured share or ratio in the files' comments and docstrings, in file order."""
    found = sorted(
        (name, line, quote)
        for name, source in files.items()
        for line, text in comments_and_docstrings(source)
        for quote in measured_quotes(text)
    )
    return [f"{name}:{line}: {quote}" for name, line, quote in found]


def test_no_comment_or_docstring_quotes_a_measured_share_or_ratio():
    files = {str(path.relative_to(REPO)): path.read_text() for root in SOURCES for path in sorted(root.rglob("*.py"))}
    assert len(files) > 100 and any(name.startswith("kernels/") for name in files)
    assert breaches(files) == []


def test_a_measured_share_or_ratio_in_a_comment_or_docstring_fails():
    made_up = {
        "kvserve/leak.py": '"""H2O decodes at 1.09x full\'s cost on this CPU."""\n'
        "# 0.25 by the quality suite: 95% / 98% of full at B = 128 / 256\n"
        "x = 1  # ~13% of throughput\n",
        "kernels/leak.py": 'def f():\n    """A program of 1024 slots: ~6x faster."""\n',
    }
    assert breaches(made_up) == [
        "kernels/leak.py:2: ~6x",
        "kvserve/leak.py:1: 1.09x",
        "kvserve/leak.py:2: 95%",
        "kvserve/leak.py:2: 98%",
        "kvserve/leak.py:3: ~13%",
    ]


def test_definitions_and_constants_pass():
    definitions = [
        "each cell's share of full with its 95% interval (Wilson)",
        "share of full [95%] per length",
        "budgets compressing 4x, 8x and 16x; output tokens/s against vanilla, vanilla at 1x",
        "cosine decay to 10% of the peak learning rate",
        "the format: `92% [84-100%] (0.764)`, `1.98x (B=188)` of full",
        'measured: docs/benchmarks.md, section "How much quality do I keep at 8x?"',
    ]
    assert [text for text in definitions if measured_quotes(text)] == []
    # a string that is code, not a comment or docstring, is not read here
    assert comments_and_docstrings('x = "95% of full"\n') == []
