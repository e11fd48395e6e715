"""Parity with the reference implementations: the same cases through kvpress's presses and kvserve's server
(`kvserve eval parity`), per model; then what compaction before the question (`kv_checkpoint`) keeps with each
query-agnostic policy, which decides the checkpoint default."""

from __future__ import annotations

from pathlib import Path

from kvserve.config import BUILTIN_DEFAULTS, CHECKPOINT_POLICY_KEY
from kvserve.tools.eval.parity import parity_table
from kvserve.tools.eval.suite import Suite
from kvserve.tools.markdown import table
from kvserve.tools.report.quality import FLOOR, base_policy, share_cell
from kvserve.tools.report.sources import DataDir

TITLE = "## Parity with kvpress"
MODELS = (
    ("Qwen2.5-Coder-0.5B-Instruct", "parity/qwen05.jsonl"),
    ("SmolLM2-135M-Instruct (the default model)", "parity/smollm2.jsonl"),
)
INTRO = (
    "kvserve against kvpress 0.5.5 (`.kvpress-venv`) on the suite's passkey and multi-key lookup: `kvserve eval "
    "parity` gives both the same tokens (kvpress's chat layout, greedy) and B; KVzip compresses the context before "
    "the question (`outside`), the others the whole prompt (`inside`). Cells: mean [95% interval] (n); last "
    "column: each side's share of its own `full`."
)

FOLDED = "the table (12 answers a cell; RULER-4k's scoreboard compares both sides on more)"

CHECKPOINT_TITLE = "### Before the question: what `kv_checkpoint` keeps"
CHECKPOINT_MODELS = (
    ("Qwen2.5-Coder-0.5B-Instruct", "checkpoint/qwen05.jsonl"),
    ("SmolLM2-135M-Instruct", "checkpoint/smollm2.jsonl"),
)
CHECKPOINT_INTRO = (
    "With `kv_checkpoint=C` the prompt up to its last multiple of C is compacted before any question is seen and "
    "shared by every request that starts with it; the rest is kept in full. The suite's passkey and multi-key lookup "
    "at `kv_checkpoint=512`, B=512. Cells: mean score over both tasks; last column: share of `full` [95% "
    "interval]. A checkpoint naming no policy uses `kv_checkpoint_policy` (built in: `{policy}`)."
)


def checkpoint_table(rows: list[dict]) -> str:
    """Per setting: the mean score at each prompt length (both tasks) and the share of `full` over all cells."""
    suite = Suite.from_rows(rows)
    cells = suite.judged_cells(FLOOR)
    lengths = sorted({length for _, length in cells})
    body = []
    for label, budget in sorted(suite.cells, key=lambda setting: (setting[0] != "full", setting[0])):
        by_length = []
        for length in lengths:
            mean = suite.mean((label, budget), [cell for cell in cells if cell[1] == length])
            by_length.append("-" if mean is None else f"{mean[0]:.2f} (n={mean[1]})")
        share = "" if label == "full" else share_cell(suite, label, budget, cells)
        body.append([f"`{label}`", str(budget or ""), *by_length, share])
    return table(["setting", "B", *(f"{length}k" for length in lengths), "share of full [95%] (mean)"], body)


# the policies the docs' sentence compares with KVzip, by their labels' first part
COMPARED_POLICIES = (("keydiff", "KeyDiff"), ("snapkv", "SnapKV"))


def checkpoint_shares(rows: list[dict]) -> dict[str, float]:
    """Each policy's share of `full` over the judged cells, by the policy part of its label."""
    suite = Suite.from_rows(rows)
    cells = suite.judged_cells(FLOOR)
    shares = {}
    for label, budget in suite.cells:
        found = None if label == "full" else suite.share_interval((label, budget), cells)
        if found is not None:
            shares[base_policy(label)] = found[0]
    return shares


def checkpoint_sentence(data: DataDir) -> str:
    """What the README and guide say of `kv_checkpoint=512` (a test holds them to it): each quoted policy's share
    of full on each model, from the result files."""
    parts = []
    for (_, name), model in zip(CHECKPOINT_MODELS, ("Qwen2.5-Coder-0.5B", "the default model"), strict=True):
        shares = checkpoint_shares(data.load(name).data)
        others = ", ".join(f"{shown} {shares[policy]:.0%}" for policy, shown in COMPARED_POLICIES)
        parts.append(f"{shares['kvzip']:.0%} of full on {model} ({others})")
    return f"at `kv_checkpoint=512` and B=512 KVzip keeps {parts[0]} and {parts[1]}"


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [TITLE, INTRO]
    for title, name in MODELS:
        source = data.load(name)
        # folded: 12 answers a cell decide little beside RULER-4k's scoreboard (its section), which supersedes it
        folded = f"<details><summary>{FOLDED}</summary>\n\n{parity_table(source.data)}\n\n</details>"
        parts += [f"### {title}", folded, source.caption()]
    parts += [CHECKPOINT_TITLE, CHECKPOINT_INTRO.format(policy=BUILTIN_DEFAULTS[CHECKPOINT_POLICY_KEY])]
    for title, name in CHECKPOINT_MODELS:
        source = data.load(name)
        parts += [f"#### {title}", checkpoint_table(source.data), source.caption()]
    return "\n\n".join(parts)
