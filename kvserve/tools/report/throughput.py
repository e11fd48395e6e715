"""How much faster is it at the same memory? The capacity benchmarks (`kvserve bench capacity`: every server gets
the same KV pool, requests all sent at once) and multi-turn chat with prefix caching (`kvserve bench chat`), each
against vanilla vLLM measured in the same run."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.__main__ import CEILING
from kvserve.tools.bench.__main__ import plot as capacity_plot
from kvserve.tools.bench.chat import plot as chat_plot
from kvserve.tools.markdown import ratio, table
from kvserve.tools.report import tensor_parts
from kvserve.tools.report.sources import DataDir, Source, captions

DECODE_HEAVY = ("suite/capacity-duo.json", "capacity-decode-heavy.json")
PREFILL_HEAVY = "capacity/prefill-heavy.json"
CHAT = "chat/chat.json"
SPECULATIVE = "speculative.json"
# the same workload with every server held to as many running requests as vanilla fits (`--max-num-seqs`): what
# speculation gives each step when the steps' batches are alike
SPECULATIVE_FEW = "speculative-few-running.json"
# documents long enough that the pool limits vanilla's concurrency (where eviction pays): the section leads with it
SPECULATIVE_LONG = "speculative-long-documents.json"
# models/capacity-gemma3-tiny-3000.json (2026-11-25, kvserve 0.1, a random-weight hybrid model) stays in docs/eval
# the decode-heavy workload at equal KV bytes on a bf16 and an fp8 cache: two runs, each against its own vanilla
FP8_CAPACITY = ("fp8/decode-heavy-bf16.json", "fp8/decode-heavy-fp8.json")
# Tensor parallelism: the page shows the rounds protocol (tensor_parts.ROUNDS, 2026-11-29, kvserve 0.25: every server
# kept up, the workload sent to each in turn over several rounds), which replaced the single runs of tp/*.json before
# it (decode-heavy-tp, qwen05-tp, their -ceiling runs and the per-part runs): one run each, on machines whose speed
# drifted between servers. Those files stay in docs/eval; git has the page that showed them.


def setting_name(row: dict) -> str:
    if row["server"] == CEILING:
        return "vanilla, pool for every request (compute ceiling)"
    if row["server"] == "vanilla":
        return "vanilla vLLM"
    if row["policy"] == "full":
        return "kvserve `full` (eviction off)"
    policy, deferred, _ = row["policy"].partition("/pressure")  # the label of a kv_evict_when=pressure setting
    policy, _, checkpoint = policy.partition("/checkpoint")  # ... and of a kv_checkpoint setting
    name = f"`{policy}`" + (f" B={row['budget']}" if row.get("budget") else "")
    allocation = row.get("allocation")
    name += f" {allocation}" if allocation and allocation != "uniform" else ""
    name += f", `kv_checkpoint={checkpoint.lstrip('-')}`" if checkpoint else ""
    name += ", every chunk" if row.get("evict_every_chunk") else ""
    return name + (", `kv_evict_when=pressure`" if deferred else "")


def capacity_table(source: Source) -> str:
    """One row per server and setting: requests the pool holds, what ran at once, throughput against vanilla."""
    results = source.data["results"]
    vanilla = next(r for r in results if r["server"] == "vanilla")
    limits = any("pool_limit" in r for r in results)
    headers = ["setting", *(["pool holds"] if limits else []), "peak running", "output tok/s", "vs vanilla"]
    rows = [
        [
            setting_name(row),
            *([str(row["pool_limit"])] if limits else []),
            f"{row['peak_running']:.0f}",
            f"{row['output_tokens_per_s']:.1f}",
            ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
            f"{row['ttft_p50']:.1f}",
            f"{row['tpot_p50']:.3f}",
            f"{row['preemptions']:.0f}",
        ]
        for row in results
    ]
    return table([*headers, "TTFT p50 s", "TPOT p50 s", "preemptions"], rows)


def paired_capacity_table(column: str, runs: list[tuple[str, Source]]) -> str:
    """Vanilla and kvserve in each of several runs that differ in one engine setting (`column`: its value per run):
    each server against the first run's vanilla, and against the vanilla of its own run (measured beside it)."""
    baseline = next(r for r in runs[0][1].data["results"] if r["server"] == "vanilla")
    rows = []
    for value, source in runs:
        results = [r for r in source.data["results"] if r["server"] in ("vanilla", CEILING, "kvserve")]
        vanilla = next(r for r in results if r["server"] == "vanilla")
        for row in results:
            rows.append(
                [
                    setting_name(row),
                    value,
                    "every request's" if row["server"] == CEILING else str(source.data["args"]["num_blocks"]),
                    f"{row['peak_running']:.0f}",
                    f"{row['output_tokens_per_s']:.1f}",
                    ratio(row["output_tokens_per_s"], baseline["output_tokens_per_s"]),
                    ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
                    f"{row['tpot_p50']:.3f}",
                    f"{row['preemptions']:.0f}",
                ]
            )
    first = runs[0][0]
    headers = ["setting", column, "pool, blocks", "peak running", "output tok/s", f"vs vanilla, {column} {first}"]
    return table([*headers, "vs vanilla, same run", "TPOT p50 s", "preemptions"], rows)


def ceiling_line(source: Source) -> str:
    """What kvserve served against the compute ceiling measured in the same run (where the run has one)."""
    results = source.data["results"]
    ceiling = next((r for r in results if r["server"] == CEILING), None)
    if ceiling is None:
        return ""
    parts = [
        f"{setting_name(r)} {r['output_tokens_per_s'] / ceiling['output_tokens_per_s']:.2f}x"
        for r in results
        if r["server"] == "kvserve"
    ]
    return (
        f"Against the compute ceiling of the same run ({ceiling['output_tokens_per_s']:.1f} output tokens/s): "
        + ", ".join(parts)
        + "."
    )


def tensor_table(source: Source, size: str = "ranks") -> str:
    """Each server at each tensor-parallel size (`kvserve bench capacity --tensor-sizes`), or data-parallel size
    (`--data-parallel-sizes`, size `engines`): against vanilla at the first size, against vanilla at its own size,
    and against itself at the first size (how it scales)."""
    results = source.data["results"]
    first = min(r.get(size, 1) for r in results)
    baseline = next(r for r in results if r["server"] == "vanilla" and r.get(size, 1) == first)
    rows = []
    for row in results:
        vanilla = next(r for r in results if r["server"] == "vanilla" and r.get(size, 1) == row.get(size, 1))
        same = (row["server"], row["policy"], row["budget"])
        own = next(r for r in results if r.get(size, 1) == first and (r["server"], r["policy"], r["budget"]) == same)
        rows.append(
            [
                setting_name(row),
                str(row.get(size, 1)),
                f"{row['peak_running']:.0f}",
                f"{row['output_tokens_per_s']:.1f}",
                ratio(row["output_tokens_per_s"], baseline["output_tokens_per_s"]),
                ratio(row["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
                ratio(row["output_tokens_per_s"], own["output_tokens_per_s"]),
                f"{row['tpot_p50']:.3f}",
                f"{row['preemptions']:.0f}",
            ]
        )
    headers = ["setting", size, "peak running", "output tok/s", f"vs vanilla, {size} {first}"]
    headers += [f"vs vanilla, same {size}", f"vs itself, {size} {first}", "TPOT p50 s", "preemptions"]
    return table(headers, rows)


def workload(source: Source) -> str:
    args = source.data["args"]
    return (
        f"{args['prompts']} requests of {args['prompt_tokens']:,} prompt and {args['max_tokens']} output tokens at "
        f"once; a pool of {args['num_blocks']} blocks of {args['block_size']} tokens each server; {args['model']}."
    )


def _turns_ratio(evicting: dict, full: dict) -> float:
    """Median over turns 2.. of the per-turn TTFT p50 ratio."""
    ratios = sorted(
        e["ttft_p50"] / f["ttft_p50"] for e, f in zip(evicting["turns"][1:], full["turns"][1:], strict=True)
    )
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def chat_workload(source: Source) -> str:
    """A chat benchmark's conversations, as the page describes them for each model."""
    args = source.data["args"]
    return (
        f"{args['conversations']} conversations of {args['turns']} turns sharing a {args['doc_tokens']:,}-token "
        f"document, {args['user_tokens']}-token user turns, {args['reply_tokens']}-token replies"
    )


def chat_table(source: Source) -> str:
    results = source.data["results"]
    rows = []
    for pool in dict.fromkeys(r["pool"] for r in results):
        runs = [r for r in results if r["pool"] == pool]
        vanilla = next(r for r in runs if r["server"] == "vanilla")
        full = next((r for r in runs if r["server"] != "vanilla" and r["policy"] == "full"), None)
        for run in runs:
            later = [r for r in run["requests"] if r["turn"] > 1]
            hits = sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
            ttft = f"{_turns_ratio(run, full):.2f}x" if full is not None and run["server"] != "vanilla" else "-"
            rows.append(
                [
                    pool,
                    setting_name(run),
                    f"{run['output_tokens_per_s']:.1f}",
                    ratio(run["output_tokens_per_s"], vanilla["output_tokens_per_s"]),
                    f"{hits:.2f}",
                    ttft,
                    f"{run['checkpoint_hits']:.0f} / {len(later)}" if run.get("checkpoints_published") else "-",
                    f"{run['preemptions']:.0f}",
                ]
            )
    headers = ["pool", "server", "output tok/s", "vs vanilla", "prefix hit rate, turns 2+"]
    ttft = "TTFT p50 vs kvserve `full`, turns 2+ (median)"
    return table([*headers, ttft, "turns 2+ resumed from a checkpoint", "preemptions"], rows)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    newest, sweep = (data.load(name) for name in DECODE_HEAVY)
    prefill = data.load(PREFILL_HEAVY)
    chat = data.load(CHAT)
    fp8_plain, fp8 = (data.load(name) for name in FP8_CAPACITY)
    capacity_plot(sweep.data["results"], sweep.data["args"]["prompt_tokens"], str(plots / "decode-heavy.png"))
    chat_plot(chat.data["results"], str(plots / "chat.png"))
    args = chat.data["args"]
    return "\n\n".join(
        [
            "## How much faster is it at the same memory?",
            f"![throughput and concurrency against compression]({plot_link}/decode-heavy.png)",
            "Every server gets the same KV pool; kvserve fits more requests in it by evicting, which pays where "
            "decoding dominates, and can pass the compute ceiling (vanilla with a pool for every request): its "
            "decode steps read at most B + one block a list. Compare ratios within a table: machines drift day to "
            "day.",
            "### Decode-heavy at 8x",
            workload(newest),
            capacity_table(newest),
            # the figure above draws this table: it stays folded
            "<details><summary>The same benchmark across budgets (4x, 8x, 16x), as drawn</summary>\n\n"
            f"{capacity_table(sweep)}\n\n</details>",
            captions([newest, sweep]),
            "### Decode-heavy at 8x on an fp8 cache",
            "The same workload with `--kv-cache-dtype fp8` for both servers in the bf16 pool's bytes (twice the "
            "blocks). " + workload(fp8_plain).replace("a pool of", "bf16 pool:"),
            paired_capacity_table("cache", [("bf16", fp8_plain), ("fp8", fp8)]),
            ceiling_line(fp8),
            captions([fp8_plain, fp8]),
            tensor_parts.rounds_section(data.load),
            "### Prefill-heavy",
            workload(prefill),
            capacity_table(prefill),
            prefill.caption(),
            "### Multi-turn chat with prefix caching",
            f"![TTFT and throughput per turn]({plot_link}/chat.png)",
            f"{chat_workload(chat)}; a default pool and a small one of {args['small_pool_blocks']} blocks of "
            f"{args['block_size']} tokens. Eager eviction compacts at each prompt's end, so the next turn recomputes "
            "the reply; `kv_evict_when=pressure` serves as `full` until the pool is short; `kv_checkpoint=turns` "
            "(`=128`: every 128 tokens) compacts where each turn's prompt ends and the next turn resumes there.",
            chat_table(chat),
            chat.caption(),
            *speculative_part(data),
        ]
    )


def speculative_part(data: DataDir) -> list[str]:
    """`kvserve bench speculative`: n-gram speculative decoding with and without eviction at equal memory. Long
    documents first (the pool binds vanilla there); the shorter documents' runs folded below them."""
    from kvserve.tools.bench.speculative import report

    runs = [
        data.load(name) for name in (SPECULATIVE_LONG, SPECULATIVE, SPECULATIVE_FEW) if (data.folder / name).exists()
    ]
    if not runs:
        return []
    lead, *others = runs
    parts = [
        "### Speculative decoding (n-gram) with eviction",
        f"{speculative_workload(lead.data['args'])} In float32 kvserve's greedy answers with speculation are those "
        "without it (tests/test_speculative.py); in bfloat16 a verify step rounds differently, which can tip a "
        "compaction (last column).",
        report(lead.data["results"]),
        lead.caption(),
    ]
    for other in others:
        args = other.data["args"]
        extra = f", every server started with `{args['server_args']}`" if args["server_args"] else ""
        parts.append(
            f"<details><summary>{args['doc_tokens']}-token documents{extra}</summary>\n\n"
            f"{speculative_workload(args)}\n\n{report(other.data['results'])}\n\n{other.caption()}\n\n</details>"
        )
    return parts


def speculative_workload(args: dict) -> str:
    return (
        f"{args['prompts']} requests at once, each a {args['doc_tokens']}-token document and the instruction to "
        f"repeat it ({args['max_tokens']} output tokens, greedy), so prompt lookup drafts from the document; a pool "
        f"of {args['num_blocks']} blocks of {args['block_size']} tokens for every server ({args['policy']} "
        f"B={args['budget']} on kvserve's)."
    )
