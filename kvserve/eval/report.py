"""Tables and plots shared by the quality and perplexity evaluations: one value per (policy, budget)."""

from __future__ import annotations

import math

Values = dict[tuple[str, int | None], float]  # (policy, budget) -> value; `full` has budget None


def _policies(values: Values) -> list[str]:
    others = sorted({p for p, _ in values if p != "full"})
    return ["full"] * (("full", None) in values) + others


def grid_table(values: Values, fmt: str = ".2f") -> str:
    """Markdown: policy rows x budget columns; the `full` reference repeats its one value in every column."""
    budgets: list[int | None] = sorted({b for _, b in values if b is not None}) or [None]  # no budgets: one column
    lines = [
        "| policy | " + " | ".join(f"B={b}" if b else "value" for b in budgets) + " |",
        "|---" * (len(budgets) + 1) + "|",
    ]
    for policy in _policies(values):
        if (policy, None) in values:  # full, or a policy that sets its own counts: one value for every column
            cells = [format(values[(policy, None)], fmt)] * len(budgets)
        else:
            cells = [format(values[(policy, b)], fmt) if (policy, b) in values else "-" for b in budgets]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_vs_budget(values: Values, ylabel: str, path: str, title: str, log_y: bool = False) -> None:
    """One line per policy over budgets (log2 x axis); full cache as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 16 policies: tab10 would repeat colours
    markers = "os^vD<>ph*xP"
    for number, policy in enumerate(p for p in _policies(values) if p != "full"):
        if (policy, None) in values:  # its own counts, no budget: a horizontal line like the full cache
            ax.axhline(values[(policy, None)], color="tab:red", linestyle="-.", label=f"{policy} (own counts)")
            continue
        points = sorted((b, v) for (p, b), v in values.items() if p == policy and math.isfinite(v))
        style = "--" if "+" in policy else "-"
        ax.plot(
            [b for b, _ in points], [v for _, v in points], style, marker=markers[number % len(markers)], label=policy
        )
    if ("full", None) in values:
        ax.axhline(values[("full", None)], color="black", linestyle=":", label="full cache")
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("KV budget (tokens per layer and head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
