"""How a server's output grows with its tensor-parallel ranks or data-parallel engines (`kvserve bench capacity
--tensor-sizes 1,2`, `--data-parallel-sizes`): each server's and setting's output tokens/s at every size over its own
at the first size, in the same round.

One run per size did not decide it on this project's 2-core machines: the same command's gain moved between runs by
more than the gap between vanilla and kvserve (docs/benchmarks.md, tensor parallelism). With `--rounds N` the
servers of each size stay up together and the workload goes to each in turn, N times, so kvserve's ratio to vanilla
at a size divides two runs made minutes apart; kvserve's gain is at least vanilla's when that ratio (median over the
rounds) does not fall from the first size to the next.
"""

from __future__ import annotations

import argparse
import statistics

TENSOR_FLAG = "--tensor-parallel-size"
DATA_PARALLEL_FLAG = "--data-parallel-size"


def size_layouts(args: argparse.Namespace, engine_args: list[str]) -> list[list[str]]:
    """The engine flags of each tensor-parallel or data-parallel size asked for (`--tensor-sizes`,
    `--data-parallel-sizes`), or the flags as they are."""
    if args.tensor_sizes and args.data_parallel_sizes:
        raise SystemExit("bench: --tensor-sizes or --data-parallel-sizes, not both")
    option, sizes, flag = ("--tensor-sizes", args.tensor_sizes, TENSOR_FLAG)
    if not sizes:
        option, sizes, flag = ("--data-parallel-sizes", args.data_parallel_sizes, DATA_PARALLEL_FLAG)
    if not sizes:
        return [engine_args]
    if flag in engine_args:
        raise SystemExit(f"bench: give {flag} by {option}, not in --server-args")
    return [[*engine_args, flag, size.strip()] for size in sizes.split(",")]


def setting_key(result: dict) -> tuple:
    return result["server"], result["policy"], result["budget"]


def median_tokens(results: list[dict], size: str = "ranks") -> dict[tuple, float]:
    """Per (server, policy, budget, size): the median output tokens/s over the rounds."""
    runs: dict[tuple, list[float]] = {}
    for row in results:
        runs.setdefault((*setting_key(row), row[size]), []).append(row["output_tokens_per_s"])
    return {key: statistics.median(values) for key, values in runs.items()}


def against_vanilla(results: list[dict], size: str = "ranks") -> dict[tuple, list[float]]:
    """Per (server, policy, budget, size): its output tokens/s over vanilla's at the same size in the same round, one
    ratio per round (results without `round` are one round). The servers of a size take turns within a round, so
    the machine's drift divides out."""
    found: dict[tuple, list[float]] = {}
    for row in results:
        vanilla = next(
            r
            for r in results
            if r["server"] == "vanilla" and r[size] == row[size] and r.get("round", 1) == row.get("round", 1)
        )
        found.setdefault((*setting_key(row), row[size]), []).append(
            row["output_tokens_per_s"] / vanilla["output_tokens_per_s"]
        )
    return found


def gain_over_vanilla(results: list[dict], key: tuple, count: int, size: str = "ranks") -> float:
    """How much more (> 1) or less a setting gained from the first size to `count` than vanilla did: its median
    ratio to vanilla at `count` over that at the first size."""
    first = min(r[size] for r in results)
    ratios = against_vanilla(results, size)
    return statistics.median(ratios[(*key, count)]) / statistics.median(ratios[(*key, first)])


def spread(values: list[float]) -> str:
    """`median` alone for one value, else `median (min-max)`."""
    median = statistics.median(values)
    return f"{median:.2f}x" if len(values) == 1 else f"{median:.2f}x ({min(values):.2f}-{max(values):.2f})"


def scaling_report(results: list[dict], size: str = "ranks") -> str:
    """Each server's and setting's median output at every size, its gain over its own at the first size, its ratio
    to vanilla at the same size (median over the rounds and range), and how its gain compares with vanilla's: at
    least vanilla's when that ratio does not fall as the size grows."""
    first = min(r[size] for r in results)
    rounds = max(r.get("round", 1) for r in results)
    tokens, ratios = median_tokens(results, size), against_vanilla(results, size)
    header = (
        f"| server | policy | budget | {size} | output tok/s | vs itself at {size} {first} "
        f"| vs vanilla, same {size} | its gain / vanilla's |"
    )
    lines = [header, "|---" * 8 + "|"]
    for key, tok in tokens.items():
        *setting, count = key
        server, policy, budget = setting
        relative = "-" if server == "vanilla" else f"{gain_over_vanilla(results, tuple(setting), count, size):.2f}"
        lines.append(
            f"| {server} | {policy} | {budget or '-'} | {count} | {tok:.1f} | {tok / tokens[(*setting, first)]:.2f}x "
            f"| {spread(ratios[key])} | {relative} |"
        )
    if rounds > 1:
        lines += [
            "",
            f"Medians over {rounds} rounds (range in brackets); a ratio to vanilla divides two runs of the same round.",
        ]
    return "\n".join(lines)
