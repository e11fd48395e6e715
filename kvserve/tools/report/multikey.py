"""The hard half of retrieval: RULER's multi-key lookup (`multikey_one`: four keys' needles, one asked, the prompt
ending in the asked needle's own words) on both models, by prompt length, with the query-agnostic rows (`kv_checkpoint`:
compaction before the question is seen; `kvzip`: the document compressed once by its reconstruction) beside the
query-aware ones, and what a compressed document saves its questions (`kvserve bench documents`)."""

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
DOCUMENTS = (
    ("SmolLM2-135M-Instruct", "documents.json"),
    ("Qwen2.5-Coder-0.5B-Instruct", "qwen05/documents.json"),
)


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
        "before the question is seen. `kvzip` rows compress each case's document once, without its question "
        "(`POST /v1/kvserve/compress`: KVzip scores every entry by the attention it gets while the model repeats "
        "the document), and the question resumes from the compressed lists: what a document shared by many "
        "questions gets.",
    ]
    for title, name in MODELS:
        parts += model_part(title, data.load(name))
    parts += documents_part(data)
    return "\n\n".join(parts)


def documents_part(data: DataDir) -> list[str]:
    """`kvserve bench documents`: time to first token of a document's questions, recomputed, read from the prefix
    cache in full, and resumed from the compressed document, against vanilla vLLM recomputing them."""
    from kvserve.tools.bench.documents import report

    parts = []
    for title, name in DOCUMENTS:
        if not (data.folder / name).exists():
            continue
        source = data.load(name)
        args = source.data["args"]
        parts += [
            f"### Compress once, ask many: {title}",
            f"A {args['doc_tokens']}-token document, {args['questions']} questions, each the document and a short "
            "question of its own; TTFT is a one-token completion's latency. The compression (the document, the "
            "repeat instruction and the document again through the model, then the compaction) is paid once per "
            "document; the last column says after how many questions it has paid for itself against recomputing.",
            report(source.data["results"]),
            source.caption(),
        ]
    return parts
