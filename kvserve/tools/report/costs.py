"""What does each policy cost? Per output token with nothing evicted (the scores alone, and kvserve with eviction
off against vanilla vLLM), per token and per compaction with eviction on, and the cache operations per CPU layout."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.markdown import ratio, table
from kvserve.tools.report.sources import DataDir, Source, captions
from kvserve.tools.report.throughput import setting_name, workload

# kvserve's CPU kernel (the default) and the PyTorch path it replaced (`--cpu-kernel off`), then earlier runs
# The latest runs (2026-11-27, kvserve 0.16, the CPU kernel on by default) and the same command with `--cpu-kernel off`
# beside them; they replace overhead.json and evicting.json (2026-11-25, 0.9, before the kernel) and
# bench-overhead-amx.json (2026-11-23, 0.1), the same question asked of older code. Those files stay in docs/eval.
OVERHEAD = ("costs/overhead-kernel.json", "costs/overhead-pytorch.json")
EVICTING = "costs/evicting-kernel.json"
DECODE_HEAVY_H2O = "costs/decode-heavy-h2o.json"
# costs/kernel-ops.json and layouts/*.json (one operation timed in one process, `kvserve bench kernel` and `kvserve
# bench layouts`) are for whoever changes the kernel or the layouts, not for choosing a policy: not on the page


def overhead_table(source: Source, pytorch: Source | None = None) -> str:
    """Each setting's output against vanilla vLLM, and its decode step (TPOT p50) and prefill (TTFT p50) against
    kvserve `full` of the same run; with `pytorch` (the same command with `--cpu-kernel off`), beside each policy that
    ran there the same two ratios on that path."""

    def against_full(results: list[dict]) -> dict[tuple[str, str], tuple[str, str]]:
        full = next(r for r in results if r["server"] == "kvserve" and r["policy"] == "full")
        return {
            (r["server"], r["policy"]): (ratio(r["tpot_p50"], full["tpot_p50"]), ratio(r["ttft_p50"], full["ttft_p50"]))
            for r in results
        }

    results = source.data["results"]
    vanilla = next(r for r in results if r["server"] == "vanilla")
    kernel = against_full(results)
    other = against_full(pytorch.data["results"]) if pytorch is not None else {}
    rows = []
    for row in results:
        key = (row["server"], row["policy"])
        scoring = row["server"] == "kvserve" and row["policy"] != "full"
        name = f"`{row['policy']}`" if scoring else setting_name(row)
        decode, prefill = kernel[key]
        paired = other.get(key, ("-", "-")) if scoring else ("-", "-")  # `full` and vanilla: the kernel's own run
        cells = [decode, paired[0], prefill, paired[1]] if pytorch is not None else [decode, prefill]
        out = f"{row['output_tokens_per_s']:.1f}"
        rows.append([name, out, ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]), *cells])
    path = ["the same, PyTorch path"] if pytorch is not None else []
    headers = ["setting", "output tok/s", "vs vanilla", "decode step vs `full`", *path, "TTFT vs `full`", *path]
    return table(headers, rows)


def evicting_table(source: Source) -> str:
    results = source.data["results"]
    vanilla = next(r for r in results if r["server"] == "vanilla")
    # ratios to vanilla of the same run only: its own tokens/s and TPOT are in the file
    rows = [
        [
            setting_name(row),
            ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
            ratio(row["tpot_p50"], vanilla["tpot_p50"]),
            f"{row['compactions']:.0f}",
            f"{1000 * row['compaction_seconds'] / row['compactions']:.0f}" if row["compactions"] else "-",
        ]
        for row in results
    ]
    headers = ["setting", "output tok/s vs vanilla", "TPOT vs vanilla", "compactions", "ms per compaction"]
    return table(headers, rows)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    overhead = [data.load(name) for name in OVERHEAD]
    evicting = data.load(EVICTING)
    decode_heavy = data.load(DECODE_HEAVY_H2O)
    parts = [
        "## What does each policy cost?",
        "H2O, EMS and MAT read every decode step's attention statistics (column sums over the cache; MAT the logits "
        "to the first key): kvserve's CPU kernel (the default) computes those rows' attention and statistics in one "
        "pass, where the PyTorch path (`--cpu-kernel off` or `KVSERVE_CPU_KERNEL=0`) reads the keys again "
        "([the CPU kernel](architecture.md#the-cpu-kernel)).",
        "### With nothing evicted",
        "Eviction off against vanilla vLLM, and each policy scoring with a budget above every sequence (nothing "
        "evicted): the price of the statistics, against kvserve `full` of the same run; the PyTorch columns: the "
        "kernel's policies with `--cpu-kernel off`. " + workload(overhead[0]).split("; a pool")[0] + ".",
        overhead_table(*overhead),
        captions(overhead),
    ]
    parts += [
        "### With eviction on",
        "Each policy at B=128 in a pool that holds every request: the cost alone (decoding reads fewer entries once "
        "compacted; a compaction scores the cache and moves the kept pages).",
        workload(evicting),
        evicting_table(evicting),
        evicting.caption(),
    ]
    parts += [
        "### H2O against SnapKV, decode-heavy at 8x",
        "H2O's rows run through the kernel every step, SnapKV's through vLLM's op. " + workload(decode_heavy),
        evicting_table(decode_heavy),
        decode_heavy.caption(),
    ]
    return "\n\n".join(parts)
