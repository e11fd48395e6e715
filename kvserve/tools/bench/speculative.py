"""`kvserve bench speculative`: n-gram speculative decoding with eviction, on a document-QA workload whose answers
quote their documents, at equal KV memory: vanilla vLLM, vanilla + n-gram, kvserve, kvserve + n-gram, each server
started here with the same engine flags and pool (`--num-gpu-blocks-override`), in the same run.

Every request is a document of its own, an instruction to repeat it, and its first words (so the answer copies the
document, which prompt lookup drafts from); all are sent at once, greedy, `--max-tokens` each. Per server it prints
output tokens/s and the two ratios that decide (kvserve + n-gram against kvserve, and against vanilla +
n-gram), the acceptance rate (accepted / proposed draft tokens, from vLLM's counters), the most requests running at
once, and whether each server's answers with speculation equal its answers without (greedy in float32 kvserve's
must; in bfloat16 a verify step's rounding differs from one-token steps', which can tip a compaction's choice).

    kvserve bench speculative --prompts 8 --doc-tokens 1800 --max-tokens 192 --num-blocks 80 \\
        --out docs/eval/speculative-long-documents.json

With 1800-token documents the pool holds one request without eviction, so eviction's room adds to the drafts' gain;
with 600-token documents (`--doc-tokens 600 --out docs/eval/speculative.json`) it holds three, and on 2 CPU cores
more requests at once add little throughput.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from kvserve.cpu_dtype import with_default_dtype
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.servers import running_server
from kvserve.tools.bench.workload import run_workload
from kvserve.tools.eval.client import Setting, metric_sum

SERVED_NAME = "bench"
REPEAT = " Repeat the text above word for word:"
QUOTED_TOKENS = 16  # the document's first tokens after the instruction: the answer goes on from there
SERVERS = (("vanilla", False), ("vanilla", True), ("kvserve", False), ("kvserve", True))
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def quoting_prompts(model: str, count: int, tokens: int) -> list[list[int]]:
    """`count` documents of `tokens` tokens (seeded haystack prose), each asked to be repeated."""
    from transformers import AutoTokenizer

    from kvserve.tools.eval.haystack import haystack

    tokenizer = AutoTokenizer.from_pretrained(model)
    repeat = tokenizer.encode(REPEAT, add_special_tokens=False)
    documents = [haystack(tokenizer, tokens, seed=5200 + number) for number in range(count)]
    return [document + repeat + document[:QUOTED_TOKENS] for document in documents]


def speculation_counters(metrics_text: str) -> dict[str, float]:
    return {name: metric_sum(metrics_text, f"vllm:spec_decode_{name}_total") for name in COUNTERS}


def run_server(url: str, prompts: list[list[int]], args: argparse.Namespace, evicting: bool) -> dict:
    import httpx

    setting = Setting(args.policy, args.budget) if evicting else Setting("full", None)
    run_workload(url, SERVED_NAME, prompts[:1], 4, setting, salt="warm-up")
    before = speculation_counters(httpx.get(url + "/metrics", timeout=60).text)  # the warm-up's drafts left out
    summary = run_workload(url, SERVED_NAME, prompts, args.max_tokens, setting, keep_texts=True)
    after = speculation_counters(httpx.get(url + "/metrics", timeout=60).text)
    summary["speculation"] = {name: after[name] - before[name] for name in COUNTERS}
    summary["setting"] = setting.label if not evicting else f"{setting.label} B={args.budget}"
    return summary


def label(kind: str, ngram: bool) -> str:
    return kind + (" + n-gram" if ngram else "")


def report(rows: list[dict]) -> str:
    by_label = {row["server"]: row for row in rows}
    vanilla_ngram = by_label.get(label("vanilla", True))
    lines = [
        "| server | setting | output tokens/s | / same server without n-gram | / vanilla + n-gram | accepted drafts "
        "| peak running | answers as without n-gram |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        speed = row["output_tokens_per_s"]
        plain = by_label.get(label(row["kind"], False))
        against_plain = f"{speed / plain['output_tokens_per_s']:.2f}" if row["ngram"] and plain else "-"
        against_vanilla = f"{speed / vanilla_ngram['output_tokens_per_s']:.2f}" if vanilla_ngram else "-"
        drafted = row["speculation"]["num_draft_tokens"]
        accepted = f"{row['speculation']['num_accepted_tokens'] / drafted:.0%} of {drafted:.0f}" if drafted else "-"
        same = "-"
        if row["ngram"] and plain:
            equal = sum(a == b for a, b in zip(row["texts"], plain["texts"], strict=True))
            same = f"{equal} of {len(row['texts'])}"
        lines.append(
            f"| {row['server']} | {row['setting']} | {speed:.1f} | {against_plain} | {against_vanilla} | {accepted} | "
            f"{row['peak_running']:.0f} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(
        prog="kvserve bench speculative", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()), help="a model folder")
    parser.add_argument("--prompts", type=int, default=8, help="requests, all sent at once")
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=192, help="output tokens per request (ignore_eos)")
    parser.add_argument("--policy", default="snapkv", help="kvserve's policy")
    parser.add_argument("--budget", type=int, default=256, help="kvserve's entries per layer and KV head")
    parser.add_argument("--num-blocks", type=int, default=80, help="the KV pool of every server, in blocks (<1 GiB)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
        help="vLLM's --speculative-config for the n-gram servers",
    )
    parser.add_argument("--server-args", default="", help="more engine flags for every server, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)

    prompts = quoting_prompts(args.model, args.prompts, args.doc_tokens)
    longest = max(len(prompt) for prompt in prompts) + args.max_tokens + 8
    max_len = -(-longest // args.block_size) * args.block_size
    engine_args = ["--served-model-name", SERVED_NAME, "--max-model-len", str(max_len)]
    engine_args += ["--block-size", str(args.block_size), "--num-gpu-blocks-override", str(args.num_blocks)]
    engine_args = with_default_dtype([*engine_args, *shlex.split(args.server_args)], "bench speculative")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-speculative-") as log_dir:
        for kind, ngram in SERVERS:
            server_args = engine_args + (["--speculative-config", args.speculative_config] if ngram else [])
            # every request names its settings, so the model's profile (kvserve's defaults for it) plays no part
            server_args += ["--kv-profile", "none"] if kind == "kvserve" else []
            log = Path(log_dir) / f"{kind}{'-ngram' * ngram}.log"
            with running_server(kind, args.model, server_args, log, {"VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
                row = run_server(url, prompts, args, evicting=kind == "kvserve")
            rows.append({"server": label(kind, ngram), "kind": kind, "ngram": ngram, **row})
            print(f"bench speculative: {label(kind, ngram)} done", flush=True)
    print(report(rows))
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        ran = provenance(command_line(argv, "kvserve bench speculative"))
        Path(args.out).write_text(
            json.dumps({"command": "speculative", "args": recorded, "provenance": ran, "results": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
