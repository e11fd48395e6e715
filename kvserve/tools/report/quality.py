"""How much quality do I keep at 8x? The quality suite (RULER's single needle through lm-evaluation-harness, the
passkey, one pass key among several, and pass keys asked in a follow-up chat turn; 1k / 2k / 4k tokens) per policy
against the entries it keeps, with 95% intervals; the older single-needle suite, which every policy ran, on bf16 and
fp8 caches; and Attention-Gate at its own keep ratio against the baselines at equal memory per case."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvserve.config import BUILTIN_DEFAULTS
from kvserve.policies import POLICIES, POLICY_NAMES
from kvserve.tools.eval.suite import Cell, Suite, length_group
from kvserve.tools.markdown import table
from kvserve.tools.report.plots import pyplot, save
from kvserve.tools.report.sources import DataDir, Source, captions

# the last is the hard half (RULER's multi-key lookup); its by-length tables with the query-agnostic rows are in
# "The hard half" (kvserve/tools/report/multikey.py)
SUITE = ("suite/ruler.jsonl", "suite/tasks.jsonl", "suite/broad.jsonl", "suite/multikey.jsonl")
# the tasks of the first suite, which every policy ran (the broader one adds multi-needle and chat tasks)
SINGLE_NEEDLE = ("niah_single_1", "passkey")
# suite/ppl.jsonl (perplexity of two 2,048-token passages under eviction, one run without intervals) is not shown:
# the suite above decides between policies; `kvserve eval ppl` prints it and git has the page that showed it
GATE = ("gate/suite-ruler.jsonl", "gate/suite-tasks.jsonl")
# allocation/*.jsonl (2026-11-24, kvserve 0.1: allocations and spans at equal memory) is not shown: the suite's rows
# since then carry each setting's allocation and span, and each policy's table row is its best of them
# the same suite on an fp8 cache (`--kv-cache-dtype fp8`), with `full` on the unquantised cache run beside it
FP8 = ("fp8/ruler.jsonl", "fp8/tasks.jsonl")
FP8_UNQUANTISED = ("fp8/bf16-ruler.jsonl", "fp8/bf16-tasks.jsonl")
DEFAULT_POLICY = BUILTIN_DEFAULTS["kv_policy"]
# SnapKV's pool settings (`kernel_size`) run side by side on one machine on the same cases (the suite above has its
# pool-15 rows from another machine; the pool-31 rows, the default's, were copied into it from these files)
POOL_COMPARISON = ("snapkv-kernel/ruler.jsonl", "snapkv-kernel/tasks.jsonl", "snapkv-kernel/broad.jsonl",
                   "snapkv-kernel/multikey.jsonl")  # fmt: skip
FLOOR = 0.5  # a task is judged where the full cache scores at least this
CHECKPOINT = "/checkpoint"  # in a label: a kv_checkpoint setting (`kvserve.tools.eval.client.Setting.label`)


def base_policy(label: str) -> str:
    """`duoattention:retrieval_fraction=0.25/span8` -> `duoattention`."""
    return label.split("/")[0].split(":")[0]


def best_labels(suite: Suite, cells: list[Cell]) -> dict[str, str]:
    """Per policy, the setting (span, allocation, knobs) with the highest mean share of full over the budgets it ran
    at; ties go to the setting that ran at more budgets, then by name."""
    budgets = suite.budgets()
    scored: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for label in suite.labels():
        if CHECKPOINT in label:  # a serving mode with its own table (`checkpoint_table`), not a policy setting
            continue
        ratios = [r for b in budgets if (r := suite.ratio((label, b), cells)) is not None]
        if ratios:
            scored[base_policy(label)].append((sum(ratios) / len(ratios), len(ratios), label))
    return {policy: min(options, key=lambda o: (-o[0], -o[1], o[2]))[2] for policy, options in scored.items()}


def share_cell(suite: Suite, label: str, budget: int, cells: list[Cell], mean: bool = True) -> str:
    """A setting's share of `full` at `budget` over `cells` with its 95% interval and, with `mean`, its mean score:
    `92% [84-100%] (0.764)`, `-` if not run. Without the mean (`92% [84-100%]`) where the table gives `full`'s: the
    share times it is the mean."""
    found, score = suite.share_interval((label, budget), cells), suite.mean((label, budget), cells)
    if found is None or score is None:
        return "-"
    return f"{found[0]:.0%} [{found[1]:.0%}-{found[2]:.0%}]" + (f" ({score[0]:.3f})" if mean else "")


def single_needle_cells(cells: list[Cell]) -> list[Cell]:
    return [cell for cell in cells if cell[0] in SINGLE_NEEDLE]


def budgets_run(suite: Suite, cells: list[Cell], labels: list[str]) -> list[int]:
    """The budgets at which at least one of `labels` answered every cell (the columns worth showing)."""
    return [b for b in suite.budgets() if any(suite.ratio((label, b), cells) is not None for label in labels)]


def share_table(suite: Suite, cells: list[Cell], labels: dict[str, str], mean: bool = True) -> str:
    budgets = budgets_run(suite, cells, list(labels.values()))
    full_mean, full_n = suite.mean(("full", None), cells)
    lines = [
        "| policy | best setting | " + " | ".join(f"B={b}" for b in budgets) + " |",
        "| --- | --- |" + " --- |" * len(budgets),
        "| `full` | | " + " | ".join([f"100% ({full_mean:.3f})"] * len(budgets)) + " |",
    ]
    top = {
        b: max((r for lb in labels.values() if (r := suite.ratio((lb, b), cells)) is not None), default=None)
        for b in budgets
    }
    order = sorted(labels, key=lambda p: -sum(suite.ratio((labels[p], b), cells) or 0 for b in budgets))
    for policy in order:
        label = labels[policy]
        row = []
        for b in budgets:
            ratio, text = suite.ratio((label, b), cells), share_cell(suite, label, b, cells, mean)
            row.append(f"**{text}**" if ratio is not None and ratio == top[b] else text)
        setting = label.removeprefix(policy).lstrip("/:") or "uniform, span 1"
        lines.append(f"| `{policy}` | {setting} | " + " | ".join(row) + " |")
    text = "\n".join(lines) + f"\n\n`full` answers {full_mean:.3f} of the judged cells (n = {full_n} answers)."
    return text


def variants_table(suite: Suite, cells: list[Cell], policy: str, mean: bool = True) -> str:
    """Every setting of `policy` that answered the judged cells at some budget (its knobs, spans, allocations), the
    best first: how the shown best setting compares with the policy's others."""
    labels = [label for label in suite.labels() if base_policy(label) == policy and CHECKPOINT not in label]
    budgets = budgets_run(suite, cells, labels)
    shown = [label for label in labels if any(suite.ratio((label, b), cells) is not None for b in budgets)]
    shown.sort(key=lambda lb: -sum(suite.ratio((lb, b), cells) or 0 for b in budgets))
    rows = [[f"`{label}`", *(share_cell(suite, label, b, cells, mean) for b in budgets)] for label in shown]
    return table(["setting", *(f"B={b}" for b in budgets)], rows)


def checkpoint_table(suite: Suite, cells: list[Cell]) -> str:
    """Each `kv_checkpoint` setting that ran, beside the same setting without checkpoints."""
    budgets = budgets_run(suite, cells, [label for label in suite.labels() if CHECKPOINT in label])
    lines = [
        "| setting | " + " | ".join(f"B={b}" for b in budgets) + " |",
        "| --- |" + " --- |" * len(budgets),
    ]
    for label in sorted(lb for lb in suite.labels() if CHECKPOINT in lb):
        base, _, every = label.partition(CHECKPOINT)
        every = every.lstrip("-")
        if all(suite.ratio((label, b), cells) is None for b in budgets):
            continue  # ran on other tasks than these cells'
        for shown, name in ((base, f"`{base}`"), (label, f"`{base}`, `kv_checkpoint={every}`")):
            row = [share_cell(suite, shown, b, cells, mean=False) for b in budgets]
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def share_plot(suite: Suite, cells: list[Cell], labels: dict[str, str], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.cm.tab20.colors
    for number, label in enumerate(sorted(labels.values())):
        points = [(b, r) for b in suite.budgets() if (r := suite.ratio((label, b), cells)) is not None]
        # past 20 settings the colours repeat: a new line style (and marker) keeps every line its own
        cycle = number // len(colors) % 2
        style = dict(color=colors[number % len(colors)], linestyle="-:"[cycle], marker="os"[cycle])
        ax.plot([b for b, _ in points], [100 * r for _, r in points], label=label, **style)
    ax.axhline(100, color="black", linestyle=":", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(suite.budgets(), [str(b) for b in suite.budgets()])
    ax.set_xlabel("entries kept per layer and KV head (B)")
    ax.set_ylabel("share of the full cache's score, %")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def kept_share(row: dict) -> float:
    """The share of the prompt a request kept per (layer, KV head), from its evicted count."""
    return 1 - row.get("kv_tokens_evicted", 0) / row["prompt_tokens"]


def gate_table(rows: list[dict]) -> str:
    """Attention-Gate settings (and the baselines given its kept count per case): the mean over each task's cells
    (1k / 2k / 4k tokens, each weighing the same) and over all cells, each with its share of `full`'s mean over the
    same cells."""
    by_setting: dict[str, dict[tuple[str, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    keep: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_setting[row["policy"]][(row["task"], length_group(row["length"]))].append(row["score"])
        if row.get("prompt_tokens") and row["policy"] != "full":
            keep[row["policy"]].append(kept_share(row))
    cells = sorted({cell for scores in by_setting.values() for cell in scores})
    tasks = sorted({task for task, _ in cells})

    def mean(setting: str, chosen: list[Cell]) -> float:
        return sum(sum(by_setting[setting][c]) / len(by_setting[setting][c]) for c in chosen) / len(chosen)

    def share(setting: str, chosen: list[Cell]) -> str:
        if not chosen or any(c not in by_setting[setting] or c not in by_setting["full"] for c in chosen):
            return "-"
        mine, full = mean(setting, chosen), mean("full", chosen)
        return f"{mine:.3f} ({mine / full:.0%})" if full else f"{mine:.3f}"

    lines = []
    for setting in ["full"] + sorted(s for s in by_setting if s != "full"):
        kept = f"{sum(keep[setting]) / len(keep[setting]):.0%}" if keep.get(setting) else "100%" * (setting == "full")
        lines.append(
            [f"`{setting}`", kept or "-"]
            + [share(setting, [c for c in cells if c[0] == task]) for task in tasks]
            + [share(setting, cells)]
        )
    headers = ["setting", "kept share of the prompt", *(f"{task} (share of full)" for task in tasks)]
    return table([*headers, "all (share of full)"], lines)


def gate_curve(rows: list[dict], path: Path) -> None:
    """Passkey score against the kept share of the prompt: the gates at each tau, and the matched baselines."""
    score: dict[str, list[float]] = defaultdict(list)
    keep: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row["task"] != "passkey" or not row.get("prompt_tokens"):
            continue
        score[row["policy"]].append(row["score"])
        keep[row["policy"]].append(kept_share(row))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gates = sorted(
        (sum(keep[s]) / len(keep[s]), sum(score[s]) / len(score[s]), s) for s in score if s.startswith("attention_gate")
    )
    ax.plot(
        [100 * k for k, _, _ in gates],
        [v for _, v, _ in gates],
        "o-",
        color="tab:red",
        label="attention_gate (tau varies)",
    )
    for k, v, s in gates:
        ax.annotate(
            s.partition(":")[2] or "tau=0.5", (100 * k, v), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    for setting in sorted(s for s in score if "@" in s):
        k, v = sum(keep[setting]) / len(keep[setting]), sum(score[setting]) / len(score[setting])
        ax.plot([100 * k], [v], "s", label=setting)
    if score.get("full"):
        ax.axhline(sum(score["full"]) / len(score["full"]), color="black", linestyle=":", label="full cache")
    ax.set_xlabel("kept share of the prompt, % (mean over cases)")
    ax.set_ylabel("passkey score (1k/2k/4k)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def fp8_part(data: DataDir, suite: Suite, cells: list[Cell], labels: dict[str, str]) -> list[str]:
    """The settings that ran on an fp8 cache: the table's columns for them (unquantised cache, shares of its `full`)
    beside the same on fp8 (shares of fp8's `full`), and fp8's `full` against the unquantised one run beside it."""
    fp8_ruler, fp8_tasks = (data.load(name) for name in FP8)
    plain_ruler, plain_tasks = (data.load(name) for name in FP8_UNQUANTISED)
    fp8 = Suite.from_rows(fp8_ruler.data + fp8_tasks.data)
    plain = Suite.from_rows(plain_ruler.data + plain_tasks.data)
    budgets = fp8.budgets()
    fp8_full, plain_full = fp8.mean(("full", None), cells), plain.mean(("full", None), cells)
    if fp8_full is None or plain_full is None:
        raise ValueError("kvserve report: the fp8 runs must answer every judged cell with `full`")

    rows = [["`full`", *["100%"] * len(budgets), *["100%"] * len(budgets)]]
    for label in sorted(fp8.labels(), key=lambda lb: -sum(fp8.ratio((lb, b), cells) or 0 for b in budgets)):
        policy = base_policy(label)
        plain_label = labels.get(policy, label)  # the main table's row for this policy
        shown = f"`{policy}` {label.removeprefix(policy).lstrip('/:')}".strip()
        rows.append(
            [
                shown,
                *(share_cell(suite, plain_label, b, cells, mean=False) for b in budgets),
                *(share_cell(fp8, label, b, cells, mean=False) for b in budgets),
            ]
        )
    headers = ["setting", *(f"bf16 B={b}" for b in budgets), *(f"fp8 B={b}" for b in budgets)]
    return [
        "### On an fp8 KV cache",
        "The same suite with `--kv-cache-dtype fp8` (half bf16's memory), each group a share of its own cache's "
        f"`full`, which answered {fp8_full[0]:.3f} of the judged cells on fp8 and {plain_full[0]:.3f} on bf16 "
        f"({fp8_full[0] / plain_full[0]:.0%}; n = {fp8_full[1]} each, same machine and day).",
        table(headers, rows),
        captions([fp8_ruler, fp8_tasks, plain_ruler, plain_tasks]),
    ]


def load_suite(data: DataDir, names: Sequence[str] = SUITE) -> tuple[list[Source], Suite, list[Cell]]:
    """The quality suite's result files (`names`), their rows as one suite, and its judged cells (this section's and
    the summary's)."""
    sources = [data.load(name) for name in names]
    suite = Suite.from_rows([row for source in sources for row in source.data])
    return sources, suite, suite.judged_cells(FLOOR)


def pool_comparison_part(data: DataDir) -> list[str]:
    """SnapKV's pool settings (`kernel_size`) on the suite's tasks, run side by side on one machine, folded."""
    names = [name for name in POOL_COMPARISON if (data.folder / name).exists()]
    if not names:
        return []
    sources, suite, cells = load_suite(data, names)
    return [
        "<details><summary>snapkv's pool settings side by side, the same cases on one machine</summary>\n\n"
        f"Judged tasks: {', '.join(sorted({task for task, _ in cells}))}; share of `full` [95% interval].\n\n"
        f"{variants_table(suite, cells, 'snapkv', mean=False)}\n\n{captions(sources)}\n\n</details>"
    ]


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sources, suite, cells = load_suite(data)
    labels = best_labels(suite, cells)
    single = single_needle_cells(cells)
    single_labels = best_labels(suite, single)
    share_plot(suite, cells, labels, plots / "quality.png", "Quality suite, 1k/2k/4k tokens")
    gate_ruler, gate_tasks = (data.load(name) for name in GATE)
    gate_rows = gate_ruler.data + gate_tasks.data
    gate_curve(gate_tasks.data, plots / "attention-gate.png")
    judged = ", ".join(sorted({task for task, _ in cells}))
    unjudged = sorted({task for task, _ in suite.full} - {task for task, _ in cells})
    # a document's reconstruction (kvzip) is measured where documents are: "The hard half" section
    unmeasured = [
        p
        for p in POLICY_NAMES
        if p not in single_labels and p not in ("full", "attention_gate") and not POLICIES[p].reconstructs
    ]
    missing = (
        "Served, not yet in this suite: " + ", ".join(f"`{p}`" for p in unmeasured) + "."
        if unmeasured
        else "Every served policy is in the single-needle suite."
    )
    return "\n\n".join(
        [
            "## How much quality do I keep at 8x?",
            f"![share of full against B]({plot_link}/quality.png)",
            "Share of the full cache's score on the quality suite by B (a 4k-token prompt at B=512 is 8x), each "
            "policy at its best setting; bold leads its budget; brackets: 95% intervals. Judged, where `full` scores "
            f"at least {FLOOR}: {judged}, each (task, length) cell weighing the same (not judged: "
            f"{', '.join(unjudged) or 'none'}). Rebuild with "
            f"`kvserve eval suite {' '.join(s.name for s in sources)} --by-task`.",
            share_table(suite, cells, labels),
            f"The default policy, `{DEFAULT_POLICY}`, in every setting that ran them (`kernel_size`: the pool over "
            "the votes):",
            variants_table(suite, cells, DEFAULT_POLICY, mean=False),
            *pool_comparison_part(data),
            "`kv_checkpoint=turns` keeps on one prompt what eager eviction keeps (tested): the rows above. "
            "`kv_checkpoint=C` compacts every C tokens with only what came before, not with the question:",
            checkpoint_table(suite, cells),
            captions(sources),
            "### The single-needle suite, every policy",
            f"The tasks every policy ran ({', '.join(sorted({t for t, _ in single}))}); the suite above decides "
            "defaults.",
            share_table(suite, single, single_labels, mean=False),
            missing,
            *fp8_part(data, suite, single, single_labels),
            "### Attention-Gate at its own keep ratio",
            f"![passkey score against kept share]({plot_link}/attention-gate.png)",
            "The gates decide per token and head what to keep (no B). Each baseline (`policy@attention_gate`) keeps, "
            "per case, as many entries as the gates kept (`kvserve eval tasks --match-budget attention_gate`); "
            "`tau` rows move the gates' keep threshold.",
            gate_table(gate_rows),
            captions([gate_ruler, gate_tasks]),
        ]
    )
