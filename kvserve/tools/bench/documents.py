"""`kvserve bench documents`: one long document, many questions ("compress once, ask many"), vanilla vLLM against
kvserve, each server started here with the same engine flags, in the same run.

Every question is the document followed by a short question of its own; its time to first token is the latency of
a one-token completion (the prompt's prefill plus one sampled token), taken Q times:
- `recompute`: every question under a `cache_salt` of its own, so nothing is cached (vanilla, and kvserve `full`);
- `prefix hit`: the document cached by a first request, every question reads it from vLLM's prefix cache in full
  (vanilla, and kvserve `full`);
- `compressed`: the document compressed once per policy of --policies, at --budget entries per layer and KV head
  (KVzip by its reconstruction, `POST /v1/kvserve/compress`; any other policy, KVzap's among them, by its own scores
  where the document ends: a one-token completion of the document with `kv_document`), every question resumes from
  the compressed lists (`kv_document`) and computes only its own tokens.

It prints each mode's TTFT p50 and its ratio to vanilla's recompute, the time the compression took (paid once per
document), and how many questions pay it back against recomputing.

    kvserve bench documents --doc-tokens 3000 --questions 6 --out docs/eval/documents.json
    kvserve bench documents --doc-tokens 4000 --policies kvzip,kvzap --out docs/eval/kvzap/documents.json
    kvserve bench documents --model "$(kvserve setup-model qwen2.5-coder-0.5b)" --doc-tokens 4000 \\
        --out docs/eval/qwen05/documents.json
"""

from __future__ import annotations

import argparse
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

SERVED_NAME = "bench"
QUESTIONS = (
    "What is this text about?",
    "Which names does the text mention?",
    "What does the text say first?",
    "Which example does the text give?",
    "What would a reader learn from it?",
    "Which word does the text use most?",
    "What is the last topic of the text?",
    "Who would read this text?",
)


def texts(tokenizer, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The document (haystack prose ending in a newline) and the questions that follow it."""
    from kvserve.tools.eval.haystack import haystack

    document = tokenizer.decode(haystack(tokenizer, args.doc_tokens, seed=4100)) + "\n"
    return document, [QUESTIONS[i % len(QUESTIONS)] + f" ({i + 1})" for i in range(args.questions)]


def first_token_seconds(client: httpx.Client, url: str, prompt: str, salt: str, kv: dict | None = None) -> dict:
    """One one-token completion: its latency (TTFT: prefill and one sampled token) and its usage block."""
    headers = {"x-kv-policy": "full"} if kv is None else {}
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    started = time.perf_counter()
    response = client.post(url + "/v1/completions", json={**body, **(kv or {})}, headers=headers)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")
    return {"seconds": seconds, "usage": response.json()["usage"]}


def run_server(kind: str, url: str, document: str, questions: list[str], args: argparse.Namespace) -> list[dict]:
    """One server's modes: (server, mode, per-question TTFTs, extra) rows."""
    rows = []
    with httpx.Client(timeout=1800, limits=client_limits()) as client:
        first_token_seconds(client, url, "Warm up the engine.", uuid.uuid4().hex)
        recompute = [first_token_seconds(client, url, document + q, uuid.uuid4().hex) for q in questions]
        rows.append({"server": kind, "mode": "recompute", "ttft": [r["seconds"] for r in recompute]})
        salt = uuid.uuid4().hex
        first_token_seconds(client, url, document + "Read this.", salt)  # caches the document's blocks
        hits = [first_token_seconds(client, url, document + q, salt) for q in questions]
        rows.append({"server": kind, "mode": "prefix hit", "ttft": [r["seconds"] for r in hits]})
        if kind == "vanilla":
            return rows
        for policy in args.policies.split(","):
            salt = uuid.uuid4().hex
            started = time.perf_counter()
            kv, tokens = compress(client, url, document, salt, policy, args.budget)
            compress_seconds = time.perf_counter() - started
            asked = [first_token_seconds(client, url, document + q, salt, kv) for q in questions]
            resumed = sum(bool(r["usage"].get("kv_tokens_evicted")) for r in asked)
            rows.append(
                {
                    "server": kind,
                    "mode": f"compressed ({policy}, B={args.budget})",
                    "ttft": [r["seconds"] for r in asked],
                    "compress_seconds": compress_seconds,
                    "document_tokens": tokens,
                    "resumed": resumed,
                }
            )
    return rows


def compress(client: httpx.Client, url: str, document: str, salt: str, policy: str, budget: int) -> tuple[dict, int]:
    """Compress the document once under `policy`: KVzip by its reconstruction (`POST /v1/kvserve/compress`), any
    other policy by its own scores where the document ends (a one-token completion of the document alone with
    `kv_document`, its token count). Returns the settings every question sends, and the document's tokens."""
    from kvserve.policies import POLICIES

    settings = {"kv_policy": policy, "kv_budget": budget}
    if POLICIES[policy].reconstructs:
        made = client.post(
            url + "/v1/kvserve/compress",
            json={"model": SERVED_NAME, "prompt": document, "cache_salt": salt, **settings},
        )
        if made.status_code != 200:
            raise RuntimeError(f"compress answered {made.status_code}: {made.text[:500]}")
        return made.json()["kv"], made.json()["document_tokens"]
    counted = client.post(url + "/tokenize", json={"model": SERVED_NAME, "prompt": document})
    if counted.status_code != 200:
        raise RuntimeError(f"/tokenize answered {counted.status_code}: {counted.text[:500]}")
    kv = {**settings, "kv_document": counted.json()["count"]}
    first_token_seconds(client, url, document, salt, kv)  # compacts the document where it ends and publishes it
    return kv, kv["kv_document"]


def report(rows: list[dict]) -> str:
    base = statistics.median(next(r for r in rows if r["server"] == "vanilla" and r["mode"] == "recompute")["ttft"])
    lines = [
        "| server | mode | TTFT p50 s | TTFT max s | / vanilla recompute | compress s | questions to pay it back "
        "| resumed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p50 = statistics.median(row["ttft"])
        compress, payback, resumed = "-", "-", "-"
        if "compress_seconds" in row:
            resumed = f"{row['resumed']} of {len(row['ttft'])}"
            compress = f"{row['compress_seconds']:.1f}"
            saved = base - p50
            payback = f"{row['compress_seconds'] / saved:.1f}" if saved > 0 else "never"
        lines.append(
            f"| {row['server']} | {row['mode']} | {p50:.3f} | {max(row['ttft']):.3f} | {p50 / base:.2f} | "
            f"{compress} | {payback} | {resumed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(
        prog="kvserve bench documents", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(default_model_dir()), help="a model folder")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--questions", type=int, default=6, help="questions per mode")
    parser.add_argument(
        "--policies", default="kvzip", help="the compressing policies, comma-separated (kvzip, or any by kv_document)"
    )
    parser.add_argument("--budget", type=int, default=512, help="entries per layer and KV head of the document")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE for every server")
    parser.add_argument("--server-args", default="", help="more engine flags for every server, one string")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    document, questions = texts(tokenizer, args)
    # the compression's prompt is the document twice and the repeat instruction
    max_len = -(-(2 * args.doc_tokens + 64) // args.block_size) * args.block_size
    engine_args = ["--served-model-name", SERVED_NAME, "--max-model-len", str(max_len)]
    engine_args += ["--block-size", str(args.block_size), *shlex.split(args.server_args)]
    engine_args = with_default_dtype(engine_args, "bench documents")
    env = {"VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-documents-") as log_dir:
        for kind in ("vanilla", "kvserve"):
            # every request names its settings, so the model's profile (kvserve's defaults for it) plays no part
            server_args = engine_args + (["--kv-profile", "none"] if kind == "kvserve" else [])
            with running_server(kind, args.model, server_args, Path(log_dir) / f"{kind}.log", env) as url:
                rows += run_server(kind, url, document, questions, args)
                print(f"bench documents: {kind} done", flush=True)
    print(report(rows))
    if args.out:
        recorded = {**vars(args), "model": Path(args.model).name}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        ran = provenance(command_line(argv, "kvserve bench documents"))
        Path(args.out).write_text(
            json.dumps({"command": "documents", "args": recorded, "provenance": ran, "results": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
