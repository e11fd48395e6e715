"""The hard half of retrieval: RULER's multi-key lookup (`multikey_one`: four keys' needles, one asked, the prompt
ending in the asked needle's own words) on both models, by prompt length, with the query-agnostic rows (`kv_checkpoint`:
compaction before the question is seen; `kvzip`: the document compressed once by its reconstruction) beside the
query-aware ones, and what a compressed document saves its questions (`kvserve bench documents`)."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.eval.suite import Suite
from kvserve.tools.report.models import by_length_table
from kvserve.tools.report.quality import CHECKPOINT, FLOOR, base_policy, best_labels
from kvserve.tools.report.sources import DataDir, Source, captions

MODELS = (
    ("SmolLM2-135M-Instruct (the default model)", "suite/multikey.jsonl"),
    ("Qwen2.5-Coder-0.5B-Instruct", "qwen05/multikey.jsonl"),
)
TITLE = "## The hard half: multi-key lookup"
# at 4k tokens B=256 is 16x; the smaller budgets' multi-key cells are in each model's quality table (judged there)
MIN_BUDGET = 256
DOCUMENTS = (
    ("SmolLM2-135M-Instruct", "documents.json"),
    ("Qwen2.5-Coder-0.5B-Instruct", "qwen05/documents.json"),
)


def model_part(title: str, source: Source) -> list[str]:
    suite = Suite.from_rows(source.data)
    answers = sorted({n for _, n in suite.full.values()})
    # each policy's best setting (the knob variants explored before, e.g. snapkv's older pool of 7, are in the file),
    # and every query-agnostic one: compaction before the question is what this table sets beside the others
    shown = set(best_labels(suite, suite.judged_cells(FLOOR)).values())
    shown |= {label for label, _ in suite.cells if CHECKPOINT in label or base_policy(label) == "kvzip"}
    return [
        f"### {title}",
        f"{' or '.join(map(str, answers))} cases a length; each policy's best setting and those that compact before "
        f"the question, at B >= {MIN_BUDGET}; share of full [95% interval]:",
        by_length_table(suite, overall=True, labels=shown, min_budget=MIN_BUDGET),
        source.caption(),
    ]


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [
        TITLE,
        "RULER's multi-key lookup (`multikey_one`: four keys' needles, one asked), where the policies lose most, by "
        "prompt length; query-agnostic settings beside query-aware ones: `kv_checkpoint=512` compacts every 512 "
        "tokens before the question; `kvzip` compresses the document once without it (`POST /v1/kvserve/compress`).",
    ]
    for title, name in MODELS:
        parts += model_part(title, data.load(name))
    parts += documents_part(data)
    return "\n\n".join(parts)


def documents_part(data: DataDir) -> list[str]:
    """`kvserve bench documents`: time to first token of a document's questions, recomputed, read from the prefix
    cache in full, and resumed from the compressed document, against vanilla vLLM recomputing them."""
    from kvserve.tools.bench.documents import report

    sources = [(title, data.load(name)) for title, name in DOCUMENTS if (data.folder / name).exists()]
    if not sources:
        return []
    parts = [
        "### Compress once, ask many",
        "Each question is the document and a short question of its own; TTFT: a one-token completion's latency. The "
        "compression (the document, the repeat instruction and the document again, then the compaction) is paid "
        "once per document; the last column: the questions after which it has paid for itself against recomputing.",
    ]
    for title, source in sources:
        args = source.data["args"]
        parts += [
            f"{title}, a {args['doc_tokens']}-token document, {args['questions']} questions:",
            report(source.data["results"]),
        ]
    return [*parts, captions([source for _, source in sources])]
