"""`kvserve bench chat`: multi-turn chat over one shared system document, vanilla vLLM against kvserve `full` and an
evicting policy (compacting eagerly; with `kv_evict_when=pressure`: only once the pool is short; with
`kv_checkpoint`: also at fixed prompt positions, publishing the compacted lists there), each server started here
with the same engine flags, in the same run.

C conversations run at once, each T turns: the system message is the same ~D-token document for all of them; each
turn adds a ~U-token user message and asks for an R-token reply (greedy, `ignore_eos`), and the next turn resends
the whole conversation with the reply the server streamed back, as chat clients do. So every turn after the first
can start from the prefix cache: the document (shared by all conversations) and the earlier turns. Each (server,
setting) run has a `cache_salt` of its own, so no run reuses another's cache.

Per turn it reports TTFT p50/p90, output tokens/s, the prefix hit rate (cached / prompt tokens, from the usage's
`prompt_tokens_details`) and the most KV cache in use (`vllm:kv_cache_usage_perc`; kvserve's exact head pages too),
once with the default pool and once with a pool that holds only 2 conversations at their longest without eviction.

    kvserve bench chat --out docs/eval/chat/chat.json --plot docs/eval/chat/chat.png
    kvserve bench chat --conversations 2 --turns 2 --doc-tokens 200 --user-tokens 20 --reply-tokens 4 --pools small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvserve.cpu_dtype import with_default_dtype
from kvserve.http_client import client_limits
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.servers import running_server
from kvserve.tools.eval.client import Setting, metric_sum, stream_chunks

SERVED_NAME = "bench"
TEMPLATE_MARGIN = 16  # chat-template tokens per message, on top of the text's


def conversation_texts(tokenizer, args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """The shared document and each conversation's user messages (distinct haystack text per conversation and turn)."""
    from kvserve.tools.eval.haystack import haystack

    document = tokenizer.decode(haystack(tokenizer, args.doc_tokens, seed=2000))
    users = [
        [
            tokenizer.decode(haystack(tokenizer, args.user_tokens, seed=3000 + 100 * number + turn))
            + " What does this add to the document?"
            for turn in range(args.turns)
        ]
        for number in range(args.conversations)
    ]
    return document, users


def small_pool_blocks(tokenizer, document: str, users: list[list[str]], args: argparse.Namespace) -> tuple[int, int]:
    """(pool, longest): the blocks of exactly 2 conversations at their longest (the last turn's prompt plus its
    reply) without eviction, the document's complete blocks counted once (vLLM's prefix cache shares them between
    conversations, so a pool sized without that holds about twice as many), and the blocks of one conversation."""

    def tokens(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    messages = [{"role": "system", "content": document}]
    shared = tokens(messages) // args.block_size
    for user in users[0]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "x " * args.reply_tokens}]
    longest = -(-(tokens(messages) + TEMPLATE_MARGIN * len(messages)) // args.block_size)
    return shared + 2 * (longest - shared), longest


async def _turn(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict],
    args,
    setting: Setting,
    salt: str,
    headers: dict | None = None,
) -> dict:
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": args.reply_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    start = time.perf_counter()
    first, text, usage = None, [], {}
    async for chunk in stream_chunks(client, url, "/v1/chat/completions", body, setting, headers):
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                first = first or time.perf_counter()
                text.append(content)
        usage = chunk.get("usage") or usage
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "start": start,
        "end": end,
        "ttft": (first or end) - start,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens") or 0,
        "output_tokens": usage.get("completion_tokens", 0),
        "reply": "".join(text),
    }


async def _conversation(
    client, url: str, number: int, document: str, users: list[str], args, setting, salt, headers: dict | None = None
) -> list:
    messages = [{"role": "system", "content": document}]
    records = []
    for turn, user in enumerate(users, start=1):
        messages.append({"role": "user", "content": user})
        record = await _turn(client, url, messages, args, setting, salt, headers)
        messages.append({"role": "assistant", "content": record.pop("reply")})
        records.append({"conversation": number, "turn": turn, **record})
    return records


async def _sample_usage(client: httpx.AsyncClient, url: str, stop: asyncio.Event, samples: list) -> None:
    while not stop.is_set():
        text = (await client.get(url + "/metrics")).text
        pages, total = metric_sum(text, "kvserve:kv_pages_in_use"), metric_sum(text, "kvserve:kv_pages_capacity")
        samples.append(
            (time.perf_counter(), metric_sum(text, "vllm:kv_cache_usage_perc"), pages / total if total else None)
        )
        await asyncio.sleep(0.1)


async def _run(url: str, document: str, users: list[list[str]], args, setting: Setting) -> dict:
    salt = uuid.uuid4().hex  # this run's own prefix cache
    async with httpx.AsyncClient(timeout=3600, limits=client_limits()) as client:
        before = (await client.get(url + "/metrics")).text
        stop, samples = asyncio.Event(), []
        sampler = asyncio.create_task(_sample_usage(client, url, stop, samples))
        start = time.perf_counter()
        conversations = await asyncio.gather(
            *(_conversation(client, url, n, document, turns, args, setting, salt) for n, turns in enumerate(users))
        )
        wall = time.perf_counter() - start
        stop.set()
        await sampler
        after = (await client.get(url + "/metrics")).text
    records = [record for conversation in conversations for record in conversation]

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    turns = [_turn_row(records, samples, turn) for turn in range(1, args.turns + 1)]
    for record in records:  # times relative to the run's start, for the JSON
        record["start"], record["end"] = record["start"] - start, record["end"] - start
    return {
        "wall_s": wall,
        "output_tokens_per_s": sum(r["output_tokens"] for r in records) / wall,
        "hit_rate": sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
        "prefix_cache_queries": delta("vllm:prefix_cache_queries_total"),
        "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
        "preemptions": delta("vllm:num_preemptions_total"),
        "blocks_published": delta("kvserve:prefix_blocks_published_total"),
        "publish_fallbacks": delta("kvserve:prefix_publish_fallbacks_total"),
        "checkpoints_published": delta("kvserve:checkpoints_published_total"),
        "checkpoint_hits": delta("kvserve:checkpoint_hits_total"),
        "turns": turns,
        "requests": records,
    }


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _turn_row(records: list[dict], samples: list[tuple], turn: int) -> dict:
    mine = [r for r in records if r["turn"] == turn]
    first, last = min(r["start"] for r in mine), max(r["end"] for r in mine)
    during = [sample for sample in samples if first <= sample[0] <= last] or samples[-1:]
    pages = [sample[2] for sample in during if sample[2] is not None]
    return {
        "turn": turn,
        "requests": len(mine),
        "ttft_p50": _percentile([r["ttft"] for r in mine], 50),
        "ttft_p90": _percentile([r["ttft"] for r in mine], 90),
        "output_tokens_per_s": sum(r["output_tokens"] for r in mine) / (last - first),
        "hit_rate": sum(r["cached_tokens"] for r in mine) / max(sum(r["prompt_tokens"] for r in mine), 1),
        "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in mine),
        "kv_usage_max": max(sample[1] for sample in during),
        "kv_pages_max": max(pages) if pages else None,
    }


def _checkpoint(text: str) -> int | str:
    return text if text == "turns" else int(text)


def evicting_settings(args) -> list[Setting]:
    """The evicting runs: one per kv_evict_when, then one per kv_checkpoint."""
    return [Setting(args.policy, args.budget, evict_when=when) for when in args.evict_when.split(",") if when] + [
        Setting(args.policy, args.budget, checkpoint=_checkpoint(c)) for c in args.checkpoints.split(",") if c
    ]


def refuse_what_the_server_would(settings: list[Setting]) -> None:
    """Each evicting setting through the server's own validation before any server starts, so a setting the server
    answers 400 (e.g. `kv_evict_when=pressure` for duoattention) ends the command at once with the server's reason
    instead of after the runs before it (minutes each on a larger model)."""
    from kvserve.config import parse_kv_config
    from kvserve.errors import InvalidSetting

    for setting in settings:
        try:
            parse_kv_config(setting.kv_args(), defaults={})
        except InvalidSetting as exc:
            raise SystemExit(f"kvserve bench chat: the server would refuse {setting.label}: {exc}") from exc


def run_pool(pool: str, engine_args: list[str], env: dict, document: str, users, args, log_dir: Path) -> list[dict]:
    servers = [
        ("vanilla", "vanilla", [Setting("full", None)]),
        ("kvserve", "kvserve", [Setting("full", None), *evicting_settings(args)]),
    ]
    results = []
    for label, kind, settings in servers:
        with running_server(kind, args.model, engine_args, log_dir / f"{pool}-{label}.log", env) as url:
            httpx.post(  # warm-up, sharing nothing with the document
                url + "/v1/completions",
                json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2},
                headers=Setting("full", None).headers(),  # not the server's default policy and budget
                timeout=600,
            ).raise_for_status()
            for setting in settings:
                name = "vanilla" if label == "vanilla" else f"kvserve {setting.label}"
                result = asyncio.run(_run(url, document, users, args, setting))
                result.update(pool=pool, server=name, policy=setting.label, budget=setting.budget)
                results.append(result)
                print(
                    f"{pool} {name}: {result['output_tokens_per_s']:.3g} output tok/s, hit rate "
                    f"{result['hit_rate']:.2f}, wall {result['wall_s']:.1f} s",
                    flush=True,
                )
    return results


def report(results: list[dict]) -> str:
    lines = []
    for pool in dict.fromkeys(r["pool"] for r in results):
        for result in (r for r in results if r["pool"] == pool):
            lines += [
                "",
                f"{pool} pool, {result['server']}: {result['output_tokens_per_s']:.2f} output tok/s, hit rate "
                f"{result['hit_rate']:.2f}, preemptions {result['preemptions']:.0f}, blocks published by evicting "
                f"requests {result['blocks_published']:.0f}, publish fallbacks {result['publish_fallbacks']:.0f}, "
                f"checkpoints published {result.get('checkpoints_published', 0):.0f}, requests resumed from one "
                f"{result.get('checkpoint_hits', 0):.0f}",
                "",
                "| turn | prompt tokens | TTFT p50 s | TTFT p90 s | output tok/s | hit rate | KV usage max "
                "| pages max |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for row in result["turns"]:
                pages = "-" if row["kv_pages_max"] is None else f"{row['kv_pages_max']:.2f}"
                lines.append(
                    f"| {row['turn']} | {row['prompt_tokens']:.0f} | {row['ttft_p50']:.3f} | {row['ttft_p90']:.3f} | "
                    f"{row['output_tokens_per_s']:.2f} | {row['hit_rate']:.2f} | {row['kv_usage_max']:.2f} | {pages} |"
                )
        vanilla, full, evicting_runs = _pool_runs(results, pool)
        for evicting in evicting_runs:
            name = evicting["policy"]
            lines += ["", f"{pool} pool, {name}: ratios per turn:", ""]
            lines += [
                f"| turn | {name} / full TTFT p50 | {name} / full hit rate | {name} / vanilla tok/s | full / vanilla "
                "tok/s |",
                "|---|---|---|---|---|",
            ]
            for v, f, e in zip(vanilla["turns"], full["turns"], evicting["turns"], strict=True):
                lines.append(
                    f"| {v['turn']} | {e['ttft_p50'] / f['ttft_p50']:.2f} | {_ratio(e['hit_rate'], f['hit_rate'])} | "
                    f"{e['output_tokens_per_s'] / v['output_tokens_per_s']:.2f} | "
                    f"{f['output_tokens_per_s'] / v['output_tokens_per_s']:.2f} |"
                )
    lines += ["", "Goals (issue 26):", ""] + goals(results)
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _pool_runs(results: list[dict], pool: str) -> tuple[dict, dict, list[dict]]:
    """The pool's vanilla run, kvserve `full` run and evicting runs (one per `--evict-when` and `--checkpoints`)."""
    runs = [r for r in results if r["pool"] == pool]
    vanilla = next(r for r in runs if r["server"] == "vanilla")
    full = next(r for r in runs if r["server"] == "kvserve full")
    evicting = [r for r in runs if r["server"].startswith("kvserve") and r["server"] != "kvserve full"]
    return vanilla, full, evicting


def goals(results: list[dict]) -> list[str]:
    """The issue's goals, measured: printed with PASS / FAIL, never asserted."""
    lines = []
    for pool in dict.fromkeys(r["pool"] for r in results):
        vanilla, full, evicting_runs = _pool_runs(results, pool)
        for evicting in evicting_runs:
            name = evicting["policy"]
            later = slice(1, None)  # turns 2 .. T
            ttft = statistics.median(r["ttft_p50"] for r in evicting["turns"][later]) / statistics.median(
                r["ttft_p50"] for r in full["turns"][later]
            )
            hits_e, hits_f = _later_hit_rate(evicting), _later_hit_rate(full)
            lines.append(
                f"- {pool} pool: {name} TTFT p50 on turns 2+ = {ttft:.2f}x full's (goal <= 1.2): "
                f"{'PASS' if ttft <= 1.2 else 'FAIL'}"
            )
            hit_ratio = hits_e / hits_f if hits_f else 0.0
            lines.append(
                f"- {pool} pool: {name} hit rate on turns 2+ = {hits_e:.2f}, full's {hits_f:.2f}, "
                f"ratio {hit_ratio:.2f} (goal >= 0.9): {'PASS' if hit_ratio >= 0.9 else 'FAIL'}"
            )
            if pool == "small":
                speed = evicting["output_tokens_per_s"] / vanilla["output_tokens_per_s"]
                lines.append(
                    f"- small pool: {name} output tok/s = {speed:.2f}x vanilla's (goal >= 2): "
                    f"{'PASS' if speed >= 2 else 'FAIL'}"
                )
    return lines


def _later_hit_rate(result: dict) -> float:
    later = [r for r in result["requests"] if r["turn"] > 1]
    return sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = list(dict.fromkeys(r["pool"] for r in results))
    figure, axes = plt.subplots(len(pools), 2, figsize=(10, 3.6 * len(pools)), squeeze=False)
    for (ttft, speed), pool in zip(axes, pools, strict=True):
        for result in (r for r in results if r["pool"] == pool):
            turns = [row["turn"] for row in result["turns"]]
            ttft.plot(turns, [row["ttft_p50"] for row in result["turns"]], "o-", label=result["server"])
            speed.plot(turns, [row["output_tokens_per_s"] for row in result["turns"]], "o-", label=result["server"])
        for ax, title in ((ttft, "TTFT p50 (s)"), (speed, "output tokens/s")):
            ax.set_title(f"{pool} pool: {title} by turn")
            ax.set_xlabel("turn")
            ax.legend()
        ttft.set_yscale("log")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(
        prog="kvserve bench chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1500, help="the shared system document")
    parser.add_argument("--user-tokens", type=int, default=100, help="each user message")
    parser.add_argument("--reply-tokens", type=int, default=64, help="each reply (ignore_eos)")
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument(
        "--evict-when",
        default="eager,pressure",
        help="kv_evict_when of the evicting runs, a comma list: eager (compact at the end of each prompt), pressure "
        "(compact only once the pool is short)",
    )
    parser.add_argument(
        "--checkpoints",
        default="turns,128",
        help="kv_checkpoint of more evicting runs, a comma list: turns (checkpoints where chat turns end) and/or "
        "token counts (multiples of --block-size); empty: none",
    )
    parser.add_argument(
        "--pools",
        default="default,small",
        help="default (the KV space below) and/or small (holds 2 conversations at their longest without eviction)",
    )
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE for every server")
    parser.add_argument("--server-args", default="", help="more engine flags for every server, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--plot", default=None, help="PNG: TTFT p50 and output tokens/s by turn, per pool")
    args = parser.parse_args(argv)
    refuse_what_the_server_would(evicting_settings(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    document, users = conversation_texts(tokenizer, args)
    small_blocks, longest_blocks = small_pool_blocks(tokenizer, document, users, args)
    longest_tokens = longest_blocks * args.block_size
    engine_args = [
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        str(longest_tokens + args.block_size),
        "--block-size",
        str(args.block_size),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: the hit rate per request
        *shlex.split(args.server_args),
    ]
    engine_args = with_default_dtype(engine_args, "bench chat")
    env = {"VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib}
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-chat-") as log_dir:
        for pool in args.pools.split(","):
            if pool not in ("default", "small"):
                raise SystemExit(f"--pools: unknown pool {pool!r} (default, small)")
            pool_args = engine_args + (["--num-gpu-blocks-override", str(small_blocks)] if pool == "small" else [])
            print(f"bench chat: {pool} pool" + (f" of {small_blocks} blocks" if pool == "small" else ""), flush=True)
            results += run_pool(pool, pool_args, env, document, users, args, Path(log_dir))
    print(report(results))
    if args.plot:
        plot(results, args.plot)
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name, "small_pool_blocks": small_blocks}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        ran = provenance(command_line(argv, "kvserve bench chat"))
        Path(args.out).write_text(
            json.dumps({"command": "chat", "args": recorded, "provenance": ran, "results": results}, indent=1)
        )
