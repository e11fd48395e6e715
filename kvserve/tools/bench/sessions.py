"""`kvserve bench sessions`: where a conversation's turns land with data parallelism, and whether they resume.

One `kvserve serve --data-parallel-size N` (vLLM's internal balancer, an engine per CPU group) serves C conversations
at once, T turns each, with turn checkpoints (`kv_checkpoint=turns`: each turn compacts where its prompt ends and
publishes the compacted lists; the next turn of the conversation can resume from them, in the engine that holds
them). The same conversations run twice, each run with a `cache_salt` of its own: once as vLLM's balancer routes
them (least loaded engine per request), once with a session per conversation (`x-kv-session`, which kvserve maps to
one engine: `kvserve/server/affinity.py`). Per run it reports the share of later turns that resumed from a checkpoint
(`kvserve:checkpoint_hits_total` over the C x (T-1) later turns), the engines' shares of the requests (vLLM's
`vllm:request_success_total{engine}`), TTFT p50 of the later turns and output tokens/s.

    kvserve bench sessions --out docs/eval/scale/sessions.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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


async def run_mode(url: str, mode: str, document: str, users: list[list[str]], args) -> dict:
    setting = Setting(args.policy, args.budget, checkpoint="turns")
    salt = uuid.uuid4().hex  # this run's own prefix cache
    async with httpx.AsyncClient(timeout=3600, limits=client_limits()) as client:
        before = (await client.get(url + "/metrics")).text
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
                    setting if mode == "balancer" else dataclasses.replace(setting, knobs=(("session", f"c{number}"),)),
                    salt,
                )
                for number, turns in enumerate(users)
            )
        )
        wall = time.perf_counter() - start
        after = (await client.get(url + "/metrics")).text
    records = [record for conversation in conversations for record in conversation]
    later = [record for record in records if record["turn"] > 1]
    hits = grew(before, after, "kvserve:checkpoint_hits_total")
    return {
        "mode": mode,
        "later_turns": len(later),
        "checkpoint_hits": hits,
        "resumed_share": sum(hits.values()) / len(later),
        "requests_per_engine": grew(before, after, "vllm:request_success_total"),
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
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    document, users = conversation_texts(tokenizer, args)
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "8192",
        "--block-size",
        str(args.block_size),
        "--data-parallel-size",
        str(args.data_parallel_size),
        *args.server_args.split(),
    ]
    engine_args = with_default_dtype(engine_args, "bench")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as log_dir:
        with running_server("kvserve", args.model, engine_args, Path(log_dir) / "server.log") as url:
            for mode in MODES:
                results.append(asyncio.run(run_mode(url, mode, document, users, args)))
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
