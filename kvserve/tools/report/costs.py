"""What does each policy cost? Per output token with nothing evicted (the scores alone, and kvserve with eviction
off against vanilla vLLM), per token and per compaction with eviction on, and the cache operations per CPU layout."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.report.markdown import ratio, table
from kvserve.tools.report.sources import DataDir, Source
from kvserve.tools.report.throughput import setting_name, workload

OVERHEAD = ("costs/overhead.json", "bench-overhead-amx.json")
EVICTING = "costs/evicting.json"
LAYOUTS = ("layouts/layouts-1000.json", "layouts/layouts-3000.json")


def overhead_table(source: Source) -> str:
    results = source.data["results"]
    vanilla = next(r for r in results if r["server"] == "vanilla")
    full = next(r for r in results if r["server"] == "kvserve" and r["policy"] == "full")
    rows = []
    for row in results:
        name = setting_name(row)
        if row["server"] == "kvserve" and row["policy"] != "full":
            name = f"`{row['policy']}`, scoring, nothing evicted"
        rows.append(
            [
                name,
                f"{row['output_tokens_per_s']:.1f}",
                ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
                f"{row['tpot_p50']:.3f}",
                ratio(row["tpot_p50"], full["tpot_p50"]),
                f"{row['ttft_p50']:.1f}",
            ]
        )
    headers = ["setting", "output tok/s", "vs vanilla", "TPOT p50 s", "TPOT vs kvserve `full`", "TTFT p50 s"]
    return table(headers, rows)


def evicting_table(source: Source) -> str:
    results = source.data["results"]
    vanilla = next(r for r in results if r["server"] == "vanilla")
    rows = [
        [
            setting_name(row),
            f"{row['output_tokens_per_s']:.1f}",
            ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
            f"{row['tpot_p50']:.3f}",
            ratio(row["tpot_p50"], vanilla["tpot_p50"]),
            f"{row['compactions']:.0f}",
            f"{1000 * row['compaction_seconds'] / row['compactions']:.0f}" if row["compactions"] else "-",
        ]
        for row in results
    ]
    headers = ["setting", "output tok/s", "vs vanilla", "TPOT p50 s", "TPOT vs vanilla", "compactions"]
    return table([*headers, "ms per compaction"], rows)


def layouts_table(sources: list[Source]) -> str:
    rows = [
        [
            f"{source.data['args']['tokens']:,}",
            row["operation"],
            f"{row['vec_ms']:.2f}",
            f"{row['amx_ms']:.2f}",
            ratio(row["amx_ms"], row["vec_ms"]),
            f"{row['amx staged_ms']:.2f}",
        ]
        for source in sources
        for row in source.data["results"]
    ]
    headers = ["entries", "operation", "vLLM's vec layout ms", "AMX layout, in place ms", "vs vec"]
    return table([*headers, "AMX staged ms"], rows)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    overhead = [data.load(name) for name in OVERHEAD]
    evicting = data.load(EVICTING)
    layouts = [data.load(name) for name in LAYOUTS]
    parts = [
        "## What does each policy cost?",
        "### With nothing evicted",
        "kvserve with eviction off against vanilla vLLM, and each policy computing its scores with a budget above "
        "every sequence (so nothing is evicted and the work is the same for all): the price of the statistics.",
    ]
    for source in overhead:
        parts += [workload(source).split("; a pool")[0] + ".", overhead_table(source), source.caption()]
    parts += [
        "### With eviction on",
        "Each policy at B=128, a pool that holds every request (no memory pressure: the cost alone). Decoding "
        "reads fewer entries once a request is compacted; a compaction scores the cache and moves the kept pages.",
        workload(evicting),
        evicting_table(evicting),
        evicting.caption(),
        "### Cache operations per CPU layout",
        "On Intel AMX machines vLLM stores the cache in its AMX layout; kvserve reads and compacts it in place. "
        "The operations on both layouts, one process (`kvserve bench layouts`):",
        layouts_table(layouts),
        *(source.caption() for source in layouts),
    ]
    return "\n\n".join(parts)
