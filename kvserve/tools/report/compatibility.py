"""The guide's compatibility matrix: each vLLM feature, as vanilla `vllm serve` and `kvserve serve` with eviction on
answered it, from docs/eval/compatibility.json (written by tests/test_compatibility.py, which fails where an outcome
differs from the file). `kvserve report` writes it between its markers in docs/guide/compatibility.md."""

from __future__ import annotations

from pathlib import Path

from kvserve.provenance import describe_machine
from kvserve.tools.markdown import table, with_block
from kvserve.tools.report.sources import DataDir

MATRIX = "compatibility.json"
GUIDE = Path("docs/guide/compatibility.md")
START = "<!-- compatibility: written by `kvserve report` from docs/eval/compatibility.json; edit the test, not this -->"
END = "<!-- /compatibility -->"
TEST = "tests/test_compatibility.py"


def cell(outcome: str) -> str:
    """An outcome as the table shows it: a refusal keeps its reason, in one line, pipes escaped."""
    return outcome.replace("|", "\\|").replace("\n", " ")


def block(data: DataDir) -> str:
    source = data.load(MATRIX)
    matrix = source.data
    run = source.runs[-1]
    observed = f"{describe_machine(run['machine'])}, {run['date']}"
    evicting = ", ".join(f"`{key}: {value}`" for key, value in matrix["kvserve_evicting"].items())
    rows = [[row["feature"], row["request"], cell(row["vanilla"]), cell(row["kvserve"])] for row in matrix["rows"]]
    return "\n".join(
        [
            START,
            table(["Feature", "Asked by", "vanilla vLLM", "kvserve, evicting"], rows),
            "",
            f"vLLM {matrix['vllm']} (CPU build), the default model over HTTP; kvserve's requests evict ({evicting} "
            f"per request; the started servers by their defaults). Observed by `{TEST}` ({observed}); "
            "rerun it with `KVSERVE_WRITE_COMPATIBILITY=1` to rewrite the file.",
            END,
        ]
    )


def update(page: Path, data: DataDir) -> str:
    """The guide page's text with the matrix rebuilt from `data` (not written)."""
    return with_block(page.read_text(), START, END, block(data), f"{page} has no compatibility block")
