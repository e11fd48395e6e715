"""The hard half of retrieval: RULER's multi-key lookup (`multikey_one`: four keys' needles, one asked, the prompt
ending in the asked needle's own words) on both models, by prompt length, with the query-agnostic checkpoint rows
(`kv_checkpoint`: compaction before the question is seen) beside the query-aware ones."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.eval.suite import Suite
from kvserve.tools.report.models import by_length_table
from kvserve.tools.report.sources import DataDir, Source

MODELS = (
    ("SmolLM2-135M-Instruct (the default model)", "suite/multikey.jsonl"),
    ("Qwen2.5-Coder-0.5B-Instruct", "qwen05/multikey.jsonl"),
)
TITLE = "## The hard half: multi-key lookup"


def model_part(title: str, source: Source) -> list[str]:
    suite = Suite.from_rows(source.data)
    answers = sorted({n for _, n in suite.full.values()})
    return [
        f"### {title}",
        f"{' or '.join(map(str, answers))} cases a length; each setting's share of full [95% interval] (its mean):",
        by_length_table(suite, overall=True),
        source.caption(),
    ]


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [
        TITLE,
        "The suite's judged tasks on the default model hold one needle each (passkey, chat follow-up, RULER's "
        "single needle). Retrieval among several needles with different keys is where the policies lose most, and "
        "the suite left it out because `full` failed it in the formats tried. Asked as RULER's multi-key lookup "
        "(`multikey_one`: four keys' needles in the haystack, one key asked) with the prompt ending in the asked "
        'needle\'s own opening words ("One of the special magic numbers for walrus is:"), as the passkey prompt '
        "ends in its own, `full` answers it on both models. The tables below are measured on that task alone; the "
        "main tables above do not include it yet. Rows with `kv_checkpoint=512` compact every 512 tokens, "
        "before the question is seen (what a document compressed once for every later question gets).",
    ]
    for title, name in MODELS:
        parts += model_part(title, data.load(name))
    return "\n\n".join(parts)
