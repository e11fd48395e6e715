"""The quality suite's verdict: which setting keeps most of the full cache's score at each budget.

`python -m kvserve.tools.eval suite RESULTS.jsonl [MORE.jsonl ...]` reads the rows that `kvserve eval ruler` and
`kvserve eval tasks` wrote (one answer per line: policy label, budget, task, length, score) and prints

- which tasks are judged: those where `full` scores at least `--floor` (0.5) over all lengths; a task the full
  cache fails says nothing about eviction (on the 135M default model RULER's multi-key needles sit near 0);
- per setting and budget, the mean over the judged tasks and lengths (each (task, length) cell weighs the same)
  and its ratio to `full`'s mean over the same cells;
- the best setting per budget, against the goals given with `--goal B=ratio`;
- with `--by-task`, every (task, length) cell with its 95% interval.

Intervals: a cell's answers score 0 or 1 (a two-value task: 0, 1/2 or 1), so a cell's mean is a proportion and its
95% interval is Wilson's score interval over its n answers ("Probable Inference, the Law of Succession, and
Statistical Inference", Wilson 1927), which stays inside [0, 1] and does not collapse at 0 or 1 as the normal
approximation does. A share of `full` over several cells adds the cells' binomial variances (normal
approximation, `full`'s mean taken as fixed).

Lengths are grouped by thousands (RULER's 1024 and the project's 1000-token tasks are both "1k").
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

Cell = tuple[str, int]  # (task, length in thousands of tokens)


def length_group(length: int) -> int:
    """1024 and 1000 -> 1, 2048 and 2000 -> 2, 4096 and 4000 -> 4."""
    return max(1, round(length / 1000))


def wilson(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a proportion `mean` seen over `n` answers (Wilson's score interval)."""
    if n <= 0:
        return 0.0, 1.0
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def load_rows(paths: Iterable[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as lines:
            rows.extend(json.loads(line) for line in lines if line.strip())
    return rows


@dataclass(frozen=True)
class Suite:
    """Mean score per (setting label, budget) and (task, length group) cell, with the number of answers."""

    cells: dict[tuple[str, int | None], dict[Cell, tuple[float, int]]]

    @classmethod
    def from_rows(cls, rows: list[dict]) -> Suite:
        scores: dict[tuple[str, int | None], dict[Cell, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            scores[(row["policy"], row["budget"])][(row["task"], length_group(row["length"]))].append(row["score"])
        return cls(
            {
                setting: {cell: (sum(values) / len(values), len(values)) for cell, values in by_cell.items()}
                for setting, by_cell in scores.items()
            }
        )

    @property
    def full(self) -> dict[Cell, tuple[float, int]]:
        if ("full", None) not in self.cells:
            raise ValueError("the results hold no `full` rows: nothing to take ratios against")
        return self.cells[("full", None)]

    def judged_tasks(self, floor: float) -> list[str]:
        """Tasks where `full`'s mean over its lengths is at least `floor`."""
        by_task: dict[str, list[float]] = defaultdict(list)
        for (task, _), (mean, _) in self.full.items():
            by_task[task].append(mean)
        return sorted(task for task, means in by_task.items() if sum(means) / len(means) >= floor)

    def judged_cells(self, floor: float) -> list[Cell]:
        tasks = set(self.judged_tasks(floor))
        return sorted(cell for cell in self.full if cell[0] in tasks)

    def mean(self, setting: tuple[str, int | None], cells: list[Cell]) -> tuple[float, int] | None:
        """Mean over `cells` (each weighs the same) and answers behind it; None if the setting misses a cell."""
        have = self.cells.get(setting, {})
        if not cells or any(cell not in have for cell in cells):
            return None
        return sum(have[c][0] for c in cells) / len(cells), sum(have[c][1] for c in cells)

    def ratio(self, setting: tuple[str, int | None], cells: list[Cell]) -> float | None:
        mine, full = self.mean(setting, cells), self.mean(("full", None), cells)
        return None if mine is None or full is None or full[0] == 0 else mine[0] / full[0]

    def share_interval(
        self, setting: tuple[str, int | None], cells: list[Cell], z: float = 1.96
    ) -> tuple[float, float, float] | None:
        """(share of full, low, high) over `cells`: the setting's mean against full's, with a 95% interval from each
        cell's answers (the binomial spread p(1 - p) / n per cell; full's mean taken as fixed); None if not run."""
        have, full = self.cells.get(setting, {}), self.mean(("full", None), cells)
        if full is None or full[0] == 0 or not cells or any(cell not in have for cell in cells):
            return None
        mean = sum(have[c][0] for c in cells) / len(cells)
        spread = math.sqrt(sum(have[c][0] * (1 - have[c][0]) / have[c][1] for c in cells)) / len(cells)
        return mean / full[0], max(mean - z * spread, 0) / full[0], (mean + z * spread) / full[0]

    def budgets(self) -> list[int]:
        return sorted({budget for _, budget in self.cells if budget is not None})

    def labels(self) -> list[str]:
        return sorted({label for label, budget in self.cells if budget is not None})

    def own_count_labels(self) -> list[str]:
        """Settings without one budget (attention_gate's own counts, `--match-budget` rows), `full` aside."""
        return sorted({label for label, budget in self.cells if budget is None and label != "full"})

    def best(self, budget: int, cells: list[Cell]) -> tuple[list[str], float] | None:
        """The labels with the highest mean at `budget` (all that tie) and that mean."""
        means = {label: m[0] for label in self.labels() if (m := self.mean((label, budget), cells)) is not None}
        if not means:
            return None
        top = max(means.values())
        return sorted(label for label, mean in means.items() if mean == top), top


def verdict(suite: Suite, floor: float = 0.5, goals: dict[int, float] | None = None) -> str:
    """The markdown the README's "Which one to pick" and the results show."""
    cells = suite.judged_cells(floor)
    if not cells:
        return f"no task where `full` scores at least {floor}: nothing to judge"
    tasks = suite.judged_tasks(floor)
    budgets = suite.budgets()
    full_mean, full_n = suite.mean(("full", None), cells) or (float("nan"), 0)
    lines = [
        f"Judged tasks (full >= {floor}): {', '.join(tasks)}; cells (task, length): "
        + ", ".join(f"{task} {k}k" for task, k in cells),
        "",
        f"full: {full_mean:.3f} (n={full_n})",
    ]
    if budgets:
        lines += [
            "",
            "| setting | " + " | ".join(f"B={b}" for b in budgets) + " |",
            "|---" * (len(budgets) + 1) + "|",
            "| full | " + " | ".join([f"{full_mean:.3f} (100%, n={full_n})"] * len(budgets)) + " |",
        ]
    best = {budget: suite.best(budget, cells) for budget in budgets}
    for label in suite.labels():
        row = []
        for budget in budgets:
            mean = suite.mean((label, budget), cells)
            if mean is None:
                row.append("-")
                continue
            share, low, high = suite.share_interval((label, budget), cells)
            text = f"{mean[0]:.3f} ({share:.0%} [{low:.0%}-{high:.0%}], n={mean[1]})"
            leaders = best[budget]
            row.append(f"**{text}**" if leaders and label in leaders[0] else text)
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    own = suite.own_count_labels()
    if own:
        lines += ["", "| setting (its own or a matched count per case) | score |", "|---|---|"]
        for label in own:
            mean = suite.mean((label, None), cells)
            text = "-" if mean is None else f"{mean[0]:.3f} ({suite.ratio((label, None), cells):.0%}, n={mean[1]})"
            lines.append(f"| {label} | {text} |")
    lines.append("")
    for budget in budgets:
        if best[budget] is None:
            continue
        leaders, top = best[budget]
        ratio = top / full_mean if full_mean else float("nan")
        line = f"B={budget}: best {', '.join(leaders)} {top:.3f} = {ratio:.0%} of full"
        if goals and budget in goals:
            line += f" (goal >= {goals[budget]:.0%}: {'met' if ratio >= goals[budget] else 'NOT met'})"
        lines.append(line)
    return "\n".join(lines)


def cell_text(mean: float, n: int) -> str:
    """`0.58 [0.32-0.81] n=12`: a cell's mean with its Wilson interval and answer count."""
    low, high = wilson(mean, n)
    return f"{mean:.2f} [{low:.2f}-{high:.2f}] n={n}"


def by_task(suite: Suite, budget: int | None) -> str:
    """Every task and length (judged or not) at one budget (None: the settings with their own or matched counts),
    `full` first, each cell with its 95% interval: what the verdict's means are made of."""
    cells = sorted({cell for by_cell in suite.cells.values() for cell in by_cell})
    labels = suite.labels() if budget is not None else suite.own_count_labels()
    lines = [
        f"| {'B=' + str(budget) if budget is not None else 'own count'} | "
        + " | ".join(f"{task} {k}k" for task, k in cells)
        + " |",
        "|---" * (len(cells) + 1) + "|",
    ]
    for setting in [("full", None)] + [(label, budget) for label in labels]:
        have = suite.cells.get(setting, {})
        if not have:
            continue
        row = [cell_text(*have[c]) if c in have else "-" for c in cells]
        lines.append(f"| {setting[0]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _goals(text: str) -> dict[int, float]:
    goals = {}
    for item in filter(None, text.split(",")):
        budget, _, ratio = item.partition("=")
        goals[int(budget)] = float(ratio)
    return goals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve eval suite", description=__doc__)
    parser.add_argument("results", nargs="+", help="JSON-lines files written by `kvserve eval ruler` / `tasks`")
    parser.add_argument("--floor", type=float, default=0.5, help="judge only tasks where full scores at least this")
    parser.add_argument("--goal", default="256=0.9,512=0.95", help="B=ratio of full's score, comma list")
    parser.add_argument("--by-task", action="store_true", help="also every task and length at each budget")
    args = parser.parse_args(argv)
    suite = Suite.from_rows(load_rows(args.results))
    print(verdict(suite, args.floor, _goals(args.goal)))
    if args.by_task:
        for budget in suite.budgets() + ([None] if suite.own_count_labels() else []):
            print("", by_task(suite, budget), sep="\n")
