"""Where a tensor-parallel gain goes: the same work on vanilla vLLM and kvserve, one part of a workload at a time
(decode alone, prefill alone, decode over long prompts compacted once), each a `kvserve bench capacity
--tensor-sizes 1,2` run of its own. At equal memory vanilla and kvserve do different work (vanilla preempts and
recomputes, kvserve runs more requests at once over shorter lists), so their gains there mix what a second rank
speeds up with how much of each part a server has left."""

from __future__ import annotations

from kvserve.phases import model_seconds
from kvserve.tools.markdown import table
from kvserve.tools.report.sources import Source

# (file, what it isolates) in the order the page lists them
PARTS = (
    ("tp/qwen05-tp-decode-only.json", "decode alone"),
    ("tp/qwen05-tp-prefill-only.json", "prefill alone"),
    ("tp/qwen05-tp-long-decode.json", "decode over compacted prompts"),
)
# the last part's command run once more, earlier the same day, on the same machine
REPEAT = "tp/qwen05-tp-long-decode-earlier.json"


def kvserve_by_ranks(source: Source) -> list[dict]:
    """kvserve's rows of a `--tensor-sizes` result, fewest ranks first."""
    return sorted((r for r in source.data["results"] if r["server"] == "kvserve"), key=lambda r: r["ranks"])


def gain(results: list[dict], server: str, ranks: int = 2) -> float:
    """A server's output tokens/s at `ranks` over its own at one rank."""
    by_ranks = {r["ranks"]: r["output_tokens_per_s"] for r in results if r["server"] == server}
    return by_ranks[ranks] / by_ranks[1]


def gains(source: Source) -> str:
    results = source.data["results"]
    vanilla, kvserve = gain(results, "vanilla"), gain(results, "kvserve")
    return f"vanilla gained {vanilla:.2f}x from its second rank and kvserve {kvserve:.2f}x."


def parts_table(sources: list[tuple[Source, str]]) -> str:
    rows = []
    for source, part in sources:
        args, results = source.data["args"], source.data["results"]
        setting = f"{args['prompts']} x {args['prompt_tokens']:,} prompt + {args['max_tokens']} output tokens"
        for server in ("vanilla", "kvserve"):
            at = {r["ranks"]: r for r in results if r["server"] == server}
            label = "vanilla vLLM" if server == "vanilla" else f"kvserve `{at[1]['policy']}` B={at[1]['budget']}"
            rows.append(
                [
                    part,
                    setting,
                    label,
                    f"{at[1]['output_tokens_per_s']:.1f}",
                    f"{at[2]['output_tokens_per_s']:.1f}",
                    f"{gain(results, server):.2f}x",
                    f"{at[1]['tpot_p50']:.3f} / {at[2]['tpot_p50']:.3f}",
                ]
            )
    headers = ["part", "workload", "server", "tok/s, 1 rank", "tok/s, 2 ranks", "gain", "TPOT p50 s, 1 / 2 ranks"]
    return table(headers, rows)


def per_rank_split(source: Source) -> str:
    """kvserve's time per rank at 1 and 2 ranks: the model's, its own phases', and the rest of the run (between
    steps: the engine core, the API server and the wait for the next step), from its phase counters."""
    parts = []
    for row in kvserve_by_ranks(source):
        phases, ranks = row["phase_seconds"], row["ranks"]
        worker = phases["worker"] / ranks
        model = model_seconds(phases) / ranks
        parts.append(
            f"{ranks} rank(s): run {row['wall_s']:.1f} s, model {model:.1f} s, kvserve's phases and vLLM's attention "
            f"op {worker - model:.1f} s, outside the worker's step {row['wall_s'] - worker:.1f} s"
        )
    return "; ".join(parts)


def section(load) -> str:
    sources = [(load(name), part) for name, part in PARTS]
    long_decode = sources[-1][0]
    captions = "\n\n".join(source.caption() for source, _ in sources)
    return "\n\n".join(
        [
            "Where the gap comes from: the same work on both servers, one part of a workload at a time, each part a "
            "run of its own with a pool that holds every request (Qwen2.5-Coder-0.5B, snapkv; in the decode-alone "
            "run B is above every sequence, so kvserve scores and evicts nothing). The gain is each server's output "
            "tokens/s on 2 ranks over its own on 1, in the same run.",
            parts_table(sources),
            "Per rank in the last run (kvserve's phase counters, per rank): " + per_rank_split(long_decode) + ".",
            captions,
            "The last part's command, run earlier the same day: " + gains(load(REPEAT)) + " The same command's "
            "gains moved between the two runs by more than the gap between the servers in either: one run per "
            "size on this 2-core machine does not decide which server gains more.",
            load(REPEAT).caption(),
        ]
    )
