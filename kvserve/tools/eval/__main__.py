"""`python -m kvserve.tools.eval {ruler,tasks,ppl,passkey,suite} ...` (also `kvserve eval ...`): quality of eviction
settings.

    # RULER through lm-evaluation-harness (pip install 'kvserve[ruler]'); the server needs
    # --max-model-len >= the longest length
    python -m kvserve.tools.eval ruler --url http://127.0.0.1:8000 --policies full,snapkv,streamingllm \
        --budgets 128,256,512 --lengths 1024,2048,4096 --samples 4 --out ruler.jsonl

    # task accuracy, policies x budgets, two servers sharing the work, plots into docs/plots/
    python -m kvserve.tools.eval tasks --url http://127.0.0.1:8000,http://127.0.0.1:8001 \\
        --policies full,streamingllm,snapkv --budgets 64,128,256,512 --lengths 1000,2000,4000 \\
        --out tasks.jsonl --plot docs/plots/tasks.png

    # perplexity with eviction between 256-token prefill chunks (server: --max-num-batched-tokens 256)
    python -m kvserve.tools.eval ppl --url http://127.0.0.1:8000 --policies full,snapkv --budgets 128,256 \\
        --tokens 2048 --passages 2 --out ppl.jsonl --plot docs/plots/ppl.png

    # the verdict: judged tasks (full >= 0.5), each setting's mean and ratio to full per budget
    python -m kvserve.tools.eval suite ruler.jsonl tasks.jsonl --by-task

Every command but `suite` talks to OpenAI-compatible servers only (vanilla vLLM works for `full`), writes one JSON
line per answer (rerunning resumes), and prints markdown tables.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from kvserve.provenance import command_line, provenance
from kvserve.tools.eval import parity, scoreboard
from kvserve.tools.eval.client import Server, settings
from kvserve.tools.eval.ruler import DEFAULT_TASKS, RULER_TASKS
from kvserve.tools.eval.tasks import TASKS


def _common(parser: argparse.ArgumentParser) -> None:
    from kvserve.model import default_model_dir

    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server URL; a comma list shares the work")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    parser.add_argument("--tokenizer", default=str(default_model_dir()))
    parser.add_argument(
        "--policies",
        default="full,streamingllm,snapkv",
        help="comma list; a policy may set knobs: duoattention:retrieval_fraction=0.25:recent=128",
    )
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument(
        "--allocations",
        default="default",
        help="kv_allocation values to run each budgeted policy with (comma list; default: each policy's own, "
        "global for kvzip and uniform for the others)",
    )
    parser.add_argument("--spans", default="1", help="kv_span values to run each score-based policy with")
    parser.add_argument(
        "--checkpoint",
        type=int,
        default=0,
        help="kv_checkpoint of every budgeted policy (0: none; the server refuses settings it cannot serve)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON lines; an existing file resumes")
    parser.add_argument("--plot", default=None, help="PNG path for the value-vs-budget plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def _several_allocations(args: argparse.Namespace) -> bool:
    """Whether the command compares allocations (then it also prints the allocation table)."""
    return len(args.allocations.split(",")) > 1


def _settings(parser: argparse.ArgumentParser, args: argparse.Namespace, evict_every_chunk: bool = False) -> list:
    """The settings the command line asks for; a bad policy, knob or value ends with a message naming it."""
    layout = {"allocations": tuple(args.allocations.split(",")), "spans": tuple(_ints(args.spans))}
    layout["checkpoint"] = getattr(args, "checkpoint", 0)
    match = getattr(args, "match_budget", None)
    try:
        return settings(
            args.policies.split(","), _ints(args.budgets), evict_every_chunk=evict_every_chunk, match=match, **layout
        )
    except ValueError as error:
        parser.error(f"--policies: {error}")


def _ruler(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvserve.tools.eval import quality
    from kvserve.tools.eval.report import allocation_table, plot_vs_budget
    from kvserve.tools.eval.ruler import RulerRun, harness_missing, run_settings

    missing = harness_missing()
    if missing:
        parser.error(missing)
    unknown = [task for task in args.tasks.split(",") if task not in RULER_TASKS]
    if unknown:
        parser.error(
            f"--tasks: {', '.join(unknown)} not among the harness's offline RULER tasks ({', '.join(RULER_TASKS)})"
        )
    if "," in args.url:
        parser.error("--url: ruler uses one server (the harness keeps --concurrency requests in flight)")
    run = RulerRun(
        server=Server(args.url, args.model),
        tokenizer=args.tokenizer,
        tasks=tuple(args.tasks.split(",")),
        lengths=tuple(_ints(args.lengths)),
        samples=args.samples,
        out=args.out,
        concurrency=args.concurrency,
    )
    rows = run_settings(run, _settings(parser, args), progress=not args.quiet)
    print(
        f"RULER (lm-evaluation-harness), {args.samples} samples per task and length, lengths {args.lengths}",
        quality.summary_table(rows),
        "",
        quality.summary_table(rows, column="length"),
        "",
        quality.matrix_table(rows),
        "",
        quality.best_per_budget(rows),
        sep="\n",
    )
    values = {key: mean for key, (mean, _) in quality.mean_scores(rows, ("policy", "budget")).items()}
    if _several_allocations(args):
        print("", allocation_table(values, higher_is_better=True), sep="\n")
    if args.plot:
        plot_vs_budget(values, "mean RULER score", args.plot, f"RULER {args.tasks} at {args.lengths} tokens")


def runs_file(out: str | Path) -> Path:
    """Where the runs that wrote the result file `out` are recorded: `tasks.jsonl` -> `tasks.runs.jsonl`."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".jsonl") + ".runs.jsonl")


def record_run(out: str | Path, argv: list[str] | None) -> None:
    """Append this run's provenance (date, command, machine, version) to the runs file beside `out` (rows are
    appended to `out` across runs, so one result file may hold several runs, on several machines)."""
    path = runs_file(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as runs:
        runs.write(json.dumps(provenance(command_line(argv, "kvserve eval"))) + "\n")


# the commands whose options their own module parses (its main(argv) runs them; docs/reference/cli.md reads them there)
DELEGATED = {"passkey": "kvserve.tools.eval.passkey", "suite": "kvserve.tools.eval.suite"}


def build_parser() -> argparse.ArgumentParser:
    """`kvserve eval`'s commands and their options (`kvserve --help` lists the commands from here)."""
    parser = argparse.ArgumentParser(
        prog="kvserve eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ruler = commands.add_parser("ruler", help="RULER tasks through lm-evaluation-harness (kvserve[ruler])")
    _common(ruler)
    ruler.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"any of {', '.join(RULER_TASKS)}")
    ruler.add_argument("--lengths", default="1024,2048,4096", help="RULER sequence lengths (prompt + answer)")
    ruler.add_argument("--samples", type=int, default=4, help="samples per task and length (the harness's limit)")
    ruler.add_argument("--concurrency", type=int, default=1, help="requests the harness keeps in flight")
    tasks = commands.add_parser("tasks", help="passkey, fact, chat and multi-needle accuracy over pydoc prose")
    _common(tasks)
    tasks.add_argument("--tasks", default=",".join(TASKS), help=f"any of {', '.join(TASKS)}")
    tasks.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens")
    tasks.add_argument("--samples", type=int, default=1, help="cases per task and length")
    tasks.add_argument(
        "--match-budget",
        default=None,
        metavar="LABEL",
        help="instead of --budgets, run each budgeted policy on each case at the entries the LABEL setting kept "
        "there (e.g. attention_gate, whose rows must be in --out): equal memory per case",
    )
    ppl = commands.add_parser("ppl", help="perplexity with eviction between prefill chunks")
    _common(ppl)
    ppl.add_argument("--tokens", type=int, default=2048, help="passage length")
    ppl.add_argument("--passages", type=int, default=2)
    commands.add_parser(
        "passkey", help="the issue-2/3 passkey table (see python -m kvserve.tools.eval.passkey -h)", add_help=False
    )
    commands.add_parser(
        "suite", help="the verdict over ruler/tasks results: judged tasks, ratios to full", add_help=False
    )
    parity.add_parser(commands)
    scoreboard.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("parity", "scoreboard"):
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if not args.table_only:
            record_run(args.out, argv)
        args.handler(args)
        return
    if args.command in DELEGATED:
        importlib.import_module(DELEGATED[args.command]).main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    record_run(args.out, argv)
    if args.command == "ruler":
        _ruler(parser, args)
        return
    from transformers import AutoTokenizer

    from kvserve.tools.eval.report import allocation_table, plot_vs_budget

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    servers = [Server(url, args.model) for url in args.url.split(",")]
    if args.command == "tasks":
        from kvserve.tools.eval import quality
        from kvserve.tools.eval.tasks import make_cases

        cases = make_cases(tokenizer, args.tasks.split(","), _ints(args.lengths), args.samples, args.seed)
        rows = quality.run(servers, _settings(parser, args), cases, args.out, progress=not args.quiet)
        print(
            quality.summary_table(rows),
            "",
            quality.matrix_table(rows),
            "",
            quality.best_per_budget(rows),
            quality.gate_summary(rows),
            sep="\n",
        )
        values = {key: mean for key, (mean, _) in quality.mean_scores(rows, ("policy", "budget")).items()}
        if _several_allocations(args):
            print("", allocation_table(values, higher_is_better=True), sep="\n")
        if args.plot:
            title = f"Mean score over {len(args.tasks.split(','))} tasks at {args.lengths} tokens"
            plot_vs_budget(values, "mean task score", args.plot, title)
    else:
        from kvserve.tools.eval import perplexity

        if len(servers) > 1:
            parser.error("--url: ppl uses one server (prompt chunking is a server setting)")
        passages = perplexity.texts(tokenizer, args.tokens, args.passages, args.seed)
        rows = perplexity.run(
            servers[0],
            _settings(parser, args, evict_every_chunk=True),
            passages,
            args.out,
            args.seed,
            progress=not args.quiet,
        )
        print(perplexity.perplexity_table(rows))
        if _several_allocations(args):
            print("", allocation_table(perplexity.perplexities(rows), higher_is_better=False), sep="\n")
        if args.plot:
            plot_vs_budget(
                perplexity.perplexities(rows),
                "perplexity",
                args.plot,
                f"Perplexity, {args.tokens}-token passages, eviction between chunks",
                log_y=True,
            )


if __name__ == "__main__":
    main()
