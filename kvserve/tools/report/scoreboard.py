"""kvpress's leaderboard protocol, RULER at 4k (`kvserve eval scoreboard`): score against compression ratio, kvserve
beside kvpress on the same cases, per model; the figure, the table and each task's scores."""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.tools.eval import ruler4k
from kvserve.tools.eval.scoreboard import (
    board_table,
    by_setting,
    difference_text,
    full_on_same_cases,
    parse_setting,
    scored,
    share,
)
from kvserve.tools.markdown import table
from kvserve.tools.report.plots import pyplot, save
from kvserve.tools.report.sources import DataDir

TITLE = "## On kvpress's leaderboard: RULER at 4k"
# (title, result file, figure); the goals and the leaderboard line are stated on the first
MODELS = (
    ("Qwen2.5-Coder-0.5B-Instruct", "ruler4k/qwen05.jsonl", "ruler4k-qwen05.png"),
    ("Qwen2.5-Coder-1.5B-Instruct", "ruler4k/qwen15.jsonl", "ruler4k-qwen15.png"),
)
INTRO = (
    "kvpress's leaderboard protocol (RULER at 4,096 tokens, RULER's string match, mean over tasks): `kvserve eval "
    "scoreboard` gives kvpress 0.5.5 and a kvserve server the same tokens, from lm-evaluation-harness's generators "
    f"({len(ruler4k.TASKS)} tasks; Python's documentation as the essay haystack; {' and '.join(ruler4k.MISSING)} "
    "need the hub). `outside`: the context compressed before the question (kvserve: `kv_document`, KVzip by its "
    "reconstruction); `inside`: with it; `default`: kvserve's serving default; `:knob=value`: tuned. Ratio r "
    "keeps (1 - r) x the context's entries per (layer, KV head) on both sides. Scores x100 [95% interval] (n "
    "answers). DuoAttention `outside`: kvserve publishes a compressed context as whole blocks, so each head's count "
    "is rounded to whole pages (a streaming head's sinks and newest entries rounded up, the retrieval heads sharing "
    "the rest); kvpress keeps them exact. kvserve's side asks a "
    "server started as `kvserve serve MODEL --block-size 32 --max-model-len 12288 --kv-profile none`; on 2 cores, "
    "`VLLM_CPU_OMP_THREADS_BIND=0-1` before it gives the model both (vLLM keeps one for HTTP otherwise)."
)


def curves(rows: list[dict]) -> dict[tuple[str, str], list[tuple[float, float, float, float]]]:
    """(side, method) -> [(ratio, mean, low, high)] over the ratios that side has rows for, full excluded."""
    by: dict[tuple[str, str, float], list[dict]] = {}
    for row in scored(rows):
        if row["label"] == "full":
            continue
        setting = parse_setting(row["label"])
        if setting.threshold is not None:  # no ratio of its own: in the table and KVzap's section, not the figure
            continue
        method = row["label"].split("@")[0] + "/" + setting.question
        method += f"/{setting.allocation}" if row["side"] == "kvserve" and setting.allocation != "uniform" else ""
        method += f"/span{setting.span}" if setting.span is not None else ""
        by.setdefault((row["side"], method, setting.ratio), []).append(row)
    out: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for (side, method, ratio), group in sorted(by.items()):
        mean, low, high, _ = ruler4k.mean_over_tasks(group)
        out.setdefault((side, method), []).append((ratio, 100 * mean, 100 * low, 100 * high))
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Score against compression ratio: one colour per method (kvserve's allocation variant shares its policy's),
    kvserve solid, kvpress dashed, 95% bands; `full` as horizontal lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    lines = curves(rows)
    methods = sorted({method.split("/global")[0] for _, method in lines})
    colours = {method: plt.get_cmap("tab10")(index % 10) for index, method in enumerate(methods)}
    for (side, method), points in sorted(lines.items()):
        ratios, means, lows, highs = zip(*points, strict=True)
        colour = colours[method.split("/global")[0]]
        style = "-" if side == "kvserve" else "--"
        ax.plot(ratios, means, style, marker="o", color=colour, label=f"{side} {method}")
        ax.fill_between(ratios, lows, highs, color=colour, alpha=0.12)
        if len(ratios) == 1:  # a band needs two ratios: one ratio's interval is a bar, kvpress's left of kvserve's
            x = ratios[0] + (0.008 if side == "kvserve" else -0.008)
            bar = [[means[0] - lows[0]], [highs[0] - means[0]]]
            ax.errorbar([x], means, yerr=bar, fmt="none", color=colour, capsize=3, alpha=0.6, linestyle=style)
    full_rows = [row for row in scored(rows) if row["label"] == "full"]
    full = {side: [row for row in full_rows if row["side"] == side] for side in ("kvserve", "kvpress")}
    for side, group in full.items():
        if group:
            mean = 100 * ruler4k.mean_over_tasks(group)[0]
            ax.axhline(
                mean,
                color="black",
                linestyle="-" if side == "kvserve" else "--",
                linewidth=1,
                label=f"{side} full ({mean:.1f})",
            )
    ax.set_xlabel("compression ratio (share of the context's entries evicted)")
    ax.set_ylabel("RULER-4k score (mean over tasks)")
    ax.set_title(title)
    ax.set_ylim(0, 100)
    # the leaderboard's ratios (0.25 to 0.875) and any other run, however few a model has run so far
    ticks = sorted({*ruler4k.RATIOS, *(ratio for points in lines.values() for ratio, *_ in points)})
    ax.set_xlim(ticks[0] - 0.05, ticks[-1] + 0.05)
    ax.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    save(fig, path)


def task_table(rows: list[dict]) -> str:
    """Each setting's mean per task (x100, n answers), both sides."""
    rows = scored(rows)
    tasks = [task for task in ruler4k.TASKS if any(row["task"] == task for row in rows)]
    by: dict[tuple[str, str], dict[str, list[float]]] = {}
    for row in rows:
        by.setdefault((row["side"], row["label"]), {}).setdefault(row["task"], []).append(row["score"])
    body = []
    for side, label in sorted(by, key=lambda key: (key[1] != "full", key[1], key[0])):
        scores = by[(side, label)]
        body.append(
            [side, label]
            + [
                f"{100 * sum(scores[task]) / len(scores[task]):.0f} ({len(scores[task])})" if task in scores else ""
                for task in tasks
            ]
        )
    return table(["side", "setting", *tasks], body)


def compared(rows: list[dict]) -> list[dict]:
    """The rows of `full` and of every fixed ratio, kvserve's own settings included where kvpress has no row for their
    press yet (an empty kvpress cell says so). A threshold is placed elsewhere: KVzap's section sets its thresholds
    against its fixed budgets."""
    return [row for row in rows if row["label"] == "full" or parse_setting(row["label"]).threshold is None]


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [TITLE, INTRO]
    for title, name, png in MODELS:
        source = data.load(name)
        plot(source.data, plots / png, f"{title}: RULER-4k, kvserve (solid) and kvpress 0.5.5 (dashed)")
        parts += [
            f"### {title}",
            f"![RULER-4k score against compression ratio, {title}]({plot_link}/{png})",
            board_table(compared(source.data)),
            *(
                [leaderboard_line(data.load(LEADERBOARD).data, source.data, title), goal_table(source.data)]
                if name == MODELS[0][1]
                else []
            ),
            "<details><summary>per task (score x100, answers)</summary>\n\n"
            + task_table(source.data)
            + "\n\n</details>",
            source.caption(),
        ]
    return "\n\n".join(parts)


# the goals on the first model (question, ratio, share of full to reach, kvserve's settings that may reach it)
GOALS = (("outside", 0.75, 0.95, "best"), ("outside", 0.875, 0.90, "best"), ("inside", 0.75, 0.95, "default"))
GOAL_ANSWERS = 110  # a setting decides a goal with at least this many answers (10 a task)


def goal_table(rows: list[dict]) -> str:
    """Each goal: kvserve's best setting for it (of those with GOAL_ANSWERS answers), its share of full on the same
    cases with a 95% interval, met when the whole interval reaches the goal, not met when none of it does; then every
    kvserve setting that trails its kvpress press beyond the paired interval."""
    by = by_setting(rows)
    full = by.get(("kvserve", "full"), [])
    body = []
    for question, ratio, wanted, which in GOALS:
        candidates = []
        for side, label in by:
            if side != "kvserve" or label == "full" or len(by[(side, label)]) < GOAL_ANSWERS:
                continue
            setting = parse_setting(label)
            if setting.threshold is None and setting.question == question and setting.ratio == ratio:
                if which == "best" or setting.policy == which:
                    candidates.append((ruler4k.mean_over_tasks(by[(side, label)])[0], label))
        goal = f"question {question}, {ratio:g}: {'best' if which == 'best' else which} >= {wanted:.0%} of full"
        if not candidates or not full:
            body.append([goal, f"no setting with {GOAL_ANSWERS} answers", "", "not decided"])
            continue
        _, label = max(candidates)
        got, low, high, n = share_of_full(by[("kvserve", label)], full)
        verdict = "met" if low >= wanted else "not met" if high < wanted else "not decided: the interval spans it"
        body.append([goal, f"`{label}` (n={n})", f"{got:.0%} [{low:.0%}, {high:.0%}]", verdict])
    trailing = []
    compared = 0
    for side, label in by:
        reference = parse_setting(label).reference if side == "kvserve" and label != "full" else None
        if reference and ("kvpress", reference) in by:
            compared += 1
            difference = ruler4k.paired_difference(by[(side, label)], by[("kvpress", reference)])
            if difference[3] and difference[2] < 0:
                trailing.append(f"`{label}` {difference_text(*difference)}")
    gaps = ", ".join(sorted(trailing)) or "none"
    return (
        table(["goal", "kvserve's setting", "share of full [95% interval]", ""], body)
        + f"\n\nkvserve settings below their kvpress press beyond the paired 95% interval, of {compared} compared: "
        + gaps
        + "."
    )


def share_of_full(rows: list[dict], full: list[dict]) -> tuple[float, float, float, int]:
    """A setting's score as a share of full's on the cases both answered, with the paired difference's 95% interval
    (`ruler4k.paired_difference`) carried over: (share, low, high, cases)."""
    difference, low, high, n = ruler4k.paired_difference(rows, full)
    base = full_on_same_cases(rows, full)
    return 1 + difference / base, 1 + low / base, 1 + high / base, n


LEADERBOARD = "ruler4k/kvpress-leaderboard.json"  # kvpress's published KVzip row, not run here
LEADERBOARD_SETTING = "kvzip@0.75/outside/global"  # kvserve's nearest: KVzip before the question, at 4x


def leaderboard_line(board: dict, rows: list[dict], model: str) -> str:
    """kvpress's own leaderboard's KVzip (an 8B model on GPUs) beside KVzip here, each as a share of its full."""
    theirs = board["kvzip"]
    setting = parse_setting(LEADERBOARD_SETTING)
    rows, shares = scored(rows), []
    for side, named, label in (("kvserve", "kvserve", LEADERBOARD_SETTING),
                               ("kvpress", "kvpress 0.5.5", setting.reference)):  # fmt: skip
        group = [row for row in rows if row["side"] == side and row["label"] == label]
        full = [row for row in rows if row["side"] == side and row["label"] == "full"]
        if group and full:
            mean = 100 * ruler4k.mean_over_tasks(group)[0]
            shares.append(f"{share(group, full)} on {named} ({mean:.1f}, n={len(group)})")
    return (
        f"kvpress's own leaderboard (`docs/eval/{LEADERBOARD}`, not run here): KVzip at {theirs['ratio']} keeps "
        f"{theirs['score'] / theirs['full']:.0%} of full on {theirs['model']} ({theirs['score']} of {theirs['full']}). "
        f"{model}, question outside, {setting.ratio}: {', '.join(shares) or 'not run yet'}."
    )


# the README's cells: full, the best compression before the question and the serving default, at 4x
README_SETTINGS = ("full", "kvzip@0.75/outside/global", "default@0.75/inside")


def readme_table(models: list[tuple[str, list[dict]]]) -> str:
    """The README's RULER-4k table: per setting, kvpress's and kvserve's score (x100, answers) on each model."""
    header, columns = ["setting"], []
    for title, rows in models:
        size = re.search(r"\d+(?:\.\d+)?B", title)
        short = size.group(0) if size else title
        header += [f"{short} kvpress", f"{short} kvserve"]
        columns.append(by_setting(rows))
    body = []
    for label in README_SETTINGS:
        setting = parse_setting(label)
        cells = []
        for by in columns:
            for side, wanted in (("kvpress", setting.reference), ("kvserve", label)):
                group = by.get((side, wanted), [])
                mean, _, _, n = ruler4k.mean_over_tasks(group)
                cells.append(f"{100 * mean:.1f} (n={n})" if group else ("-" if wanted is None else "pending"))
        body.append([f"`{label}`", *cells])
    return table(header, body)


def readme_part(data: DataDir, plot_link: str) -> str:
    """The README's RULER-4k lines: the first model's figure (the benchmarks page draws it), and every model's rows."""
    title, _, png = MODELS[0]
    return "\n\n".join(
        [
            f"**RULER-4k**, kvserve beside kvpress 0.5.5 (its protocol; figure: {title}):",
            f"![RULER-4k score against compression ratio]({plot_link}/{png})",
            readme_table([(model, data.load(name).data) for model, name, _ in MODELS]),
        ]
    )
