"""Long prompts through a bounded cache: full against eviction after every prefill chunk on the second model, time
to first token against prompt length, the pages a request held, and the answers (`kvserve bench long`)."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.long_prompts import report
from kvserve.tools.report.figures import ttft_plot
from kvserve.tools.report.sources import DataDir, captions
from kvserve.tools.report.throughput import capacity_table

# the lengths up to 16k, then 32k (fewer cases: a full 32k-token prefill takes minutes on 2 cores), same settings
LONG = ("long/qwen05.json", "long/qwen05-32k.json")
# several 16k-token requests in a pool that holds two of them without eviction, vanilla vLLM in the same run
CAPACITY = "long/capacity-16k.json"
TITLE = "## Long prompts through a bounded cache"
PLOT = "long-prompts.png"  # also the page's opening figure (c)
# long/streaming-*.json (a transformers study of which rule keeps the needle, to try rules before serving them) is not
# shown: the rule it chose is served and measured in LOOKAHEAD, which answers the same question on the server
# the question's votes served (kv_lookahead with snapkv_keydiff), full beside it in the same run
LOOKAHEAD = ("long/lookahead-16k.json", "long/lookahead-32k.json")


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sources = [data.load(name) for name in LONG]
    capacity = data.load(CAPACITY)
    args = sources[0].data["args"]
    rows = [row for source in sources for row in source.data["results"]]
    ttft_plot(rows, plots / PLOT, f"{args['model']}: TTFT against prompt length, one request at a time")
    per_list = args["block_size"] / (args["layers"] * args["kv_heads"])
    policies = ", ".join(f"`{policy}`" for policy in args["policy"].split(","))
    return "\n\n".join(
        [
            TITLE,
            f"![TTFT against prompt length]({plot_link}/{PLOT})",
            f"One request at a time on {args['model']}, prefill chunks of {args['chunk']:,} tokens: {policies} with "
            "`kv_evict_every_chunk` compacts every list back to B after each chunk, so a chunk attends to at most "
            f"B + itself (`full`: to the whole prompt so far). {cases(sources)}; TTFT and TPOT medians, scores means "
            "(cases). Peak entries / list: in use (`kvserve:kv_pages_in_use`) / allocated "
            "(`vllm:kv_cache_usage_perc`), polled every 0.2 s; bound: B + one chunk + one block.",
            # where the engine's time went by phase (phase_table) explains the TTFT column rather than deciding
            # anything: it stays in the files' rows (`kvserve bench long` prints it) and the metric's dashboard
            report(rows, per_list, args["chunk"], args["block_size"]),
            captions(sources),
            *served_lookahead(data),
            "### Several long prompts in a small pool",
            f"{capacity_workload(capacity)} Evicting every chunk, each holds at most B + one chunk + one block a "
            "list, so all run at once.",
            capacity_table(capacity),
            capacity.caption(),
        ]
    )


def capacity_workload(source) -> str:
    args = source.data["args"]
    return (
        f"{args['prompts']} requests of {args['prompt_tokens']:,} prompt and {args['max_tokens']} output tokens on "
        f"{args['model']} at once, a pool of {args['num_blocks']} blocks of {args['block_size']} for both servers "
        f"(two requests whole), `{args['server_args']}` for both."
    )


def cases(sources: list) -> str:
    """How many cases of each task ran at which lengths ("passkey, multikey_one: 2 cases each at 4,000-16,000
    tokens")."""
    parts = []
    for source in sources:
        lengths = sorted({row["length"] for row in source.data["results"]})
        span = f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}-{lengths[-1]:,}"
        count, tasks = source.data["args"]["samples"], source.data["args"]["tasks"].replace(",", ", ")
        parts.append(f"{tasks}: {count} case{'s' * (count > 1)} each at {span} tokens")
    return "; ".join(parts)


def served_lookahead(data: DataDir) -> list[str]:
    """`kv_lookahead` served: full against the question's votes every chunk, one server, the same cases."""
    sources = [data.load(name) for name in LOOKAHEAD]
    args = sources[0].data["args"]
    rows = [row for source in sources for row in source.data["results"]]
    per_list = args["block_size"] / (args["layers"] * args["kv_heads"])
    return [
        "### Served: the question's votes while the prompt streams in (`kv_lookahead`)",
        f"`{args['policy']}` with `kv_evict_every_chunk` and `kv_lookahead={args['lookahead']}` (span "
        f"{args['span']}) on {args['model']}: the server first runs the prompt's last {args['lookahead']} tokens "
        f"alone, then compacts every {args['chunk']:,}-token chunk by their queries' votes or KeyDiff's rank, "
        f"whichever is better; TTFT includes the question's run. {cases(sources)}; columns as above.",
        report(rows, per_list, args["chunk"], args["block_size"]),
        captions(sources),
    ]
