"""`python -m kvserve.tools.bench {capacity,overhead}` (also `kvserve bench ...`; `chat`, `documents`, `long`, `load`,
`soak`, `crash`, `layouts` and `kernel` have modules and options of their own): kvserve against vanilla vLLM, in one
run (`--rounds N`: N runs of each server, interleaved).

The benchmark starts each server itself with the same engine flags (vanilla with vLLM's plugins off), sends the same
workload (N prompts of haystack text at once, streamed, `ignore_eos` so every request makes exactly --max-tokens),
and prints each setting's numbers and its ratio to vanilla's.

    # capacity: a fixed pool of 64 blocks of 128 tokens, 8 prompts of 3k tokens, SnapKV at budgets 256 and 512
    python -m kvserve.tools.bench capacity --num-blocks 64 --prompts 8 --prompt-tokens 3000 --budgets 256,512

    # decode-heavy capacity: 16 prompts of 1,500 tokens x 256 output tokens in a pool that holds 2 of them
    # without eviction, budgets compressing 4x, 8x and 16x; writes a plot
    python -m kvserve.tools.bench capacity --decode-heavy --plot docs/eval/capacity-decode-heavy.png

    # a hybrid local/global model (tiny random weights, Gemma 3's 5:1 pattern): eviction on its global layers only
    python -m kvserve.tools.bench capacity --model tiny:gemma3 --decode-heavy --prompt-tokens 3000 --num-blocks 90 \
        --server-args "--max-num-batched-tokens 256"

    # overhead: kvserve with policy full, and with scoring on but a budget above every sequence, vs vanilla
    python -m kvserve.tools.bench overhead --prompts 8 --prompt-tokens 3000

    # tensor parallelism: vanilla and kvserve on one worker and on two ranks, in one run (the tiny Llama's 2 KV
    # heads split over 2 ranks); the report adds each server's 2-rank / 1-rank ratio
    python -m kvserve.tools.bench capacity --model tiny:llama --decode-heavy --tensor-sizes 1,2

    # ... deciding which server gains more: each size's servers kept up together, the workload sent to each in turn,
    # 6 rounds; kvserve's ratio to vanilla per round, its median and range (one run per size is within the noise);
    # the pool holds every request (vLLM keeps one block of it aside, so 16 x 14 blocks need 225)
    python -m kvserve.tools.bench capacity --model tiny:llama --decode-heavy --num-blocks 240 --tensor-sizes 1,2 \
        --rounds 6

Both servers get the same `--dtype` (bf16 where the CPU has native bf16, else float32, unless --server-args names
one) and the same allocator (tcmalloc where installed). Each kvserve row also shows where the engine's time went
(`kvserve:engine_seconds_total` by phase, kvserve/phases.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from kvserve.cpu_dtype import with_default_dtype
from kvserve.phases import model_seconds
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.scaling import DATA_PARALLEL_FLAG, TENSOR_FLAG, scaling_report, size_layouts
from kvserve.tools.bench.servers import running_server
from kvserve.tools.bench.workload import prompts, run_workload
from kvserve.tools.eval.client import Setting

SERVED_NAME = "bench"
# the pause before each run of a round: vLLM's processes busy-wait for 1 s after their last message (its shared-memory
# queue's SpinCondition), so a run started at once shared the cores with the server that ran just before; in a trial
# run without the pause each server ran slower when it followed the other server than when it followed itself
SETTLE_S = 3.0
COLUMNS = ("peak_running", "requests_per_s", "output_tokens_per_s", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


def flag_int(engine_args: list[str], flag: str) -> int:
    return int(engine_args[engine_args.index(flag) + 1]) if flag in engine_args else 1


def run(
    servers: list[tuple[str, str, list[str], list[Setting]]], env: dict, workload: dict, log_dir: Path, rounds: int = 1
) -> list[dict]:
    """Each server (label, kind, engine flags, settings), every setting of it on the same workload; one result
    each, its `server` the label and its `round` the round. One round: the servers one after another, vanilla first,
    each stopped before the next starts. More: the servers of one size (tensor-parallel ranks, data-parallel
    engines) started together (one at a time) and kept up, each given one uncounted pass of the workload, then the
    workload sent to each in turn, the order reversed every other round, so that the machine's drift lands on every
    server of the size alike; then the next size. Four Qwen2.5-0.5B servers at once (both sizes) filled this
    machine's memory; an idle server's processes sleep (read with `top`)."""

    def start(number: int, label: str, kind: str, engine_args: list[str]):
        return running_server(kind, workload["model"], engine_args, log_dir / f"{number}-{label}.log", env)

    results = []
    if rounds == 1:
        for number, server in enumerate(servers):
            with start(number, *server[:3]) as url:
                warm_up(url, workload)
                results += measure(url, server, workload, 1)
        return results
    sizes = {}  # the servers of each size, in the order given
    for number, server in enumerate(servers):
        size = (flag_int(server[2], TENSOR_FLAG), flag_int(server[2], DATA_PARALLEL_FLAG))
        sizes.setdefault(size, []).append((number, server))
    for group in sizes.values():
        with contextlib.ExitStack() as stack:
            up = []
            for number, server in group:
                url = stack.enter_context(start(number, *server[:3]))
                warm_up(url, workload)
                # and a pass of the whole workload, not counted: in a trial run without it, kvserve's first evicting
                # pass was its slowest at both sizes (tiny Llama, one rank: 746 tok/s against 1,047 and 1,113 in the
                # next two rounds), vanilla's was not (first use of kvserve's operations at the workload's shapes)
                measure(url, server, workload, 0, quiet=True)
                up.append((url, server))
            for round_number in range(1, rounds + 1):
                for url, server in up if round_number % 2 else reversed(up):
                    time.sleep(SETTLE_S)
                    results += measure(url, server, workload, round_number)
    return results


def warm_up(url: str, workload: dict) -> None:
    """One short request on a prompt outside the workload (a workload prompt would sit in vanilla's prefix cache)."""
    run_workload(url, SERVED_NAME, [workload["warmup"]], 2, Setting("full", None))


def measure(
    url: str,
    server: tuple[str, str, list[str], list[Setting]],
    workload: dict,
    round_number: int,
    quiet: bool = False,
) -> list[dict]:
    """Every setting of one server on the workload, once; printed as it goes unless `quiet`."""
    label, _, engine_args, settings = server
    ranks, engines = flag_int(engine_args, TENSOR_FLAG), flag_int(engine_args, DATA_PARALLEL_FLAG)
    results = []
    for setting in settings:
        # each round on a prefix-cache salt of its own: a server kept up must not serve a later round from its cache
        result = run_workload(
            url, SERVED_NAME, workload["prompts"], workload["max_tokens"], setting, salt=f"round{round_number}"
        )
        result.update(
            server=label,
            ranks=ranks,
            engines=engines,
            round=round_number,
            policy=setting.label,
            budget=setting.budget,
            evict_every_chunk=setting.evict_every_chunk,
        )
        results.append(result)
        if quiet:
            continue
        sizes = (f" ranks={ranks}" if ranks > 1 else "") + (f" engines={engines}" if engines > 1 else "")
        print(
            f"{label} {setting.label} {setting.budget or '-'}{sizes} round {round_number}: "
            + ", ".join(f"{c}={result[c]:.3g}" for c in COLUMNS),
            flush=True,
        )
    return results


def report(results: list[dict], prompt_tokens: int) -> str:
    vanilla = next(r for r in results if r["server"] == "vanilla")
    header = (
        "| server | policy | budget | " + " | ".join(COLUMNS) + " | preemptions | blocks freed | compactions "
        "| mean compaction ms |"
    )
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for r in results:
        mean_ms = 1000 * r["compaction_seconds"] / r["compactions"] if r["compactions"] else 0.0
        lines.append(
            f"| {r['server']} | {r['policy']} | {r['budget'] or '-'} | "
            + " | ".join(f"{r[c]:.3g}" for c in COLUMNS)
            + f" | {r['preemptions']:.0f} | {r['blocks_freed']:.0f} | {r['compactions']:.0f}"
            + f" | {mean_ms:.1f} |"
        )
    lines += ["", "Ratios kvserve / vanilla (time columns: lower is better; theoretical = prompt tokens / budget):", ""]
    header = (
        "| policy | budget | " + " | ".join(COLUMNS) + " | theoretical | peak running / theoretical / pool's limit |"
    )
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    for r in results:
        if r["server"] == "vanilla":
            continue
        theoretical = f"{prompt_tokens / r['budget']:.1f}" if r["budget"] and r["budget"] < prompt_tokens else "-"
        name = r["policy"] if r["server"] == "kvserve" else f"{r['server']} ({r['policy']})"
        lines.append(
            f"| {name} | {r['budget'] or '-'} | "
            + " | ".join(f"{r[c] / vanilla[c]:.2f}" if vanilla[c] else "-" for c in COLUMNS)
            + f" | {theoretical} | {r['peak_running']:.0f} / {r['theoretical']:.0f} / {r['pool_limit']} |"
        )
    lines += ["", "Engine time by phase, seconds (share of the run's wall time; model = worker minus the rest):", ""]
    header = "| policy | budget | wall | worker | model | attention | statistics | compaction | pages | schedule |"
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    for r in results:
        if r["server"] != "kvserve":
            continue
        phase = r["phase_seconds"]
        model = model_seconds(phase)
        cells = [
            phase["worker"],
            model,
            phase["attention"],
            phase["statistics"],
            phase["compaction"],
            phase["pages"],
            phase["schedule"],
        ]
        lines.append(
            f"| {r['policy']} | {r['budget'] or '-'} | {r['wall_s']:.1f} | "
            + " | ".join(f"{c:.1f} ({100 * c / r['wall_s']:.0f}%)" for c in cells)
            + " |"
        )
    if any(r["compactions"] for r in results):
        lines += ["", "Compaction time histogram (steps per bucket, upper bound in seconds):", ""]
    for r in results:
        if r["compactions"]:
            buckets = ", ".join(f"<={b}: {n:.0f}" for b, n in r["compaction_histogram"].items() if n)
            lines.append(f"- {r['policy']} {r['budget']}: {buckets}")
    return "\n".join(lines)


def add_capacity_limits(results: list[dict], args: argparse.Namespace) -> None:
    """Per result, `pool_limit`: how many requests the pool holds while they decode, each at the most it holds then
    (vanilla: prompt + output; evicting: B + one block, as the scheduler compacts back to B once a block of new
    tokens has grown, whole blocks counted); and `theoretical`: vanilla's peak times the compression, both capped at
    the number of requests."""
    vanilla = next(r for r in results if r["server"] == "vanilla")
    pool_tokens = args.num_blocks * args.block_size if args.command == "capacity" else None
    for result in results:
        if result["server"] == CEILING:
            result["pool_limit"] = result["theoretical"] = args.prompts
            continue
        budget = result["budget"] if result["server"] == "kvserve" else None
        if budget and budget < args.prompt_tokens + args.max_tokens:
            held, compression = budget + min(args.block_size, args.max_tokens), args.prompt_tokens / budget
        else:
            held, compression = args.prompt_tokens + args.max_tokens, 1.0
        blocks = -(-held // args.block_size)
        result["pool_limit"] = (
            min(args.prompts, pool_tokens // (blocks * args.block_size)) if pool_tokens else args.prompts
        )
        result["theoretical"] = min(args.prompts, vanilla["peak_running"] * compression)


CEILING = "vanilla-unlimited"  # vanilla with a pool that holds every request at once: the machine's compute bound
DECODE_HEAVY = {"prompts": 16, "prompt_tokens": 1500, "max_tokens": 256, "block_size": 128, "compressions": (4, 8, 16)}


def apply_decode_heavy(args: argparse.Namespace, argv: list[str]) -> None:
    """The decode-heavy preset, except for the flags the user gave: the pool holds two requests' full length."""
    given = {arg.split("=")[0] for arg in argv}
    for key in ("prompts", "prompt_tokens", "max_tokens", "block_size"):
        if "--" + key.replace("_", "-") not in given:
            setattr(args, key, DECODE_HEAVY[key])
    if "--num-blocks" not in given:
        args.num_blocks = 2 * -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    if "--budgets" not in given:
        args.budgets = ",".join(str(round(args.prompt_tokens / c)) for c in DECODE_HEAVY["compressions"])


def plot(results: list[dict], prompt_tokens: int, path: str) -> None:
    """Output tokens/s and peak requests running against the compression (prompt tokens / budget), vanilla at 1x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vanilla = next(r for r in results if r["server"] == "vanilla")
    figure, (throughput, concurrency) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in sorted({r["policy"] for r in results if r["server"] == "kvserve" and r["budget"]}):
        rows = sorted((r for r in results if r["policy"] == policy and r["budget"]), key=lambda r: -r["budget"])
        ratio = [prompt_tokens / r["budget"] for r in rows]
        throughput.plot(
            ratio, [r["output_tokens_per_s"] / vanilla["output_tokens_per_s"] for r in rows], "o-", label=policy
        )
        concurrency.plot(ratio, [r["peak_running"] for r in rows], "o-", label=f"{policy} measured")
        concurrency.plot(ratio, [r["theoretical"] for r in rows], "x--", label=f"{policy} theoretical")
        concurrency.plot(ratio, [r["pool_limit"] for r in rows], "+:", label=f"{policy} pool's limit")
    throughput.axhline(1.0, color="grey", linestyle=":", label="vanilla")
    for ceiling in (r for r in results if r["server"] == CEILING):
        throughput.axhline(
            ceiling["output_tokens_per_s"] / vanilla["output_tokens_per_s"],
            color="black",
            linestyle="--",
            label="vanilla, unlimited pool",
        )
    concurrency.axhline(vanilla["peak_running"], color="grey", linestyle=":", label="vanilla")
    for axes, title in ((throughput, "output tokens/s vs vanilla"), (concurrency, "peak requests running")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("compression (prompt tokens / budget)")
        axes.set_title(title)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot: {path}")


# `kvserve bench NAME`: the commands with options of their own (module, what it measures), and those this module
# runs (a vanilla server and a kvserve server on the same workload); `kvserve --help` lists both
COMMANDS = {
    "documents": ("kvserve.tools.bench.documents", "one document, many questions: compressed once vs recomputed"),
    "speculative": (
        "kvserve.tools.bench.speculative",
        "n-gram speculative decoding with eviction on answers that quote, vs vanilla with and without it",
    ),
    "chat": ("kvserve.tools.bench.chat", "multi-turn chat over a shared document in a small pool, vs vanilla"),
    "sessions": (
        "kvserve.tools.bench.sessions",
        "data-parallel engines: do conversations' turns resume, per routing",
    ),
    "long": ("kvserve.tools.bench.long_prompts", "long prompts through a bounded cache: TTFT and pages vs full"),
    "load": ("kvserve.tools.bench.load", "mixed-policy load test of one server (loopback)"),
    "crash": ("kvserve.tools.bench.crash", "kill a server's engine: time to failing /health and exit"),
    "soak": ("kvserve.tools.bench.soak", "engine memory over long evicting requests, per allocator"),
    "layouts": ("kvserve.tools.bench.layouts", "cache operations per CPU cache layout (vec, AMX), one process"),
    "kernel": ("kvserve.tools.bench.kernel", "kvserve's CPU kernel against vLLM's attention op, one process"),
}
SERVER_PAIR_COMMANDS = {
    "capacity": "throughput and requests at once at equal memory, kvserve against vanilla vLLM",
    "overhead": "what eviction costs per step when memory is no limit, kvserve against vanilla vLLM",
}


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:  # a command with its own options, in its own module
        module, _ = COMMANDS[argv[0]]
        return importlib.import_module(module).main(argv[1:])

    parser = argparse.ArgumentParser(
        prog="kvserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=tuple(SERVER_PAIR_COMMANDS))
    parser.add_argument(
        "--model",
        default=str(default_model_dir()),
        help="a model folder, or tiny:ARCH for a tiny random-weight model (kvserve/tools/bench/tiny_models.py), e.g. "
        "tiny:gemma3 (hybrid: 10 sliding-window layers, 2 global)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="requests, all sent at once")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--policy", default="snapkv", help="policy, or a comma list of policies")
    parser.add_argument("--budgets", default="256,512", help="capacity: the budgets to compare")
    parser.add_argument("--evict-every-chunk", action="store_true", help="capacity: evict between prefill chunks")
    parser.add_argument(
        "--allocations", default="uniform", help="capacity: kv_allocation values to run each budget with (comma list)"
    )
    parser.add_argument("--num-blocks", type=int, default=64, help="capacity: KV pool size in blocks (both servers)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE for both servers")
    parser.add_argument("--server-args", default="", help="more engine flags for both servers, one string")
    parser.add_argument(
        "--kvserve-args",
        default="",
        help="flags for kvserve serve only, one string (e.g. --kv-profile none: a model's calibration profile "
        "would otherwise choose kvserve's default setting)",
    )
    parser.add_argument(
        "--attention",
        choices=("vllm", "kernels"),
        default="vllm",
        help="kvserve's attention mode (KVSERVE_ATTENTION): vLLM's CPU kernel then kvserve's "
        "statistics, or kvserve's own kernel operations for both",
    )
    parser.add_argument(
        "--cpu-kernel",
        choices=("on", "off"),
        default="on",
        help="kvserve's C++ attention-and-statistics kernel (KVSERVE_CPU_KERNEL), or the PyTorch path it replaces",
    )
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument(
        "--decode-heavy",
        action="store_true",
        help="capacity preset: 16 prompts of 1,500 tokens, 256 output tokens each, a pool that holds "
        "2 of them without eviction, budgets compressing 4x, 8x and 16x (other flags still apply "
        "when given explicitly)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="capacity: also run vanilla with a pool that holds every request (what this machine "
        "computes when memory is no limit: the bound on any eviction's gain)",
    )
    parser.add_argument("--plot", default=None, help="capacity: PNG of throughput and peak concurrency vs budget")
    parser.add_argument(
        "--tensor-sizes",
        default=None,
        help="capacity: run every server at each of these --tensor-parallel-size values (comma list, e.g. 1,2), one "
        "after another in this run, and report each server's scaling against its first size",
    )
    parser.add_argument(
        "--data-parallel-sizes",
        default=None,
        help="capacity: the same with --data-parallel-size (engines behind one API server, each with its own pool "
        "of --num-blocks blocks and its own CPUs)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with N > 1, the servers of each size (--tensor-sizes, --data-parallel-sizes) are started together and "
        "kept up, each runs the workload once uncounted, then the workload goes to each in turn, N rounds, the order "
        "reversed every other round; the scaling report gives medians over the rounds and each server's ratio to "
        "vanilla within a round (the machine's drift divides out)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rounds > 1 and args.rounds % 2:
        # a run's speed depended on its place in the round (tiny Llama, docs/benchmarks.md): balance the places
        print(
            f"bench: --rounds {args.rounds} puts the first server first in one round more than the others; an even "
            "number of rounds puts each server first equally often",
            flush=True,
        )
    if args.model.startswith("tiny:"):
        from kvserve.tools.bench.tiny_models import tiny_model

        args.model = str(tiny_model(args.model.removeprefix("tiny:")))
    if args.decode_heavy:
        apply_decode_heavy(args, argv)
        args.ceiling = True

    policies = args.policy.split(",")
    max_model_len = args.prompt_tokens + args.max_tokens + args.block_size
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(args.block_size),
        *shlex.split(args.server_args),
    ]
    engine_args = with_default_dtype(engine_args, "bench")  # what `kvserve serve` would pick, vanilla's too
    if args.command == "capacity":
        engine_args += ["--num-gpu-blocks-override", str(args.num_blocks)]
        kvserve_settings = [
            Setting(policy, int(b), args.evict_every_chunk, allocation)
            for policy in policies
            for b in args.budgets.split(",")
            for allocation in args.allocations.split(",")
        ]
    else:  # scoring on, nothing evicted: the budget is above every sequence in the workload
        kvserve_settings = [Setting("full", None)] + [Setting(policy, max_model_len) for policy in policies]
    workload_prompts = prompts(args.prompts + 1, args.prompt_tokens, args.model)
    workload = {
        "model": args.model,
        "prompts": workload_prompts[1:],
        "warmup": workload_prompts[0][:64],
        "max_tokens": args.max_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as log_dir:
        env = {  # vanilla has no plugin: only the cache space applies to it
            "VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib,
            "KVSERVE_ATTENTION": args.attention,
            "KVSERVE_CPU_KERNEL": "1" if args.cpu_kernel == "on" else "0",
        }
        servers = []
        for layout in size_layouts(args, engine_args):
            servers.append(("vanilla", "vanilla", layout, [Setting("full", None)]))
            if args.command == "capacity" and args.ceiling:
                unlimited = args.prompts * -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
                ceiling_args = [
                    *layout[: layout.index("--num-gpu-blocks-override")],
                    "--num-gpu-blocks-override",
                    str(unlimited),
                    *layout[layout.index("--num-gpu-blocks-override") + 2 :],
                ]
                servers.append((CEILING, "vanilla", ceiling_args, [Setting("full", None)]))
            servers.append(("kvserve", "kvserve", [*layout, *shlex.split(args.kvserve_args)], kvserve_settings))
        results = run(servers, env, workload, Path(log_dir), args.rounds)
    for round_number in range(1, args.rounds + 1):
        in_round = [r for r in results if r["round"] == round_number]
        add_capacity_limits(in_round, args)
        print()
        if args.rounds > 1:
            print(f"Round {round_number}:\n")
        print(report(in_round, args.prompt_tokens))
    if args.tensor_sizes or args.data_parallel_sizes:
        print()
        print(scaling_report(results, "engines" if args.data_parallel_sizes else "ranks"))
    if args.plot:
        plot(results, args.prompt_tokens, args.plot)
    if args.out:
        # no machine paths in published results: files by name only
        recorded = {
            **vars(args),
            **{key: Path(getattr(args, key)).name for key in ("model", "out", "plot") if getattr(args, key)},
        }
        ran = provenance(command_line(argv, "kvserve bench"))
        Path(args.out).write_text(
            json.dumps({"command": args.command, "args": recorded, "provenance": ran, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
