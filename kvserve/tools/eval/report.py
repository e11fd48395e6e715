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
    """One line per policy over budgets (log2 x axis); full cache as a dashed horizontal line. Rows with allocations
    or spans (`snapkv/heads/span8`) get one panel per base policy, a line per allocation and span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in _policies(values) if p != "full"]
    bases = list(dict.fromkeys(p.split("/")[0] for p in policies)) if any("/" in p for p in policies) else [None]
    fig, axes = plt.subplots(1, len(bases), figsize=(9 if bases == [None] else 4.5 * len(bases), 5.5), squeeze=False)
    markers = "os^vD<>ph*xP"
    for ax, base in zip(axes[0], bases, strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 16 policies: tab10 would repeat colours
        shown = [p for p in policies if base is None or p.split("/")[0] == base]
        for number, policy in enumerate(shown):
            if (policy, None) in values:  # its own counts, no budget: a horizontal line like the full cache
                ax.axhline(values[(policy, None)], color="tab:red", linestyle="-.", label=f"{policy} (own counts)")
                continue
            points = sorted((b, v) for (p, b), v in values.items() if p == policy and math.isfinite(v))
            style = "--" if "+" in policy or "span" in policy else "-"
            name = policy if base is None else (policy.partition("/")[2] or "uniform")
            ax.plot(
                [b for b, _ in points], [v for _, v in points], style, marker=markers[number % len(markers)], label=name
            )
        if ("full", None) in values:
            ax.axhline(values[("full", None)], color="black", linestyle=":", label="full cache")
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("KV budget (tokens per layer and head)")
        ax.set_ylabel(ylabel)
        ax.set_title(title if base is None else f"{base}: {title}", fontsize=10)
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0) if base is None else None)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_label(label: str) -> tuple[str, str, int]:
    """`snapkv/heads/span8` -> ("snapkv", "heads", 8); a plain policy is uniform at span 1."""
    base, *rest = label.split("/")
    allocation = next((part for part in rest if not part.startswith("span")), "uniform")
    span = next((int(part[4:]) for part in rest if part.startswith("span")), 1)
    return base, allocation, span


def allocation_table(values: Values, higher_is_better: bool, fmt: str = ".2f") -> str:
    """Each allocation against `uniform` at the same policy, span and budget (same memory): the value and its change,
    then per allocation how often it beat uniform and its mean change."""
    from kvserve.policies.allocation import ALLOCATIONS

    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for (label, budget), value in values.items():
        if budget is None:
            continue
        base, allocation, span = parse_label(label)
        cells.setdefault((base, span, budget), {})[allocation] = value
    shown = [a for a in ALLOCATIONS if any(a in row for row in cells.values())]
    lines = ["| policy | span | B | " + " | ".join(shown) + " |", "|---" * (len(shown) + 3) + "|"]
    changes: dict[str, list[float]] = {a: [] for a in shown if a != "uniform"}
    for (base, span, budget), row in sorted(cells.items()):
        uniform = row.get("uniform")
        texts = []
        for allocation in shown:
            if allocation not in row:
                texts.append("-")
            elif allocation == "uniform" or uniform is None:
                texts.append(format(row[allocation], fmt))
            else:
                change = row[allocation] - uniform
                changes[allocation].append(change)
                texts.append(f"{row[allocation]:{fmt}} ({change:+{fmt}})")
        lines.append(f"| {base} | {span} | {budget} | " + " | ".join(texts) + " |")
    lines.append("")
    for allocation, deltas in changes.items():
        better = sum((d > 0) == higher_is_better and d != 0 for d in deltas)
        worse = sum((d < 0) == higher_is_better and d != 0 for d in deltas)
        mean = sum(deltas) / len(deltas) if deltas else float("nan")
        lines.append(
            f"{allocation} vs uniform: better in {better}, worse in {worse}, equal in {len(deltas) - better - worse} "
            f"of {len(deltas)} (policy, span, budget) cells; mean change {mean:+{fmt}}"
        )
    return "\n".join(lines)
