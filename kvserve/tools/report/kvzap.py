"""Does KVzap keep KVzip's quality without KVzip's second pass, and what does it cost? Its trained surrogates' fit,
kvzap beside kvzip on the RULER-4k scoreboard's cases (question outside, the same ratios), and the time to compress
a document and to decode, each against the plain path in the same run."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from kvserve.tools.eval import ruler4k
from kvserve.tools.eval.scoreboard import cell, paired_difference, parse_setting, scored
from kvserve.tools.markdown import table
from kvserve.tools.report.costs import overhead_table
from kvserve.tools.report.sources import DataDir, captions

SURROGATES = ("kvzap/smollm2-linear.json", "kvzap/qwen05-linear.json")
SCOREBOARD = "ruler4k/qwen05.jsonl"
OTHER_SCOREBOARDS = (("SmolLM2-135M-Instruct", "ruler4k/smollm2.jsonl"),)  # kvzap against kvzip only, folded
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
    """Per side, ratio and kvzap's allocation (question outside): kvzip's and kvzap's scores, and kvzap minus kvzip
    on the cases both answered (kvzip at its own allocation: global on both sides)."""
    zips: dict[tuple[str, float], list[dict]] = {}
    zaps: dict[tuple[str, float, str], list[dict]] = {}
    for row in scored(rows):
        if row["label"] == "full":
            continue
        setting = parse_setting(row["label"])
        if setting.question != "outside":
            continue
        if setting.policy == "kvzip":
            zips.setdefault((row["side"], setting.ratio), []).append(row)
        elif setting.policy == "kvzap":
            zaps.setdefault((row["side"], setting.ratio, setting.allocation), []).append(row)
    body = []
    for (side, ratio, allocation), zap in sorted(zaps.items()):
        zip_ = zips.get((side, ratio), [])
        body.append([side, f"{ratio:g}", allocation, cell(zip_), cell(zap), paired_difference(zip_, zap)])
    return table(["side", "ratio", "kvzap's allocation", "kvzip", "kvzap", "kvzap - kvzip (same cases)"], body)


def share_scoring(points: list[tuple[float, float]], score: float) -> float | None:
    """The kept share at which the (share, score) points, joined by straight lines, reach `score` (None: nowhere
    between two rising points)."""
    for (a, score_a), (b, score_b) in pairwise(points):
        if score_a <= score <= score_b and score_b > score_a:
            return a + (b - a) * (score - score_a) / (score_b - score_a)
    return None


def threshold_table(rows: list[dict]) -> str:
    """kvserve's kvzap with the question inside: each fixed budget and each threshold, the entries a list keeps on
    average and the score; for a threshold, the share of the prompt a fixed budget would keep for the same score
    (linear between the fixed budgets' points, `full` keeping all), and its own kept share over that one."""
    fixed: dict[float, list[dict]] = {}
    thresholds: dict[float, list[dict]] = {}
    full = [row for row in scored(rows) if row["side"] == "kvserve" and row["label"] == "full"]
    for row in scored(rows):
        if row["side"] != "kvserve" or row["label"] == "full":
            continue
        setting = parse_setting(row["label"])
        if setting.policy == "kvzap" and setting.question == "inside":
            group = thresholds if setting.threshold is not None else fixed
            group.setdefault(setting.threshold if setting.threshold is not None else setting.ratio, []).append(row)
    if not thresholds:
        return ""
    # a prompt's tail after the compressed part (the reply's start) is kept too: known from a fixed budget's row
    tails = {tuple(r["key"]): r["kv_tokens_evicted"] + r["budget"] - r["context_tokens"] for g in fixed.values()
             for r in g}  # fmt: skip
    points = [(1 - ratio, ruler4k.mean_over_tasks(group)[0]) for ratio, group in fixed.items()]
    keys = {tuple(r["key"]) for group in thresholds.values() for r in group}
    if full:
        points.append((1.0, ruler4k.mean_over_tasks([r for r in full if tuple(r["key"]) in keys])[0]))
    points.sort()
    body = [[f"B = {1 - ratio:.0%} of the prompt", "", f"{1 - ratio:.0%}", cell(group), "", ""]
            for ratio, group in sorted(fixed.items(), reverse=True)]  # fmt: skip
    for threshold, group in sorted(thresholds.items()):
        known = [r for r in group if tuple(r["key"]) in tails]
        kept = [r["context_tokens"] + tails[tuple(r["key"])] - r["kv_tokens_evicted"] for r in known]
        share = sum(k / r["context_tokens"] for k, r in zip(kept, known, strict=True)) / max(len(known), 1)
        score = ruler4k.mean_over_tasks(group)[0]
        same = share_scoring(points, score)
        body.append(
            [
                f"kv_threshold {threshold:g}",
                f"{sum(kept) / max(len(kept), 1):.0f}",
                f"{share:.0%}",
                cell(group),
                "-" if same is None else f"{same:.0%}",
                "-" if same is None else f"{share / same:.2f}",
            ]
        )
    headers = ["kvzap, question inside", "entries kept per list", "share of the prompt kept", "score",
               "fixed B for that score", "kept / that B"]  # fmt: skip
    return table(headers, body)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [
        "## KVzap: KVzip's choice without the second pass",
        "`kvzap` predicts each entry's KVzip+ score from its token's queries as the entry is written (a linear "
        "surrogate per layer, `kvserve calibrate MODEL --kvzap`); KVzip scores by a second pass over the document.",
    ]
    fits = [data.load(name) for name in SURROGATES if (data.folder / name).exists()]
    if fits:  # (R^2 of the log score and Spearman's rank correlation on held-out windows, means over layers)
        parts += ["<details><summary>the surrogates' held-out fit</summary>", fit_table(fits), captions(fits),
                  "</details>"]  # fmt: skip
    if (data.folder / SCOREBOARD).exists():
        board = data.load(SCOREBOARD)
        if any(row["label"].startswith("kvzap") for row in board.data):
            parts += [
                "RULER-4k, Qwen2.5-Coder-0.5B-Instruct, question outside; kvpress: `KVzapPress` with the same "
                "surrogate, `KVzipPress`:",
                against_kvzip(board.data),
            ]
            thresholds = threshold_table(board.data)
            if thresholds:
                parts += [
                    "`kv_threshold` instead of a budget (question inside), against kvzap's fixed budgets on the same "
                    "cases:",
                    thresholds,
                ]
            parts.append(f"Data: `{board.name}`; the runs: [the scoreboard](#on-kvpresss-leaderboard-ruler-at-4k).")
    for title, name in OTHER_SCOREBOARDS:
        if (data.folder / name).exists():
            other = data.load(name)
            parts.append(
                f"<details><summary>the same on {title}</summary>\n\n{against_kvzip(other.data)}\n\n"
                f"{other.caption()}\n\n</details>"
            )
    costs = []
    if (data.folder / DOCUMENTS).exists():
        from kvserve.tools.bench.documents import report

        documents = data.load(DOCUMENTS)
        args = documents.data["args"]
        # vanilla's recompute (the plain prefill) and each compression; the prefix-hit rows are on "Compress once"
        rows = [r for r in documents.data["results"] if r["mode"].startswith("compressed") or r["server"] == "vanilla"
                and r["mode"] == "recompute"]  # fmt: skip
        parts += [
            f"Compressing a {args['doc_tokens']}-token document once (B={args['budget']}, Qwen2.5-Coder-0.5B-"
            "Instruct) against vanilla vLLM's prefill of it:",
            report(rows),
        ]
        costs.append(documents)
    if (data.folder / OVERHEAD).exists():
        overhead = data.load(OVERHEAD)
        step = next(r for r in overhead.data["results"] if r["server"] == "kvserve" and r["policy"] != "full")
        full = next(r for r in overhead.data["results"] if r["server"] == "kvserve" and r["policy"] == "full")
        slower = step["tpot_p50"] / full["tpot_p50"]
        parts += [
            f"Decoding, every new entry scored and nothing evicted: a step takes {slower:.2f}x kvserve `full`'s.",
            "<details><summary>decoding against vanilla vLLM and kvserve full</summary>\n\n"
            + overhead_table(overhead)
            + "\n\n</details>",
        ]
        costs.append(overhead)
    if costs:
        parts.append(captions(costs))
    return "\n\n".join(parts)
