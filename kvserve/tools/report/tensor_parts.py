"""Decode-heavy under tensor parallelism, the rounds protocol: vanilla vLLM and kvserve at 1 and 2 ranks, every server
kept up, the workload sent to each in turn round after round (`kvserve bench capacity --tensor-sizes 1,2 --rounds`),
so kvserve's ratio to vanilla divides runs made minutes apart and the machine's drift divides out."""

from __future__ import annotations

import statistics

from kvserve.tools.bench.scaling import against_vanilla, gain_over_vanilla, setting_key, spread
from kvserve.tools.markdown import table
from kvserve.tools.report.sources import Source, captions

# the decision: every server kept up, the workload sent to each in turn over several rounds (`--rounds`), per model
ROUNDS = (
    ("tp/tiny-llama-tp-rounds.json", "the tiny Llama"),
    ("tp/qwen05-tp-rounds.json", "Qwen2.5-Coder-0.5B"),
    # the tiny Llama's command once more, right after: how far one run's verdict moves on this machine
    ("tp/tiny-llama-tp-rounds-repeat.json", "the tiny Llama (the same command again)"),
)


def rounds_table(sources: list[tuple[Source, str]]) -> str:
    """Per model and size: the servers' output over the rounds and kvserve's ratio to vanilla, each as the median
    and range (a value per round is in the file), and kvserve's own phases against the run's time."""
    rows = []
    for source, model in sources:
        args, results = source.data["args"], source.data["results"]
        work = f"{args['prompts']} x {args['prompt_tokens']:,} + {args['max_tokens']}"
        (kvserve,) = {setting_key(r) for r in results if r["server"] == "kvserve"}
        ratios = against_vanilla(results)
        first_runs = {(r["ranks"], r["round"]): r["server"] for r in reversed(results)}  # each round's first run
        for ranks in sorted({r["ranks"] for r in results}):
            rounds = [server for (size, _), server in first_runs.items() if size == ranks]
            rows.append(
                [
                    model,
                    work,
                    str(ranks),
                    f"{len(rounds)} ({sum(server == 'vanilla' for server in rounds)})",
                    tokens_spread(results, "vanilla", ranks),
                    tokens_spread(results, "kvserve", ranks),
                    spread(ratios[(*kvserve, ranks)]),
                    own_share(source, ranks),
                ]
            )
    headers = ["model", "workload", "ranks", "rounds (vanilla first)", "vanilla tok/s", "kvserve tok/s"]
    return table([*headers, "kvserve / vanilla", "kvserve's own phases per rank, s of the run"], rows)


def tokens_spread(results: list[dict], server: str, ranks: int) -> str:
    """A server's output tokens/s at `ranks` over the rounds: `median (min-max)`."""
    values = [r["output_tokens_per_s"] for r in results if r["server"] == server and r["ranks"] == ranks]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def own_share(source: Source, ranks: int) -> str:
    """kvserve's own phases (statistics, compaction, pages) per rank against the run's wall time, medians over the
    rounds: work per request and layer that a second rank does not divide."""
    runs = [r for r in source.data["results"] if r["server"] == "kvserve" and r["ranks"] == ranks]
    own = statistics.median(
        sum(r["phase_seconds"][p] for p in ("statistics", "compaction", "pages")) / ranks for r in runs
    )
    return f"{own:.2f} of {statistics.median(r['wall_s'] for r in runs):.1f}"


def gain(source: Source, model: str) -> str:
    """kvserve's gain from the second rank against vanilla's: its median ratio to vanilla at two over that at one."""
    results = source.data["results"]
    (kvserve,) = {setting_key(r) for r in results if r["server"] == "kvserve"}
    relative = gain_over_vanilla(results, kvserve, 2)
    return f"{model} {relative:.2f} ({'at least' if relative >= 1 else 'below'} vanilla's)"


def rounds_section(load) -> str:
    sources = [(load(name), model) for name, model in ROUNDS]
    preempted = sum(
        r["preemptions"] for source, _ in sources for r in source.data["results"] if r["server"] == "vanilla"
    )
    return "\n\n".join(
        [
            "### Decode-heavy under tensor parallelism",
            "Per model, the servers of each size kept up and given the workload in turn, round after round, the "
            "order reversed every other round (`kvserve bench capacity --rounds`), so the machine's drift divides out "
            f"of kvserve's ratio to vanilla. The pool holds every request (vanilla's preemptions: {preempted:.0f}); "
            "kvserve evicts each prompt to B. Medians over the rounds (range).",
            rounds_table(sources),
            "kvserve's gain from the second rank against vanilla's (its ratio to vanilla at two ranks over one): "
            + ", ".join(gain(source, model) for source, model in sources)
            + ".",
            captions([source for source, _ in sources]),
        ]
    )
