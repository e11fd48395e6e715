"""`python -m kvserve.eval {tasks,ppl,passkey} ...` (also `kvserve eval ...`): quality of eviction settings.

    # task accuracy, policies x budgets, two servers sharing the work, plots into docs/plots/
    python -m kvserve.eval tasks --url http://127.0.0.1:8000,http://127.0.0.1:8001 \\
        --policies full,streamingllm,snapkv --budgets 64,128,256,512 --lengths 1000,2000,4000 \\
        --out tasks.jsonl --plot docs/plots/tasks.png

    # perplexity with eviction between 256-token prefill chunks (server: --max-num-batched-tokens 256)
    python -m kvserve.eval ppl --url http://127.0.0.1:8000 --policies full,snapkv --budgets 128,256 \\
        --tokens 2048 --passages 2 --out ppl.jsonl --plot docs/plots/ppl.png

Every command talks to OpenAI-compatible servers only (vanilla vLLM works for `full`), writes one JSON line per
answer (rerunning resumes), and prints markdown tables.
"""

from __future__ import annotations

import argparse

from kvserve.eval.client import Server, settings
from kvserve.eval.tasks import TASKS


def _common(parser: argparse.ArgumentParser) -> None:
    from kvserve.model import default_model_dir

    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server URL; a comma list shares the work")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    parser.add_argument("--tokenizer", default=str(default_model_dir()))
    parser.add_argument("--policies", default="full,streamingllm,snapkv")
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON lines; an existing file resumes")
    parser.add_argument("--plot", default=None, help="PNG path for the value-vs-budget plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tasks = commands.add_parser("tasks", help="needle, multi-needle, variable tracking and passkey accuracy")
    _common(tasks)
    tasks.add_argument("--tasks", default=",".join(TASKS), help=f"any of {', '.join(TASKS)}")
    tasks.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens")
    tasks.add_argument("--samples", type=int, default=1, help="cases per task and length")
    ppl = commands.add_parser("ppl", help="perplexity with eviction between prefill chunks")
    _common(ppl)
    ppl.add_argument("--tokens", type=int, default=2048, help="passage length")
    ppl.add_argument("--passages", type=int, default=2)
    commands.add_parser("passkey", help="the issue-2/3 passkey table (see python -m kvserve.eval.passkey -h)",
                        add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "passkey":
        from kvserve.eval import passkey

        passkey.main(rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from transformers import AutoTokenizer

    from kvserve.eval.report import plot_vs_budget

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    servers = [Server(url, args.model) for url in args.url.split(",")]
    policies, budgets = args.policies.split(","), _ints(args.budgets)
    if args.command == "tasks":
        from kvserve.eval import quality
        from kvserve.eval.tasks import make_cases

        cases = make_cases(tokenizer, args.tasks.split(","), _ints(args.lengths), args.samples, args.seed)
        rows = quality.run(servers, settings(policies, budgets), cases, args.out, progress=not args.quiet)
        print(quality.summary_table(rows), "", quality.matrix_table(rows), "", quality.best_per_budget(rows),
              quality.gate_summary(rows), sep="\n")
        values = {key: mean for key, (mean, _) in quality.mean_scores(rows, ("policy", "budget")).items()}
        if args.plot:
            title = f"Mean score over {len(args.tasks.split(','))} tasks at {args.lengths} tokens"
            plot_vs_budget(values, "mean task score", args.plot, title)
    else:
        from kvserve.eval import perplexity

        if len(servers) > 1:
            parser.error("--url: ppl uses one server (prompt chunking is a server setting)")
        passages = perplexity.texts(tokenizer, args.tokens, args.passages, args.seed)
        rows = perplexity.run(servers[0], settings(policies, budgets, evict_every_chunk=True), passages, args.out,
                              args.seed, progress=not args.quiet)
        print(perplexity.perplexity_table(rows))
        if args.plot:
            plot_vs_budget(perplexity.perplexities(rows), "perplexity", args.plot,
                           f"Perplexity, {args.tokens}-token passages, eviction between chunks", log_y=True)


if __name__ == "__main__":
    main()
