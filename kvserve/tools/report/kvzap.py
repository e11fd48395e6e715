"""Does KVzap keep KVzip's quality without KVzip's second pass, and what does it cost? Its trained surrogates' fit,
kvzap beside kvzip on the RULER-4k scoreboard's cases (question outside, the same ratios), and the time to compress
a document and to decode, each against the plain path in the same run."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.eval import ruler4k
from kvserve.tools.eval.scoreboard import cell, parse_setting, scored
from kvserve.tools.markdown import table
from kvserve.tools.report.costs import overhead_table
from kvserve.tools.report.sources import DataDir, captions

SURROGATES = ("kvzap/smollm2-linear.json", "kvzap/qwen05-linear.json")
SCOREBOARD = "ruler4k/qwen05.jsonl"
DOCUMENTS = "kvzap/documents-qwen05.json"
OVERHEAD = "kvzap/overhead-qwen05.json"


def fit_table(sources: list) -> str:
    rows = []
    for source in sources:
        record = source.data
        fits = record["fit"]
        rows.append(
            [
                record["model"],
                record["kind"],
                f"{record['texts']} x {record['tokens'] // record['texts']}",
                f"{sum(f['r2'] for f in fits) / len(fits):.2f}",
                f"{min(f['r2'] for f in fits):.2f}",
                f"{sum(f['spearman'] for f in fits) / len(fits):.2f}",
                f"{record['seconds']:.0f}",
            ]
        )
    headers = ["model", "surrogate", "windows x tokens", "held-out R^2 (mean)", "worst layer", "Spearman", "training s"]
    return table(headers, rows)


def against_kvzip(rows: list[dict]) -> str:
    """Per side and ratio (question outside): kvzip's and kvzap's scores, and kvzap minus kvzip on the cases both
    answered."""
    by: dict[tuple[str, str, float], list[dict]] = {}
    for row in scored(rows):
        if row["label"] == "full":
            continue
        setting = parse_setting(row["label"])
        if setting.policy in ("kvzip", "kvzap") and setting.question == "outside":
            by.setdefault((row["side"], setting.policy, setting.ratio), []).append(row)
    body = []
    for side, ratio in sorted({(side, ratio) for side, policy, ratio in by if policy == "kvzap"}):
        zap, zip_ = by.get((side, "kvzap", ratio), []), by.get((side, "kvzip", ratio), [])
        keys = {tuple(r["key"]) for r in zap} & {tuple(r["key"]) for r in zip_}
        difference = ""
        if keys:
            ours = ruler4k.mean_over_tasks([r for r in zap if tuple(r["key"]) in keys])[0]
            theirs = ruler4k.mean_over_tasks([r for r in zip_ if tuple(r["key"]) in keys])[0]
            difference = f"{100 * (ours - theirs):+.1f} (n={len(keys)})"
        body.append([side, f"{ratio:g}", cell(zip_), cell(zap), difference])
    return table(["side", "ratio", "kvzip", "kvzap", "kvzap - kvzip (same cases)"], body)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [
        "## KVzap: KVzip's choice without the second pass",
        "`kvzap` predicts each entry's KVzip+ score from its token's queries as the entry is written, with a linear "
        "surrogate per layer trained on the prose corpus (`kvserve calibrate MODEL --kvzap`); KVzip scores by a second "
        "pass over the document. Surrogates, held out on other windows of the corpus (R^2 of the log score, "
        "Spearman's rank correlation, means over layers):",
    ]
    fits = [data.load(name) for name in SURROGATES if (data.folder / name).exists()]
    if fits:
        parts += [fit_table(fits), captions(fits)]
    if (data.folder / SCOREBOARD).exists():
        board = data.load(SCOREBOARD)
        if any(row["label"].startswith("kvzap") for row in board.data):
            parts += [
                "RULER-4k (the scoreboard's cases, Qwen2.5-Coder-0.5B-Instruct), the context compressed before the "
                "question; kvpress's side is its `KVzapPress` given the same surrogate, and its `KVzipPress`:",
                against_kvzip(board.data),
                f"Data: `{board.name}`; the runs: [the scoreboard](#on-kvpresss-leaderboard-ruler-at-4k).",
            ]
    costs = []
    if (data.folder / DOCUMENTS).exists():
        from kvserve.tools.bench.documents import report

        documents = data.load(DOCUMENTS)
        args = documents.data["args"]
        parts += [
            f"Cost of compressing a {args['doc_tokens']}-token document once (B={args['budget']}, Qwen2.5-Coder-0.5B-"
            "Instruct), and each question's TTFT after it, against vanilla vLLM recomputing the document:",
            report(documents.data["results"]),
        ]
        costs.append(documents)
    if (data.folder / OVERHEAD).exists():
        overhead = data.load(OVERHEAD)
        parts += [
            "Decoding with the surrogate scoring every new entry and nothing evicted (B above every sequence), "
            "against kvserve `full` and vanilla vLLM:",
            overhead_table(overhead),
        ]
        costs.append(overhead)
    if costs:
        parts.append(captions(costs))
    return "\n\n".join(parts)
