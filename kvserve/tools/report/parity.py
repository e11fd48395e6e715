"""Parity with the reference implementations: the same cases through kvpress's presses and kvserve's server
(`kvserve eval parity`), per model."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.eval.parity import parity_table
from kvserve.tools.report.sources import DataDir

TITLE = "## Parity with kvpress"
MODELS = (
    ("Qwen2.5-Coder-0.5B-Instruct", "parity/qwen05.jsonl"),
    ("SmolLM2-135M-Instruct (the default model)", "parity/smollm2.jsonl"),
)
INTRO = (
    "A method is done when it scores at least what its reference implementation scores on the same model and "
    "cases. kvpress (NVIDIA's library of KV-cache presses for transformers, 0.5.5, in an environment of its own: "
    "`../shared/reference/kvpress-venv.sh`) is the reference for KVzip, SnapKV, TOVA, StreamingLLM, Expected "
    "Attention and KeyDiff. `kvserve eval parity` gives both sides the same tokens: the quality suite's passkey "
    "and multi-key lookup, each document in a chat's user message and the question after it, as kvpress's "
    "pipeline builds them, answered greedily. B is the entries each (layer, KV head) keeps of the context on "
    "average, on both sides. KVzip compresses the context before the question (`question: outside`): kvpress's "
    "pipeline prefills the context under the press and then asks; kvserve compresses it with `POST "
    "/v1/kvserve/compress` and the question resumes from it. kvpress's KVzip ranks every (layer, head, token) "
    "score together (`kvzip`; `kvzip_layerwise` gives every layer the same share); kvserve's rows say their "
    "`kv_allocation` (`global` is kvzip's default; a compressed document's lists are then rounded to whole pages). "
    "The other policies compress the whole prompt, question included (`inside`: kvpress compresses all but the "
    "last token, kvserve compacts where the prompt ends), since kvserve compacts before a question only through "
    "a compressed document, which KVzip's reconstruction scores; their kvserve rows use kvpress's settings "
    "(SnapKV's window of 64 and pooling over 5, KeyDiff with no protected window, single tokens). Each cell: the "
    "mean score [95% interval] (n answers), and in the last column each side's mean as a share of its own `full` "
    "(the two sides' full caches differ in bf16 rounding, which flips a few of a small model's answers)."
)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [TITLE, INTRO]
    for title, name in MODELS:
        source = data.load(name)
        parts += [f"### {title}", parity_table(source.data), source.caption()]
    return "\n\n".join(parts)
