"""What does each policy cost? Per output token with nothing evicted (the scores alone, and kvserve with eviction
off against vanilla vLLM), per token and per compaction with eviction on, and the cache operations per CPU layout."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.markdown import ratio, table
from kvserve.tools.report.sources import DataDir, Source
from kvserve.tools.report.throughput import setting_name, workload

# kvserve's CPU kernel (the default) and the PyTorch path it replaced (`--cpu-kernel off`), then earlier runs
OVERHEAD = ("costs/overhead-kernel.json", "costs/overhead-pytorch.json", "bench-overhead-amx.json")
EVICTING = ("costs/evicting-kernel.json", "costs/evicting.json")  # the second: before the kernel (2026-11-25)
DECODE_HEAVY_H2O = "costs/decode-heavy-h2o.json"
KERNEL_OPS = "costs/kernel-ops.json"
LAYOUTS = ("layouts/layouts-1000.json", "layouts/layouts-3000.json")


def paired_overhead_table(kernel: Source, pytorch: Source) -> str:
    """Each policy run both ways: its decode step (TPOT p50) and prefill (TTFT p50) against kvserve `full` of the
    same run."""

    def ratios(source: Source) -> dict[str, tuple[str, str]]:
        results = source.data["results"]
        full = next(r for r in results if r["server"] == "kvserve" and r["policy"] == "full")
        return {
            r["policy"]: (ratio(r["tpot_p50"], full["tpot_p50"]), ratio(r["ttft_p50"], full["ttft_p50"]))
            for r in results
            if r["server"] == "kvserve" and r["policy"] != "full"
        }

    with_kernel, without = ratios(kernel), ratios(pytorch)
    rows = [
        [f"`{policy}`", with_kernel[policy][0], without[policy][0], with_kernel[policy][1], without[policy][1]]
        for policy in with_kernel
        if policy in without
    ]
    headers = ["policy", "decode step vs `full`, kernel", "the same, PyTorch path", "TTFT vs `full`, kernel"]
    return table([*headers, "the same, PyTorch path"], rows)


def kernel_ops_table(source: Source) -> str:
    """`kvserve bench kernel`: the kernel against vLLM's op on the same rows, and against vLLM's op plus the PyTorch
    statistics pass it replaced."""
    rows = []
    for row in source.data["results"]:
        both = row["vllm_ms"] + row["pytorch_sums_ms"]
        rows.append(
            [
                row["case"],
                f"{row['vllm_ms']:.3f}",
                f"{row['kernel_ms']:.3f}",
                f"{row['kernel_sums_ms']:.3f}",
                ratio(row["kernel_sums_ms"], row["vllm_ms"]),
                f"{both:.3f}",
                ratio(row["kernel_sums_ms"], both),
            ]
        )
    headers = ["rows of one layer", "vLLM's op ms", "kernel ms", "kernel + column sums ms", "vs vLLM's op"]
    return table([*headers, "vLLM's op + PyTorch sums ms", "kernel + sums vs that"], rows)


def paired_evicting_table(kernel: Source, pytorch: Source) -> str:
    """Each policy at B=128 with the kernel and before it: output tokens/s against its own run's vanilla, and the
    time per compaction."""

    def cells(source: Source) -> dict[str, tuple[str, str]]:
        results = source.data["results"]
        vanilla = next(r for r in results if r["server"] == "vanilla")
        return {
            r["policy"]: (
                ratio(r["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
                f"{1000 * r['compaction_seconds'] / r['compactions']:.0f}" if r["compactions"] else "-",
            )
            for r in results
            if r["server"] == "kvserve"
        }

    with_kernel, without = cells(kernel), cells(pytorch)
    rows = [
        [f"`{policy}`", with_kernel[policy][0], without.get(policy, ("-",))[0], with_kernel[policy][1]]
        + [without.get(policy, ("-", "-"))[1]]
        for policy in with_kernel
    ]
    headers = ["policy", "output tok/s vs vanilla, kernel", "the same, PyTorch path", "ms per compaction, kernel"]
    return table([*headers, "the same, PyTorch path"], rows)


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
    evicting = [data.load(name) for name in EVICTING]
    decode_heavy = data.load(DECODE_HEAVY_H2O)
    layouts = [data.load(name) for name in LAYOUTS]
    parts = [
        "## What does each policy cost?",
        "H2O, EMS and MAT read statistics of every decode step's attention (column sums over the whole cache, "
        "MAT the logits to the first key); by default kvserve's CPU kernel computes their rows' attention and "
        "those statistics in one pass, where before vLLM's kernel computed the attention and a PyTorch pass read "
        "the keys again (`--cpu-kernel off`, or `KVSERVE_CPU_KERNEL=0`, "
        "restores that path; see [the CPU kernel](architecture.md#the-cpu-kernel)). The same policy both ways, each "
        "against kvserve `full` of its own run:",
        paired_overhead_table(overhead[0], overhead[1]),
        "The kernel alone against vLLM's op on the same rows of one layer (`kvserve bench kernel`, one thread as in "
        "vLLM's CPU worker here; each output checked against vLLM's before it is timed):",
        kernel_ops_table(data.load(KERNEL_OPS)),
        data.load(KERNEL_OPS).caption(),
        "### With nothing evicted",
        "kvserve with eviction off against vanilla vLLM, and each policy computing its scores with a budget above "
        "every sequence (so nothing is evicted and the work is the same for all): the price of the statistics.",
    ]
    for source in overhead:
        parts += [workload(source).split("; a pool")[0] + ".", overhead_table(source), source.caption()]
    parts += [
        "### With eviction on",
        "Each policy at B=128, a pool that holds every request (no memory pressure: the cost alone). Decoding "
        "reads fewer entries once a request is compacted; a compaction scores the cache and moves the kept pages. "
        "With the kernel, and before it (2026-11-25, the same workload on a machine of the same type; each against "
        "vanilla of its own run):",
        paired_evicting_table(evicting[0], evicting[1]),
    ]
    for source in evicting:
        parts += [workload(source), evicting_table(source), source.caption()]
    parts += [
        "### H2O against SnapKV, decode-heavy at 8x",
        "The decode-heavy workload (16 prompts of 1,500 tokens, 256 output tokens, a pool that holds 2 of them "
        "without eviction) at B=188, where H2O's rows run through the kernel every step and SnapKV's through "
        "vLLM's op.",
        workload(decode_heavy),
        evicting_table(decode_heavy),
        decode_heavy.caption(),
        "### Cache operations per CPU layout",
        "On Intel AMX machines vLLM stores the cache in its AMX layout; kvserve reads and compacts it in place. "
        "The operations on both layouts, one process (`kvserve bench layouts`):",
        layouts_table(layouts),
        *(source.caption() for source in layouts),
    ]
    return "\n\n".join(parts)
