"""The page's opening: the figures a reader decides by, each with 95% intervals as bands where the data repeats.

(a) quality against compression per policy and model: the RULER-4k scoreboard (drawn by scoreboard.py);
(b) output tokens/s against KV memory: kvserve, vanilla vLLM in the same pool, and the compute ceiling (vanilla with a
    pool for every request), each over the vanilla of its own run, from every run of the decode-heavy workload;
(c) time to first token against prompt length for long prompts (drawn by long_prompts.py, which opens with it).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.report import scoreboard
from kvserve.tools.report.figures import throughput_plot, throughput_points
from kvserve.tools.report.long_prompts import PLOT as TTFT_PNG
from kvserve.tools.report.sources import DataDir

TITLE = "## The figures to decide by"
THROUGHPUT_PNG = "throughput-memory.png"
# Every run of the decode-heavy workload (16 requests of 1,500 + 256 tokens, a pool of 28 blocks of 128, B=188) on a
# bf16 cache with one engine: the same command on five days and more than one CPU (their captions name them), pooled
# as ratios to each run's own vanilla, so their spread is what a reader gets from one run; each file stays on its own
# section's table. Per model; a run's rows at another tensor- or data-parallel size are not this workload's
# (figures.one_engine).
DECODE_HEAVY_RUNS = (
    (
        "SmolLM2-135M-Instruct",
        (
            "capacity-decode-heavy.json",
            "suite/capacity-duo.json",
            "fp8/decode-heavy-bf16.json",
            "costs/decode-heavy-h2o.json",
            "scale/dp-decode-heavy.json",
        ),
    ),
    ("Qwen2.5-Coder-0.5B-Instruct", ("qwen05/capacity-decode-heavy.json",)),
)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    models = [(model, throughput_points(data.load(name) for name in names)) for model, names in DECODE_HEAVY_RUNS]
    throughput_plot(models, plots / THROUGHPUT_PNG)
    board_title, _, board_png = scoreboard.MODELS[0]
    files = ", ".join(f"`{data.name(data.folder / name)}`" for _, names in DECODE_HEAVY_RUNS for name in names)
    return "\n\n".join(
        [
            TITLE,
            f"**Quality against compression** ({board_title}, kvpress's RULER-4k protocol, kvserve beside kvpress; "
            "[section](#on-kvpresss-leaderboard-ruler-at-4k)):",
            f"![RULER-4k score against compression ratio, {board_title}]({plot_link}/{board_png})",
            "**Output tokens/s against KV memory** (vanilla vLLM and kvserve in the same pool, the ceiling with a pool "
            "for every request, each as a multiple of the vanilla measured in the same run, as runs on different CPUs "
            f"pool only so; every run of the decode-heavy workload: {files}; "
            "[section](#how-much-faster-is-it-at-the-same-memory)):",
            f"![output tokens/s against KV pool, kvserve, vanilla and the ceiling]({plot_link}/{THROUGHPUT_PNG})",
            "**Time to first token against prompt length** (full against eviction after every prefill chunk; "
            "[section](#long-prompts-through-a-bounded-cache)):",
            f"![TTFT against prompt length]({plot_link}/{TTFT_PNG})",
        ]
    )
