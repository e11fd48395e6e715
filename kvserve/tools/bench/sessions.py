"""`kvserve bench sessions`: where a conversation's turns land with several engines, and whether they resume.

C conversations run at once, T turns each, with turn checkpoints (`kv_checkpoint=turns`: each turn compacts where
its prompt ends and publishes the compacted lists; the next turn of the conversation can resume from them, on the
engine that holds them). A run's conversations send a session each (`X-Session-ID`, the ecosystem's key, which
kvserve reads as `x-kv-session`) or none, and each run has a `cache_salt` of its own. Two set-ups:

- one `kvserve serve --data-parallel-size N` (an engine per CPU group): the same conversations as vLLM's balancer
  routes them (least loaded engine per request) and by session (`kvserve/server/affinity.py` maps one to an engine);
- `--replicas N`: N `kvserve serve` servers (one CPU each here) behind vLLM's router (`vllm-router`), once per
  `--router-policies` entry: round_robin, consistent_hash (on X-Session-ID), cache_aware (prefix trees of the
  prompts' text), kv_aware (from the servers' KV-cache events, `--kv-events-config`).

Per run: the share of later turns that resumed from a checkpoint (`kvserve:checkpoint_hits_total` over the C x (T-1)
later turns), each engine's requests (`vllm:request_success_total`), TTFT p50 of the later turns and output tokens/s.

    kvserve bench sessions --out docs/eval/scale/sessions.json
    kvserve bench sessions --replicas 2 --out docs/eval/scale/router.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvserve.cpu_dtype import with_default_dtype
from kvserve.http_client import client_limits
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.chat import SERVED_NAME, _conversation, conversation_texts
from kvserve.tools.bench.replicas import ROUTER_POLICIES, routed_runs
from kvserve.tools.bench.servers import running_server
from kvserve.tools.eval.client import Setting

MODES = ("balancer", "session")


def per_engine(text: str, name: str) -> dict[str, float]:
    """A series' value per `engine` label in Prometheus text, summed over its other labels."""
    totals: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        engine = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("engine", "0")
        totals[engine] = totals.get(engine, 0.0) + float(value)
    return totals


def grew(before: str, after: str, name: str) -> dict[str, float]:
    """How much a series grew per engine between two scrapes (engines the later one has)."""
    old = per_engine(before, name)
    return {engine: value - old.get(engine, 0.0) for engine, value in sorted(per_engine(after, name).items())}


async def run_mode(
    url: str, replicas: dict[str, str], mode: str, document: str, users: list[list[str]], args, session: bool
) -> dict:
    """The conversations sent to `url`; `replicas` (name -> URL) are the servers whose metrics count (their engines
    labelled `name:engine` where there are several servers)."""
    setting = Setting(args.policy, args.budget, checkpoint="turns")
    salt = uuid.uuid4().hex  # this run's own prefix cache

    async def scrape(client: httpx.AsyncClient) -> dict[str, str]:
        return {name: (await client.get(base + "/metrics")).text for name, base in replicas.items()}

    def grown(before: dict[str, str], after: dict[str, str], metric: str) -> dict[str, float]:
        totals = {}
        for name in replicas:
            engines = grew(before[name], after[name], metric)
            for engine, value in engines.items():  # a server of several engines: replica:engine
                totals[engine if len(replicas) == 1 else name if len(engines) == 1 else f"{name}:{engine}"] = value
        return totals

    async with httpx.AsyncClient(timeout=3600, limits=client_limits()) as client:
        before = await scrape(client)
        start = time.perf_counter()
        conversations = await asyncio.gather(
            *(
                _conversation(
                    client,
                    url,
                    number,
                    document,
                    turns,
                    args,
                    setting,
                    salt,
                    {"X-Session-ID": f"c{number}-{salt[:8]}"} if session else None,
                )
                for number, turns in enumerate(users)
            )
        )
        wall = time.perf_counter() - start
        after = await scrape(client)
    records = [record for conversation in conversations for record in conversation]
    later = [record for record in records if record["turn"] > 1]
    hits = grown(before, after, "kvserve:checkpoint_hits_total")
    return {
        "mode": mode,
        "later_turns": len(later),
        "checkpoint_hits": hits,
        "resumed_share": sum(hits.values()) / len(later),
        "requests_per_engine": grown(before, after, "vllm:request_success_total"),
        "later_ttft_p50": statistics.median(record["ttft"] for record in later),
        "output_tokens_per_s": sum(record["output_tokens"] for record in records) / wall,
        "wall_s": wall,
    }


def report(results: list[dict]) -> str:
    lines = [
        "| routing | later turns | resumed from a checkpoint | hits per engine | requests per engine | "
        "later turns' TTFT p50 s | output tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['later_turns']} | {100 * r['resumed_share']:.0f}% | "
            + ", ".join(f"{e}: {v:.0f}" for e, v in r["checkpoint_hits"].items())
            + " | "
            + ", ".join(f"{e}: {v:.0f}" for e, v in r["requests_per_engine"].items())
            + f" | {r['later_ttft_p50']:.2f} | {r['output_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(prog="kvserve bench sessions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument(
        "--replicas", type=int, default=0, help="N kvserve servers behind vllm-router instead of one data-parallel one"
    )
    parser.add_argument(
        "--sessions",
        choices=("header", "none"),
        default="header",
        help="with --replicas: each conversation sends X-Session-ID, or nothing that names it",
    )
    parser.add_argument(
        "--router-policies",
        default=",".join(ROUTER_POLICIES),
        help=f"vllm-router's policies to run, in order (with --replicas; of {', '.join(ROUTER_POLICIES)})",
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=600, help="the system document all conversations share")
    parser.add_argument("--user-tokens", type=int, default=60)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--server-args", default="", help="more engine flags, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    if args.replicas < 0:
        parser.error("--replicas must be 0 (one data-parallel server) or more")
    if not args.replicas and (args.sessions != "header" or args.router_policies != ",".join(ROUTER_POLICIES)):
        parser.error("--sessions and --router-policies apply to servers behind vllm-router: give --replicas N")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    document, users = conversation_texts(tokenizer, args)
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "8192",
        "--block-size",
        str(args.block_size),
        *args.server_args.split(),
    ]
    engine_args = with_default_dtype(engine_args, "bench")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as log_dir:
        if args.replicas:
            for policy, routed in routed_runs(args, engine_args, Path(log_dir)):
                mode = f"vllm-router {policy}" + ", no session" * (args.sessions == "none")
                run = run_mode(routed.url, routed.replicas, mode, document, users, args, args.sessions == "header")
                results.append(asyncio.run(run))
                print(f"{policy}: {results[-1]['resumed_share']:.0%} of later turns resumed", flush=True)
        else:
            dp = [*engine_args, "--data-parallel-size", str(args.data_parallel_size)]
            with running_server("kvserve", args.model, dp, Path(log_dir) / "server.log") as url:
                for mode in MODES:
                    run = run_mode(url, {"": url}, mode, document, users, args, mode == "session")
                    results.append(asyncio.run(run))
                    print(f"{mode}: {results[-1]['resumed_share']:.0%} of later turns resumed", flush=True)
    print()
    print(report(results))
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name, "out": Path(args.out).name}
        ran = provenance(command_line(argv, "kvserve bench sessions"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"command": "sessions", "args": recorded, "provenance": ran, "results": results}, indent=1)
        )
