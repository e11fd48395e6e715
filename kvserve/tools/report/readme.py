"""The README's results: one small table per model (policy, B, the share of the full cache's score with the tasks it
was measured on, output tokens/s against vanilla vLLM in the same memory), built from docs/eval by `kvserve report`,
which writes it between the README's markers. The README quotes no measured number outside this block (a test holds
it to that), so what it says is what the result files say."""

from __future__ import annotations

from pathlib import Path

from kvserve.config import BUILTIN_DEFAULTS, CHECKPOINT_POLICY_KEY
from kvserve.tools.eval.client import label_of
from kvserve.tools.eval.suite import Cell, Suite
from kvserve.tools.markdown import ratio, table, with_block
from kvserve.tools.report import models, parity, scoreboard
from kvserve.tools.report.headline import THROUGHPUT_PNG
from kvserve.tools.report.quality import FLOOR, base_policy, best_labels, load_suite, single_needle_cells
from kvserve.tools.report.sources import DataDir
from kvserve.tools.report.summary import OVERHEAD, decode_heavy_ratios
from kvserve.tools.report.throughput import DECODE_HEAVY

START = "<!-- results: written by `kvserve report` from docs/eval; edit the generator, not this block -->"
END = "<!-- /results -->"
DEFAULT_POLICY = BUILTIN_DEFAULTS["kv_policy"]
# the results label of what a request gets from the server's defaults (its policy's own knobs and span)
DEFAULT_LABEL = label_of({"kv_policy": DEFAULT_POLICY})
CHECKPOINT_POLICY = BUILTIN_DEFAULTS[CHECKPOINT_POLICY_KEY]
# (policy, the budgets its row shows): the server's default at a short and a long ratio, and the trained heads where
# they lead at the smallest budgets
SHOWN = ((DEFAULT_POLICY, (256, 512)), ("duoattention", (128, 256)))


def task_set(cells: list[Cell]) -> str:
    """`4 tasks, 1k-4k tokens` for the judged (task, length) cells a share is over."""
    tasks, lengths = {task for task, _ in cells}, sorted({k for _, k in cells})
    span = f"{lengths[0]}k" if len(lengths) == 1 else f"{lengths[0]}k-{lengths[-1]}k"
    return f"{len(tasks)} {'task' if len(tasks) == 1 else 'tasks'}, {span} tokens"


def eviction_off(run: dict) -> str:
    """kvserve `full` against vanilla on the same work: what serving through kvserve costs when nothing is evicted."""
    by_server = {(r["server"], r["policy"]): r["output_tokens_per_s"] for r in run["results"]}
    return ratio(by_server[("kvserve", "full")], by_server[("vanilla", "full")])


def quality(suite: Suite, cells: list[Cell], policy: str, budgets: tuple[int, ...]) -> str:
    """`91% / 99% (4 tasks, 1k-4k tokens)`: the server default's own setting where `policy` is the default's and it
    ran at every budget, else the policy's best setting (named where it is not the default's), over `cells`, else
    over their single-needle tasks (said so), at each budget."""
    for judged, which in ((cells, ""), (single_needle_cells(cells), "single needle: ")):
        best = best_labels(suite, judged).get(policy)
        for label in dict.fromkeys([DEFAULT_LABEL if policy == DEFAULT_POLICY else None, best]):
            shares = [suite.ratio((label, budget), judged) for budget in budgets] if label else [None]
            if all(share is not None for share in shares):
                named = f"`{label}`: " if policy == DEFAULT_POLICY and label != DEFAULT_LABEL else ""
                return named + " / ".join(f"{share:.0%}" for share in shares) + f" ({which}{task_set(judged)})"
    return "not run"


def checkpoint_row(rows: list[dict]) -> list[str]:
    """The checkpoint policy's row from the `kv_checkpoint` study (docs/eval/checkpoint): its prefix compacted before
    any question is seen."""
    suite = Suite.from_rows(rows)
    cells = suite.judged_cells(FLOOR)
    ((label, budget),) = [setting for setting in suite.cells if base_policy(setting[0]) == CHECKPOINT_POLICY]
    checkpoint = next(part for part in label.split("/") if part.startswith("checkpoint")).removeprefix("checkpoint")
    share = suite.ratio((label, budget), cells)
    name = f"`{CHECKPOINT_POLICY}`, `kv_checkpoint={checkpoint}` (before the question)"
    return [name, str(budget), f"{share:.0%} ({task_set(cells)})", "-"]


def model_table(suite: Suite, cells: list[Cell], decode_heavy: list[dict], overhead: dict, checkpoint: list) -> str:
    rows = []
    for policy, budgets in SHOWN:
        name = f"`{policy}`" + (" (server default)" if policy == DEFAULT_POLICY else "")
        shares = quality(suite, cells, policy, budgets)
        throughput = decode_heavy_ratios(decode_heavy).get(policy, "not run")
        rows.append([name, " / ".join(map(str, budgets)), shares, throughput])
    rows.append(checkpoint_row(checkpoint))
    rows.append(["`full` (eviction off)", "-", "100%", eviction_off(overhead)])
    return table(["policy", "B", "share of full (tasks)", "tokens/s vs vanilla"], rows)


def results_block(data: DataDir) -> str:
    """The README's block, markers included."""
    _, suite, cells = load_suite(data)
    default_runs = [data.load(name).data for name in DECODE_HEAVY]
    _, qwen, qwen_cells, _ = models.qwen_suite(data)
    checkpoints = dict(parity.CHECKPOINT_MODELS)
    return "\n\n".join(
        [
            START,
            "**SmolLM2-135M-Instruct** (default model):",
            model_table(
                suite,
                cells,
                default_runs,
                data.load(OVERHEAD).data,
                data.load(checkpoints["SmolLM2-135M-Instruct"]).data,
            ),
            "**Qwen2.5-Coder-0.5B-Instruct**:",
            model_table(
                qwen,
                qwen_cells,
                [data.load(models.CAPACITY).data],
                data.load(models.OVERHEAD).data,
                data.load(checkpoints["Qwen2.5-Coder-0.5B-Instruct"]).data,
            ),
            scoreboard.readme_part(data, "docs/benchmarks"),
            f"![output tokens/s against KV memory, kvserve, vanilla, ceiling](docs/benchmarks/{THROUGHPUT_PNG})",
            notes(data, cells, qwen_cells),
            END,
        ]
    )


def notes(data: DataDir, cells: list[Cell], qwen_cells: list[Cell]) -> str:
    """What the tables' tasks and workloads are, from the same files."""
    checkpoint = Suite.from_rows(data.load(parity.CHECKPOINT_MODELS[0][1]).data).judged_cells(FLOOR)
    run = data.load(DECODE_HEAVY[0]).data["args"]

    def names(judged: list[Cell]) -> str:
        return ", ".join(sorted({task for task, _ in judged}))

    return (
        f"Tasks: {names(cells)}; on Qwen {names(qwen_cells)}; `kv_checkpoint` rows: {names(checkpoint)}. "
        f"Throughput: {run['prompts']} requests of {run['prompt_tokens']:,} + {run['max_tokens']} tokens, a pool "
        f"holding {run['num_blocks'] * run['block_size'] // (run['prompt_tokens'] + run['max_tokens'])} without "
        "eviction. RULER-4k: scores x100, n answers. Intervals, commands: [benchmarks](docs/benchmarks.md)."
    )


def with_results(readme: str, block: str) -> str:
    """The README with its results block replaced by `block`; ValueError if it has no markers."""
    return with_block(readme, START, END, block, "the README has no results block")


def update(readme: Path, data: DataDir) -> str:
    """The README's text with the block rebuilt from `data` (not written)."""
    return with_results(readme.read_text(), results_block(data))
