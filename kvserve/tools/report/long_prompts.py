"""Long prompts through a bounded cache: full against eviction after every prefill chunk on the second model, time
to first token against prompt length, the pages a request held, and the answers (`kvserve bench long`)."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.long_prompts import phase_table, plot, report
from kvserve.tools.markdown import table
from kvserve.tools.report.sources import DataDir
from kvserve.tools.report.throughput import capacity_table

# the lengths up to 16k, then 32k (fewer cases: a full 32k-token prefill takes minutes on 2 cores), same settings
LONG = ("long/qwen05.json", "long/qwen05-32k.json")
# several 16k-token requests in a pool that holds two of them without eviction, vanilla vLLM in the same run
CAPACITY = "long/capacity-16k.json"
TITLE = "## Long prompts through a bounded cache"
# every-chunk eviction in transformers, the server's rules and the question's (python -m kvserve.tools.eval.streaming)
STREAMING = ("long/streaming-8k.json", "long/streaming-16k.json", "long/streaming-32k.json")
# the question's votes served (kv_lookahead with snapkv_keydiff), full beside it in the same run
LOOKAHEAD = ("long/lookahead-16k.json", "long/lookahead-32k.json")


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sources = [data.load(name) for name in LONG]
    capacity = data.load(CAPACITY)
    args = sources[0].data["args"]
    rows = [row for source in sources for row in source.data["results"]]
    plot(rows, str(plots / "long-prompts.png"))
    per_list = args["block_size"] / (args["layers"] * args["kv_heads"])
    policies = ", ".join(f"`{policy}`" for policy in args["policy"].split(","))
    return "\n\n".join(
        [
            TITLE,
            f"One request at a time on {args['model']}, prefill chunks of {args['chunk']:,} tokens "
            f"(`--max-num-batched-tokens`), blocks of {args['block_size']}: `full` computes each chunk against the "
            f"whole prompt so far, while {policies} with `kv_evict_every_chunk` compacts every list back to B "
            "after each chunk, so a chunk attends to at most B + itself and the prompt's attention grows linearly. "
            f"{cases(sources)}; TTFT and TPOT are medians over them, the scores means with their counts (1 = every "
            "answer right). Peak entries / list: the most pages the server reported while a request ran (alone), as "
            "entries per (layer, KV head) list, in use (`kvserve:kv_pages_in_use`: pages holding kept entries) and "
            "allocated (`vllm:kv_cache_usage_perc`: whole blocks, a chunk's included before it is written); the "
            "bound is B + one chunk + one block. Polled every 0.2 s, so a momentary peak inside a step can fall "
            "between polls.",
            report(rows, per_list, args["chunk"], args["block_size"]),
            f"![TTFT against prompt length]({plot_link}/long-prompts.png)",
            f"Where the engine's time went at {max(r['length'] for r in rows):,} tokens (seconds, medians; "
            "`kvserve:engine_seconds_total` by phase around each request; model = worker less the rest):",
            phase_table(rows),
            *(source.caption() for source in sources),
            *streaming_study(data),
            *served_lookahead(data),
            "### Several long prompts in a small pool",
            f"{capacity_workload(capacity)} Vanilla runs two at a time; with eviction after every chunk each request "
            "holds at most B + one chunk + one block entries a list, so all of them run at once.",
            capacity_table(capacity),
            capacity.caption(),
        ]
    )


def capacity_workload(source) -> str:
    args = source.data["args"]
    return (
        f"{args['prompts']} requests of {args['prompt_tokens']:,} prompt tokens and {args['max_tokens']} output tokens "
        f"on {args['model']}, sent at once, in a pool of {args['num_blocks']} blocks of {args['block_size']} tokens "
        f"for both servers (it holds two of them whole), engine flags `{args['server_args']}` for both."
    )


def cases(sources: list) -> str:
    """How many cases of each task ran at which lengths ("2 cases at 4,000-16,000 tokens, 1 at 32,000")."""
    parts = []
    for source in sources:
        lengths = sorted({row["length"] for row in source.data["results"]})
        span = f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}-{lengths[-1]:,}"
        count, tasks = source.data["args"]["samples"], source.data["args"]["tasks"].replace(",", ", ")
        parts.append(f"{count} case{'s' * (count > 1)} of each of {tasks} at {span} tokens")
    return ", ".join(parts)


def streaming_study(data: DataDir) -> list[str]:
    """The reference study of what keeps a needle while the prompt streams in: one row per case, per rule its score
    and the share of the needle's entries the deeper half of the layers held when decoding began."""
    studies = [data.load(name) for name in STREAMING]
    rows = [row for study in studies for row in study.data["results"]]
    args = studies[0].data["args"]
    scorers = list(dict.fromkeys(row["scorer"] for row in rows))
    studied = list(dict.fromkeys((row["task"], row["length"], row["index"]) for row in rows))
    cells = []
    for task, length, index in studied:
        by_rule = {r["scorer"]: r for r in rows if (r["task"], r["length"], r["index"]) == (task, length, index)}
        first = next(iter(by_rule.values()))
        scores = []
        for rule in scorers:
            row = by_rule.get(rule)
            if row is None:
                scores.append("-")
                continue
            deep = row["needle_kept"][len(row["needle_kept"]) // 2 :]
            kept = "" if rule == "full" else f" ({100 * sum(deep) / len(deep):.0f}% kept)"
            scores.append(f"{row['score']:.2f}{kept}")
        cells.append([task, f"{length:,}", f"#{index}", f"{first['needle_at']:,}", *scores])
    for task in dict.fromkeys(task for task, _, _ in studied):
        totals = []
        for rule in scorers:
            scored = [r["score"] for r in rows if r["task"] == task and r["scorer"] == rule]
            totals.append(f"**{sum(score >= 1.0 for score in scored)} of {len(scored)}** right")
        cells.append([f"{task}, all", "", "", "", *totals])
    headers = ["task", "tokens", "case", "needle at", *(f"`{rule}`" for rule in scorers)]
    return [
        "### What keeps the needle: a reference study",
        f"The same every-chunk eviction computed in transformers on {args['model']} "
        f"(`python -m kvserve.tools.eval.streaming`: chunks of {args['chunk']:,}, B={args['budget']}, kvserve's own "
        "policy classes choosing), to try rules before serving them. `lookahead`: SnapKV's votes cast by "
        f"the question's queries, the prompt's last {args['tail']} tokens run alone at their own positions before "
        "the document streams in (a server holds the whole prompt when it admits it); `mix`: each entry's better "
        "percentile rank under `lookahead` and `keydiff` (the policy `snapkv_keydiff`; the server runs both as "
        "`kv_lookahead`, next section). Per rule: the answer's score and, in brackets, the share "
        "of the needle's entries (the answer's first appearance, 5 tokens before to 20 after) that the deeper half "
        "of the layers held when decoding began.",
        table(headers, cells),
        *(study.caption() for study in studies),
    ]


def served_lookahead(data: DataDir) -> list[str]:
    """`kv_lookahead` served: full against the question's votes every chunk, one server, the same cases."""
    sources = [data.load(name) for name in LOOKAHEAD]
    args = sources[0].data["args"]
    rows = [row for source in sources for row in source.data["results"]]
    per_list = args["block_size"] / (args["layers"] * args["kv_heads"])
    return [
        "### Served: the question's votes while the prompt streams in (`kv_lookahead`)",
        f"`kvserve bench long --lookahead {args['lookahead']}` on {args['model']}: `{args['policy']}` with "
        f"`kv_evict_every_chunk` and `kv_lookahead={args['lookahead']}`, span {args['span']}: the server first runs "
        f"the prompt's last {args['lookahead']} tokens alone (one token generated), then compacts every "
        f"{args['chunk']:,}-token chunk by their queries' votes or KeyDiff's rank, whichever is better. Its TTFT "
        f"includes the question's own run. {cases(sources)}; columns as above.",
        report(rows, per_list, args["chunk"], args["block_size"]),
        *(source.caption() for source in sources),
    ]
