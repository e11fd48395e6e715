"""Where a tensor-parallel gain goes: the same work on vanilla vLLM and kvserve, one part of a workload at a time
(decode alone, prefill alone, decode over long prompts compacted once), each a `kvserve bench capacity
--tensor-sizes 1,2` run of its own. At equal memory vanilla and kvserve do different work (vanilla preempts and
recomputes, kvserve runs more requests at once over shorter lists), so their gains there mix what a second rank
speeds up with how much of each part a server has left."""

from __future__ import annotations

import statistics

from kvserve.phases import model_seconds
from kvserve.tools.bench.scaling import against_vanilla, gain_over_vanilla, setting_key, spread
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
# the decision: every server kept up, the workload sent to each in turn over several rounds (`--rounds`), per model
ROUNDS = (
    ("tp/tiny-llama-tp-rounds.json", "the tiny Llama"),
    ("tp/qwen05-tp-rounds.json", "Qwen2.5-Coder-0.5B"),
    # the tiny Llama's command once more, right after: how far one run's verdict moves on this machine
    ("tp/tiny-llama-tp-rounds-repeat.json", "the tiny Llama (the same command again)"),
)


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


def rounds_table(sources: list[tuple[Source, str]]) -> str:
    rows = []
    for source, model in sources:
        args, results = source.data["args"], source.data["results"]
        work = f"{args['prompts']} x {args['prompt_tokens']:,} + {args['max_tokens']}"
        (kvserve,) = {setting_key(r) for r in results if r["server"] == "kvserve"}
        ratios = against_vanilla(results)
        for ranks in sorted({r["ranks"] for r in results}):
            by_round = ratios[(*kvserve, ranks)]
            rows.append(
                [
                    model,
                    work,
                    str(ranks),
                    by_rounds(results, "vanilla", ranks),
                    by_rounds(results, "kvserve", ranks),
                    ", ".join(f"{ratio:.2f}" for ratio in by_round),
                    spread(by_round),
                ]
            )
    headers = ["model", "workload", "ranks", "vanilla tok/s, by round", "kvserve tok/s, by round"]
    return table([*headers, "kvserve / vanilla, by round", "median (range)"], rows)


def by_rounds(results: list[dict], server: str, ranks: int) -> str:
    """A server's output tokens/s at `ranks`, round by round."""
    runs = sorted((r for r in results if r["server"] == server and r["ranks"] == ranks), key=lambda r: r["round"])
    return ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in runs)


def rounds_verdict(source: Source, model: str) -> str:
    """kvserve's median ratio to vanilla at each size, and what that makes of its gain against vanilla's."""
    results = source.data["results"]
    (kvserve,) = {setting_key(r) for r in results if r["server"] == "kvserve"}
    ratios = against_vanilla(results)
    one, two = (statistics.median(ratios[(*kvserve, ranks)]) for ranks in (1, 2))
    relative = gain_over_vanilla(results, kvserve, 2)
    verdict = "at least" if relative >= 1 else "below"
    first_runs = {(r["ranks"], r["round"]): r["server"] for r in reversed(results)}  # each round's first run
    vanilla_first = sum(server == "vanilla" for server in first_runs.values())
    return (
        f"on {model} kvserve served {one:.2f}x vanilla's output on one rank and {two:.2f}x on two (medians over "
        f"{source.data['args']['rounds']} rounds; vanilla ran first in {vanilla_first} of the {len(first_runs)} "
        f"rounds at both sizes together), so its gain from the second rank was {relative:.2f} of vanilla's: "
        f"{verdict} vanilla's"
    )


def own_share(source: Source) -> str:
    """kvserve's own phases (statistics, compaction, pages) per rank against the run's wall time, medians over the
    rounds, at each size: work per request and layer that a second rank does not divide."""
    parts = []
    for ranks in (1, 2):
        runs = [r for r in source.data["results"] if r["server"] == "kvserve" and r["ranks"] == ranks]
        own = statistics.median(
            sum(r["phase_seconds"][p] for p in ("statistics", "compaction", "pages")) / ranks for r in runs
        )
        wall = statistics.median(r["wall_s"] for r in runs)
        parts.append(f"{own:.2f} s of a {wall:.1f} s run on {ranks} rank{'s' if ranks > 1 else ''}")
    return " and ".join(parts)


def repeat_spread(first: Source, again: Source) -> str:
    """What the same rounds command gave twice in a row: kvserve's gain over vanilla's each time."""
    gains = []
    for source in (first, again):
        results = source.data["results"]
        (kvserve,) = {setting_key(r) for r in results if r["server"] == "kvserve"}
        gains.append(gain_over_vanilla(results, kvserve, 2))
    return (
        f"The tiny Llama's command, run twice in a row, gave kvserve {gains[0]:.2f} and then {gains[1]:.2f} of "
        "vanilla's gain: on this machine one run decides it only within about that much."
    )


def rounds_section(load) -> str:
    sources = [(load(name), model) for name, model in ROUNDS]
    preempted = sum(
        r["preemptions"] for source, _ in sources for r in source.data["results"] if r["server"] == "vanilla"
    )
    return "\n\n".join(
        [
            "### Tensor parallelism: which server gains more",
            "The decision, per model: the servers of each size started together and kept up, each given one "
            "uncounted pass of the workload, then the workload sent to each in turn, 3 s apart, round after round, the "
            "order reversed every other round (`kvserve bench capacity --rounds`), so that kvserve's ratio to vanilla "
            "divides two runs made minutes apart and the machine's drift divides out. kvserve's gain from the second "
            "rank is at least vanilla's when that ratio does not fall from one rank to two. The pool holds every "
            f"request (vanilla's preemptions over all these runs: {preempted:.0f}), so both servers serve the same "
            "requests at once; kvserve evicts each prompt down to B. On the tiny Llama, whose runs take seconds, a "
            "run's speed depended on its place in the round whichever server held it, so its rounds are even in "
            "number and each server runs first in half of them.",
            rounds_table(sources),
            "Measured: " + "; ".join(rounds_verdict(source, model) for source, model in sources) + ". kvserve's own "
            "phases (statistics, compaction, pages), per rank, took "
            + own_share(sources[0][0])
            + " on the tiny Llama, whose model computes little per token, and "
            + own_share(sources[1][0])
            + " on Qwen2.5-Coder-0.5B (medians over the rounds): work per request and layer, which a second rank "
            "divides only in part, weighs most where the model's own compute is smallest. "
            + repeat_spread(sources[0][0], sources[2][0]),
            *(source.caption() for source, _ in sources),
        ]
    )
