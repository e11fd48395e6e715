"""Does it carry to another model? The quality suite on Qwen2.5-Coder-0.5B-Instruct beside the default model's, what
`kvserve calibrate` recommends for it and how long that took, and the serving benchmarks on it."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.__main__ import plot as capacity_plot
from kvserve.tools.bench.chat import plot as chat_plot
from kvserve.tools.eval.client import label_of
from kvserve.tools.eval.suite import Cell, Suite, length_group
from kvserve.tools.markdown import table
from kvserve.tools.report.costs import overhead_table
from kvserve.tools.report.quality import (
    DEFAULT_POLICY,
    FLOOR,
    best_labels,
    load_suite,
    share_cell,
    share_table,
    variants_table,
)
from kvserve.tools.report.sources import DataDir, captions
from kvserve.tools.report.throughput import capacity_table, chat_table, chat_workload, workload

QWEN = ("qwen05/tasks.jsonl", "qwen05/multikey.jsonl")
CALIBRATION = "qwen05/calibrate.json"
# duo/measured-vs-trained.json (the head roles kvserve calibrate measures against DuoAttention's trained ones, on the
# default model) is not shown: it validates the method rather than deciding a setting; docs/tools.md runs it
CAPACITY = "qwen05/capacity-decode-heavy.json"
OVERHEAD = "qwen05/overhead.json"
CHAT = "qwen05/chat.json"
TITLE = "## A second model: Qwen2.5-Coder-0.5B-Instruct"


def at_length(cells: list[Cell], thousands: int) -> list[Cell]:
    return [cell for cell in cells if cell[1] == thousands]


def revised_text(check: dict) -> str:
    """The revised estimate, where the run recorded one (printed once its server had answered the full cache)."""
    revised = check.get("revised_estimated_seconds")
    return "" if revised is None else f", {revised / 60:.0f} min after the full cache's answers"


def calibration_part(data: DataDir, suite: Suite, cells: list[Cell]) -> list[str]:
    source = data.load(CALIBRATION)
    record = source.data
    check = record["check"]
    plan = check["plan"]
    lines = [
        f"`kvserve calibrate qwen2.5-coder-0.5b` took {check['seconds'] / 60:.1f} min on 2 cores (estimated "
        f"{check['estimated_seconds'] / 60:.0f} min at the start{revised_text(check)}): head roles from "
        f"{check['roles_samples']} retrieval samples, then {len(plan['tasks'])} tasks ({', '.join(plan['tasks'])}) "
        f"at {'/'.join(map(str, plan['lengths']))} tokens, {plan['samples']} cases each, {len(plan['policies'])} "
        f"policies at B = {'/'.join(map(str, plan['budgets']))} (`full`: {check['full_answers']} of "
        f"{check['cases']} cases). Its recommendation against the suite above (4k tokens):",
    ]
    rows = []
    for target, setting in check["recommended"].items():
        if setting is None:
            rows.append([f"{float(target):.0%}", "none", "-", "-"])
            continue
        label = label_of(setting)
        on_suite = (
            share_cell(suite, label, setting["kv_budget"], cells)
            if suite.ratio((label, setting["kv_budget"]), cells) is not None
            else "not run"
        )
        best = max(
            ((lb, r) for lb in suite.labels() if (r := suite.ratio((lb, setting["kv_budget"]), cells)) is not None),
            key=lambda item: item[1],
            default=None,
        )
        best_text = f"`{best[0]}` {best[1]:.0%}" if best else "-"
        rows.append(
            [
                f"{float(target):.0%}",
                f"`{label}` B={setting['kv_budget']}: {setting['share']:.0%} [{setting['interval'][0]:.0%}-"
                f"{setting['interval'][1]:.0%}] of the check's cases",
                on_suite,
                best_text,
            ]
        )
    lines.append(
        table(
            ["target share of full", "recommended (on the check)", "on the suite, 4k", "best on the suite at that B"],
            rows,
        )
    )
    lines.append(source.caption())
    return lines


def serving_part(data: DataDir, plots: Path, plot_link: str) -> list[str]:
    """The default model's serving benchmarks on the second model: each against vanilla vLLM in its own run."""
    capacity, overhead, chat = (data.load(name) for name in (CAPACITY, OVERHEAD, CHAT))
    capacity_plot(capacity.data["results"], capacity.data["args"]["prompt_tokens"], str(plots / "qwen05-capacity.png"))
    chat_plot(chat.data["results"], str(plots / "qwen05-chat.png"))
    chat_args = chat.data["args"]
    return [
        "### Throughput and cost on it",
        f"![throughput and concurrency against compression, Qwen2.5-Coder-0.5B]({plot_link}/qwen05-capacity.png)",
        f"![TTFT and output tokens/s by turn, Qwen2.5-Coder-0.5B]({plot_link}/qwen05-chat.png)",
        "Each against vanilla vLLM with the same engine flags. Decode-heavy at 8x: " + workload(capacity),
        capacity_table(capacity),
        "Scoring with nothing evicted: " + workload(overhead).split("; a pool")[0] + ".",
        overhead_table(overhead),
        f"Multi-turn chat: {chat_workload(chat)}, a pool of {chat_args['small_pool_blocks']} blocks of "
        f"{chat_args['block_size']} tokens ([settings](#multi-turn-chat-with-prefix-caching)):",
        chat_table(chat),
        captions([capacity, overhead, chat]),
    ]


def main_length(suite: Suite, judged: list[Cell]) -> int:
    """The prompt length (thousands) the main tables use: the one where the most settings ran, the longest of ties
    (the longest lengths ran only the leaders: a table there would hide every other policy)."""
    lengths = {k for _, k in judged}

    def settings_at(k: int) -> int:
        return sum(suite.mean(setting, at_length(judged, k)) is not None for setting in suite.cells)

    return max(lengths, key=lambda k: (settings_at(k), k))


def qwen_suite(data: DataDir):
    """The second model's suite, its judged cells at the main length (where every policy ran) and each policy's best
    setting there."""
    sources = [data.load(name) for name in QWEN]
    suite = Suite.from_rows([row for source in sources for row in source.data])
    judged = suite.judged_cells(FLOOR)
    cells = at_length(judged, main_length(suite, judged))
    return sources, suite, cells, best_labels(suite, cells)


def by_length_table(
    suite: Suite, overall: bool = False, labels: set[str] | None = None, min_budget: int | None = None
) -> str:
    """Every setting that ran at more than one prompt length (of `labels` where given, at budgets of at least
    `min_budget` where given): its share of full [95% interval] per length (the compression grows with the length:
    B=256 is 4x at 1k tokens, 16x at 4k), and with `overall` over them all."""
    judged = suite.judged_cells(FLOOR)
    by_length = {k: at_length(judged, k) for k in sorted({k for _, k in judged})}  # shortest first
    settings = [
        setting
        for setting in suite.cells
        if setting[0] != "full"
        and (labels is None or setting[0] in labels)
        and (min_budget is None or setting[1] is None or setting[1] >= min_budget)
        and sum(suite.mean(setting, cells) is not None for cells in by_length.values()) > 1
    ]
    main = by_length[main_length(suite, judged)]
    settings.sort(key=lambda setting: (-(suite.ratio(setting, main) or 0), str(setting)))
    columns = dict(by_length, **({"all": judged} if overall else {}))
    rows = [["`full` (its mean)", *(f"{suite.mean(('full', None), cells)[0]:.3f}" for cells in columns.values())]]
    for label, budget in settings:
        name = f"`{label}`" + (f" B={budget}" if budget else " (its own keep ratio)")
        rows.append([name, *(share_cell(suite, label, budget, cells, mean=False) for cells in columns.values())])
    headers = [f"{k}k tokens" for k in by_length] + (["all lengths"] if overall else [])
    return table(["setting", *headers], rows)


def own_ratio_lines(rows: list[dict], suite: Suite, cells: list[Cell]) -> list[str]:
    """Policies run without a budget (Attention-Gate keeps what its gates flag): their share of full beside the share
    of the prompt's entries they kept, which no budget column shows."""
    lines = []
    for label in sorted(label for label, budget in suite.cells if budget is None and label != "full"):
        if suite.mean((label, None), cells) is None:
            continue
        ran = [
            r
            for r in rows
            if r["policy"] == label and r["budget"] is None and (r["task"], length_group(r["length"])) in cells
        ]
        # the gates' own count: the share of (layer, KV head, prompt token) entries they kept
        kept = sum(sum(r["gate_keep_by_layer"]) / len(r["gate_keep_by_layer"]) for r in ran) / max(len(ran), 1)
        lines.append(
            f"`{label}` at its own keep ratio ({kept:.0%} of the prompt's entries kept, mean over layers and KV "
            f"heads): {share_cell(suite, label, None, cells, mean=False)} of full."
        )
    return lines


def summary_part(data: DataDir) -> list[str]:
    """The summary's table for the second model: each policy's share of full at its best setting."""
    sources, suite, cells, labels = qwen_suite(data)
    answers = suite.mean(("full", None), cells)[1]
    return [
        f"On the second model, Qwen2.5-Coder-0.5B-Instruct: the suite's {len({t for t, _ in cells})} judged tasks at "
        f"{max(k for _, k in cells)}k tokens ({answers} answers a setting; `duoattention` with the head roles "
        "`kvserve calibrate` measured for it; [details](#a-second-model-qwen25-coder-05b-instruct)):",
        share_table(suite, cells, labels),
        captions(sources),
    ]


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sources, suite, cells, labels = qwen_suite(data)
    _, default_suite, default_cells = load_suite(data)
    length = max(k for _, k in cells)
    return "\n\n".join(
        [
            TITLE,
            "The suite on Qwen2.5-Coder-0.5B-Instruct (Qwen2: 24 layers, 14 query / 2 KV heads; `kvserve "
            "setup-model qwen2.5-coder-0.5b`: the 4-bit GGUF de-quantised). Judged, where `full` scores at least "
            f"{FLOOR}: {', '.join(sorted({t for t, _ in cells}))}, at {length}k tokens (B=256 is "
            f"{round(length * 1000 / 256)}x). `duoattention` uses the head roles `kvserve calibrate` measured (no "
            "training).",
            share_table(suite, cells, labels),
            f"`{DEFAULT_POLICY}` in every setting that ran them:",
            variants_table(suite, cells, DEFAULT_POLICY, mean=False),
            *own_ratio_lines([row for source in sources for row in source.data], suite, cells),
            "By prompt length, the settings run at more than one (share of full [95% interval]):",
            by_length_table(suite),
            captions(sources),
            "### What `kvserve calibrate` recommends for it",
            *calibration_part(data, suite, cells),
            *serving_part(data, plots, plot_link),
        ]
    )
