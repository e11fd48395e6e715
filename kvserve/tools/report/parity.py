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
    "A method is done when it scores at least what its reference implementation scores on the same model and cases."
    " kvpress (NVIDIA's library of KV-cache presses for transformers, 0.5.5, in an environment of its own, "
    "`.kvpress-venv`: kvpress and transformers<5.3 on `.venv`'s torch) is the reference for KVzip, SnapKV, TOVA, "
    "StreamingLLM, Expected Attention, KeyDiff and DuoAttention. `kvserve eval parity` gives both sides the same "
    "tokens: the quality suite's passkey and multi-key lookup, each document in a chat's user message and the "
    "question after it, as kvpress's pipeline builds them, answered greedily. B is the entries each (layer, KV "
    "head) keeps of the context on average, on both sides. KVzip compresses the context before the question "
    "(`question: outside`): kvpress's pipeline prefills the context under the press and then asks; kvserve "
    "compresses it with `POST /v1/kvserve/compress` and the question resumes from it. kvpress's KVzip ranks every "
    "(layer, head, token) score together (`kvzip`; `kvzip_layerwise` gives every layer the same share); kvserve's "
    "rows say their `kv_allocation` (`global` is kvzip's default; a compressed document's lists are then rounded to"
    " whole pages). The other policies compress the whole prompt, question included (`inside`: kvpress compresses "
    "all but the last token, kvserve compacts where the prompt ends), since kvserve compacts before a question only"
    " through a compressed document, which KVzip's reconstruction scores; their kvserve rows use kvpress's settings"
    " (SnapKV's window of 64 and pooling over 5, KeyDiff with no protected window, TOVA ranking by the whole "
    "layer's votes, `kv_vote_scope=layer`, as TOVA's own code does; single tokens). DuoAttention runs in the "
    "paper's plain form on both sides (retrieval heads keep everything, the others their 16 sinks and 64 newest "
    "entries), its heads ranked by the roles kvserve ships for the model (kvpress downloads the authors' patterns, "
    "which exist only for 7-8B models), with as many retrieval heads as B allows on each case. Each cell: the mean "
    "score [95% interval] (n answers), and in the last column each side's mean as a share of its own `full` (the "
    "two sides' full caches differ in bf16 rounding, which flips a few of a small model's answers)."
)


CHECKPOINT_TITLE = "### Before the question: what `kv_checkpoint` keeps"
CHECKPOINT_MODELS = (
    ("Qwen2.5-Coder-0.5B-Instruct", "checkpoint/qwen05.jsonl"),
    ("SmolLM2-135M-Instruct", "checkpoint/smollm2.jsonl"),
)
CHECKPOINT_INTRO = (
    "A request with `kv_checkpoint=C` has the prompt's last multiple of C before its end compacted before any "
    "question is seen, and the prefix is shared by every request that starts with it; the rest of the prompt and "
    "the reply are kept in full. The suite's passkey and multi-key lookup (plain prompts, `/v1/completions`), at "
    "`kv_checkpoint=512` and B=512: a 1k-token prompt's prefix (512) is not compressed, a 2k one's 1,536 tokens "
    "keep 512, a 4k one's 3,584 keep 512. Each cell: the mean score over both tasks; the last column the share of "
    "`full` over all cells with its 95% interval. A request with `kv_checkpoint=C` that names no policy gets "
    "`kv_checkpoint_policy` (the server's built-in: `{policy}`)."
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
        parts += [f"### {title}", parity_table(source.data), source.caption()]
    parts += [CHECKPOINT_TITLE, CHECKPOINT_INTRO.format(policy=BUILTIN_DEFAULTS[CHECKPOINT_POLICY_KEY])]
    for title, name in CHECKPOINT_MODELS:
        source = data.load(name)
        parts += [f"#### {title}", checkpoint_table(source.data), source.caption()]
    return "\n\n".join(parts)
