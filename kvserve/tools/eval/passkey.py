"""Passkey retrieval through any OpenAI-compatible server, with the eviction policy sent as headers.

    python -m kvserve.tools.eval.passkey --url http://127.0.0.1:8000 --tokens 3000 \\
        --policies full,streamingllm,snapkv --budgets 256,512,1024 --depths 0.1,0.5,0.9

Prints one row per policy and budget (accuracy over depths, mean prompt tokens, KV blocks freed as reported by the
server's `kvserve:blocks_freed_total`) and appends every answer to a JSON-lines file; rerunning the command
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from kvserve.tools.eval.client import Setting, append_row, load_rows, metric_sum
from kvserve.tools.eval.haystack import passkey_prompt
from kvserve.tools.eval.report import grid_table


def blocks_freed(url: str) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=30).text, "kvserve:blocks_freed_total")


def run(
    url: str,
    model: str,
    tokenizer_path: str,
    tokens: int,
    policies: list[str],
    budgets: list[int],
    depths: list[float],
    seed: int,
    out: str,
) -> list[dict]:
    """Runs every case not already in `out` (JSON lines, appended as each answer arrives: a run resumes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    cases = [(p, None) for p in policies if p == "full"] + [(p, b) for p in policies if p != "full" for b in budgets]
    rows = load_rows(out)
    done = {(r["policy"], r["budget"], r["depth"], r.get("tokens", tokens), r.get("seed", seed)) for r in rows}
    for policy, budget in cases:
        headers = Setting(policy, budget).headers()
        for depth in depths:
            if (policy, budget, depth, tokens, seed) in done:
                continue
            prompt, key = passkey_prompt(tokenizer, tokens, depth, seed)
            freed_before = blocks_freed(url)
            start = time.time()
            response = httpx.post(
                url + "/v1/completions",
                headers=headers,
                timeout=600,
                json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0},
            )
            response.raise_for_status()
            body = response.json()
            answer = body["choices"][0]["text"]
            rows.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "depth": depth,
                    "tokens": tokens,
                    "seed": seed,
                    "key": key,
                    "answer": answer,
                    "correct": key in answer,
                    "prompt_tokens": body["usage"]["prompt_tokens"],
                    "blocks_freed": blocks_freed(url) - freed_before,
                    "seconds": time.time() - start,
                }
            )
            append_row(out, rows[-1])
            print(json.dumps(rows[-1]), flush=True)
    wanted = {(p, b) for p, b in cases}
    return [
        r
        for r in rows
        if (r["policy"], r["budget"]) in wanted
        and r["depth"] in depths
        and r.get("tokens", tokens) == tokens
        and r.get("seed", seed) == seed
    ]


def summary(rows: list[dict]) -> str:
    lines = [
        "| policy | budget | accuracy | mean prompt tokens | blocks freed per request | answers |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["budget"]), []).append(row)
    for (policy, budget), group in groups.items():
        accuracy = sum(r["correct"] for r in group) / len(group)
        tokens = sum(r["prompt_tokens"] for r in group) / len(group)
        freed = sum(r["blocks_freed"] for r in group) / len(group)
        answers = "; ".join(repr(r["answer"].strip()[:16]) for r in group)
        lines.append(f"| {policy} | {budget or '-'} | {accuracy:.2f} | {tokens:.0f} | {freed:.1f} | {answers} |")
    return "\n".join(lines)


def matrix(rows: list[dict]) -> str:
    """Accuracy as a policy x budget table (the `full` row is the reference)."""
    groups: dict[tuple, list[bool]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["budget"]), []).append(row["correct"])
    return grid_table({key: sum(found) / len(found) for key, found in groups.items()}, ".1f")


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(
        prog="kvserve eval passkey", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    parser.add_argument("--tokenizer", default=str(default_model_dir()))
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--policies", default="full,streamingllm,snapkv")
    parser.add_argument("--budgets", default="256,512,1024")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="passkey.jsonl", help="answers, one JSON per line; an existing file resumes")
    args = parser.parse_args(argv)
    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    rows = run(
        args.url,
        model,
        args.tokenizer,
        args.tokens,
        args.policies.split(","),
        [int(b) for b in args.budgets.split(",")],
        [float(d) for d in args.depths.split(",")],
        args.seed,
        args.out,
    )
    print(summary(rows))
    print()
    print(matrix(rows))


if __name__ == "__main__":
    main()
