"""The hard half of retrieval: RULER's multi-key lookup (`multikey_one`: four keys' needles, one asked, the prompt
ending in the asked needle's own words) on both models, by prompt length, with the query-agnostic rows (`kv_checkpoint`:
compaction before the question is seen; `kvzip`: the document compressed once by its reconstruction) beside the
query-aware ones, and what a compressed document saves its questions (`kvserve bench documents`)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from kvserve.tools.eval.suite import Suite, length_group
from kvserve.tools.eval.tasks import score
from kvserve.tools.markdown import table
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


MISSES = ("right", "the value's first digits, then others", "another number", "no number")
# how many of the asked value's leading digits an answer must repeat to count as that value cut short
VALUE_PREFIX = 3


def miss_kind(answer: str, reference: str) -> str:
    """What an answer to one key's 7-digit value is: right, the value begun but altered or cut short (its entries
    partly evicted: a question attends to the key and the value's start, not to its last digits), another number
    (another key's value or an invented one), or none."""
    if score(answer, (reference,)) == 1.0:
        return MISSES[0]
    numbers = re.findall(r"\d+", answer)
    if not numbers:
        return MISSES[3]
    return MISSES[1] if numbers[0][:VALUE_PREFIX] == reference[:VALUE_PREFIX] else MISSES[2]


def misses_table(rows: list[dict], thousands: int) -> str:
    """Every setting's answers at one prompt length by `miss_kind`, `full` first."""
    kinds: dict[tuple[str, int | None], Counter] = {}
    for row in rows:
        if length_group(row["length"]) == thousands:
            setting = (row["policy"], row["budget"])
            kinds.setdefault(setting, Counter())[miss_kind(row["answer"], row["references"][0])] += 1
    order = sorted(kinds, key=lambda s: (s[0] != "full", -kinds[s][MISSES[0]], s[0], s[1] or 0))
    lines = [
        [f"`{label}`" + (f" B={budget}" if budget else ""), *(str(kinds[(label, budget)][kind]) for kind in MISSES)]
        for label, budget in order
    ]
    return table(["setting", *MISSES], lines)


def model_part(title: str, source: Source) -> list[str]:
    suite = Suite.from_rows(source.data)
    answers = sorted({n for _, n in suite.full.values()})
    longest = max(length_group(row["length"]) for row in source.data)
    return [
        f"### {title}",
        f"{' or '.join(map(str, answers))} cases a length; each setting's share of full [95% interval] (its mean):",
        by_length_table(suite, overall=True),
        f"What the answers at {longest}k tokens are (counts): the asked value; its first {VALUE_PREFIX} digits "
        "and then others or none (the value's later entries evicted); another number; no number:",
        misses_table(source.data, longest),
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
        "ends in its own, `full` answers it on both models, and it is one of the judged tasks of the tables above "
        "(both models' suites and the summary). The tables below are that task alone, by prompt length, with the "
        "query-agnostic settings beside the query-aware ones. Rows with `kv_checkpoint=512` compact every 512 tokens, "
        "before the question is seen. `kvzip` rows compress each case's document once, without its question "
        "(`POST /v1/kvserve/compress`: KVzip scores every entry by the attention it gets while the model repeats "
        "the document), and the question resumes from the compressed lists: what a document shared by many "
        "questions gets.",
        "Under each table, what the answers at the longest prompts are. With the question in sight, most misses "
        "start the asked value right and then go wrong: the question attends to the key and the value's first "
        "digits, and a value tokenized digit by digit ends 8 entries past the key, beyond the paper's pool of 7 "
        "(`snapkv:kernel_size=7/span8`). Pooling the votes over 15 entries (`snapkv/span8`: SnapKV's own default "
        "since, however it is named) keeps the rest of the value. Compaction without the question (`kv_checkpoint`, "
        "`kvzip`) misses "
        "differently: another number, the needles themselves lost.",
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
