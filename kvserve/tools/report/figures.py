"""The figures with 95% intervals as bands: output tokens/s against KV memory (kvserve, vanilla vLLM, the compute
ceiling), each as a multiple of vanilla's in the same run, and time to first token against prompt length; each band
is a Student t interval of the mean over what the data repeats (runs of one workload, cases of one length), and a
series that ran once says so instead of a band."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvserve.tools.bench.__main__ import CEILING
from kvserve.tools.report.intervals import mean_interval
from kvserve.tools.report.plots import pyplot, save
from kvserve.tools.report.sources import Source

WORKLOAD = ("prompts", "prompt_tokens", "max_tokens", "num_blocks", "block_size")


def one_engine(row: dict) -> bool:
    return row.get("ranks", 1) == 1 and row.get("engines", 1) == 1


def series_name(row: dict) -> str:
    if row["server"] == CEILING:
        return "ceiling"
    if row["server"] == "vanilla":
        return "vanilla vLLM"
    return f"kvserve {row['policy']} B={row['budget']}"


def ceiling_pool_tokens(args: dict) -> int:
    """The pool `kvserve bench capacity --ceiling` gives the ceiling server: every request whole, in whole blocks."""
    per_request = -(-(args["prompt_tokens"] + args["max_tokens"]) // args["block_size"])
    return args["prompts"] * per_request * args["block_size"]


def throughput_points(sources: Iterable[Source]) -> dict[str, tuple[int, list[float]]]:
    """Series name -> (KV pool in tokens, each run's output tokens/s over its own vanilla's): the runs' rows of one
    workload pooled. Runs come from different days and CPUs (AMX, AVX-512, AVX2), whose speeds differ more than the
    servers do; a ratio to the vanilla measured in the same run divides the machine out, so only ratios pool. A run
    whose workload differs from the first's is refused (its throughput would not be a repeat)."""
    points: dict[str, tuple[int, list[float]]] = {}
    first = None
    for source in sources:
        args = source.data["args"]
        workload = tuple(args[key] for key in WORKLOAD)
        first = first or (workload, source.name)
        if workload != first[0]:
            raise ValueError(f"kvserve report: {source.name} ran {workload}, not {first[1]}'s workload {first[0]}")
        rows = list(filter(one_engine, source.data["results"]))
        (vanilla,) = [row["output_tokens_per_s"] for row in rows if row["server"] == "vanilla"]
        for row in rows:
            pool = ceiling_pool_tokens(args) if row["server"] == CEILING else args["num_blocks"] * args["block_size"]
            points.setdefault(series_name(row), (pool, []))[1].append(row["output_tokens_per_s"] / vanilla)
    return points


def band_label(name: str, runs: int) -> str:
    return f"{name} ({runs} runs, 95% band)" if runs > 1 else f"{name} (one run: no band)"


def throughput_plot(models: list[tuple[str, dict[str, tuple[int, list[float]]]]], path: Path) -> list:
    """Output tokens/s, as a multiple of vanilla's at its pool in the same run, against the KV pool, one panel per
    model: vanilla's line from its pool (1 by construction) to the ceiling's (what memory alone buys it), the ceiling
    as a horizontal line, each kvserve setting at vanilla's pool; bands and error bars are 95% intervals over the
    runs, absent where a series ran once (its label says so). Returns the panels (matplotlib Axes), which a test
    reads."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 6), squeeze=False)
    for ax, (model, points) in zip(axes[0], models, strict=True):
        vanilla, ceiling = points["vanilla vLLM"], points.get("ceiling")
        line = [vanilla, *([ceiling] if ceiling else [])]
        pools = [pool for pool, _ in line]
        stats = [mean_interval(runs) for _, runs in line]
        ax.plot(pools, [s[0] for s in stats], "o-", color="grey", label=band_label("vanilla vLLM", len(vanilla[1])))
        if all(len(values) > 1 for _, values in line):
            ax.fill_between(pools, [s[1] for s in stats], [s[2] for s in stats], color="grey", alpha=0.2)
        if ceiling:
            mean, low, high = mean_interval(ceiling[1])
            label = band_label(f"ceiling: vanilla, a pool for every request ({ceiling[0]:,} tokens)", len(ceiling[1]))
            ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=label)
            if len(ceiling[1]) > 1:
                ax.axhspan(low, high, color="black", alpha=0.08)
        kvserve = sorted(name for name in points if name.startswith("kvserve"))
        for index, name in enumerate(kvserve):
            pool, values = points[name]
            pool *= 1 + 0.05 * index  # side by side at the same pool, so their bars do not overlap
            mean, low, high = mean_interval(values)
            colour = plt.get_cmap("tab10")(index)
            ax.plot([pool], [mean], "s", color=colour, label=band_label(name, len(values)))
            if len(values) > 1:  # the interval as a bar and a band, a short span at its pool
                ax.errorbar([pool], [mean], yerr=[[mean - low], [high - mean]], fmt="none", color=colour, capsize=4)
                ax.fill_between([pool * 0.98, pool * 1.02], [low] * 2, [high] * 2, color=colour, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(pools, [f"{pool:,}" for pool in pools])
        ax.minorticks_off()
        ax.set_xlabel("KV pool, tokens (log scale)")
        ax.set_ylabel("output tokens/s, x vanilla vLLM's in the same run")
        ax.set_title(f"{model}: the decode-heavy workload")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    save(fig, path)
    return list(axes[0])


def ttft_points(rows: list[dict]) -> dict[str, list[tuple[int, list[float]]]]:
    """Setting -> [(prompt length, each case's TTFT in s)], lengths ascending."""
    by: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        name = "full" if row["policy"] == "full" else f"{row['policy']} B={row['budget']}, every chunk"
        by.setdefault(name, {}).setdefault(row["length"], []).append(row["ttft_s"])
    return {name: sorted(lengths.items()) for name, lengths in by.items()}


def ttft_plot(rows: list[dict], path: Path, title: str):
    """Mean TTFT against prompt length per setting, a 95% band over each length's cases; a length with one case is
    a point without band (the title says which). Returns the Axes, which a test reads."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    single: set[int] = set()
    for index, (name, points) in enumerate(ttft_points(rows).items()):
        lengths = [length for length, _ in points]
        stats = [mean_interval(values) for _, values in points]
        single |= {length for length, values in points if len(values) == 1}
        colour = plt.get_cmap("tab10")(index)
        ax.plot(lengths, [s[0] for s in stats], "o-", color=colour, label=name)
        ax.fill_between(lengths, [s[1] for s in stats], [s[2] for s in stats], color=colour, alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (log scale)")
    ax.set_ylabel("time to first token, s (mean over cases)")
    note = f"; one case at {', '.join(f'{n:,}' for n in sorted(single))} tokens: no band" if single else ""
    ax.set_title(f"{title}\n95% bands over the cases{note}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)
    return ax
