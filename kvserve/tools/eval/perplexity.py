"""Perplexity of long text under eviction, from the prompt log-probabilities the server returns.

The server must prefill in chunks (`kvserve serve --max-num-batched-tokens 256` makes 256-token chunks for a lone
request) and the policy evicts between chunks (`x-kv-evict-every-chunk: true`, sent for every policy but `full`).
Each chunk's tokens are then predicted from the evicted cache of everything before them: the block-wise setting of
the CAOTE paper. Tokens before the cache first exceeds the budget see the full cache, as they would in serving.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

from kvserve.tools.eval.client import Server, Setting, append_row, load_rows
from kvserve.tools.eval.haystack import corpus
from kvserve.tools.eval.report import grid_table


def texts(tokenizer, length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` passages of `length` tokens from seed-chosen places in the corpus."""
    text = corpus()
    rng = random.Random(f"perplexity/{seed}")
    passages = []
    for _ in range(count):
        start = text.find(". ", rng.randrange(0, len(text) - length * 8)) + 2
        passages.append(tokenizer.encode(text[start : start + length * 8], add_special_tokens=False)[:length])
    return passages


def token_logprobs(server: Server, setting: Setting, token_ids: list[int]) -> list[float]:
    """Log-probability of each prompt token given the ones before it (the first token has none)."""
    body = server.complete(setting, token_ids, max_tokens=1, prompt_logprobs=0)
    entries = body["choices"][0]["prompt_logprobs"]
    logprobs = []
    for token_id, entry in zip(token_ids[1:], entries[1:], strict=True):
        logprobs.append(entry[str(token_id)]["logprob"])
    return logprobs


def run(
    server: Server, settings: list[Setting], passages: list[list[int]], out: str, seed: int = 0, progress: bool = True
) -> list[dict]:
    from tqdm import tqdm

    rows = load_rows(out)
    length = len(passages[0])
    done = {(r["policy"], r["budget"], r["passage"], r["length"], r["seed"]) for r in rows}
    todo = [(s, i) for s in settings for i in range(len(passages)) if (s.label, s.budget, i, length, seed) not in done]
    for setting, index in tqdm(todo, disable=not progress, desc="passages", unit="req"):
        start = time.time()
        logprobs = token_logprobs(server, setting, passages[index])
        row = {
            "policy": setting.label,
            "budget": setting.budget,
            "passage": index,
            "length": length,
            "seed": seed,
            "nll_sum": -sum(logprobs),
            "tokens": len(logprobs),
            "seconds": round(time.time() - start, 3),
        }
        rows.append(row)
        append_row(out, row)
    wanted = {(s.label, s.budget) for s in settings}
    return [r for r in rows if (r["policy"], r["budget"]) in wanted and r["length"] == length and r["seed"] == seed]


def perplexities(rows: list[dict]) -> dict[tuple, float]:
    """exp(mean negative log-likelihood per token) for each (policy, budget), pooled over passages."""
    nll: dict[tuple, float] = defaultdict(float)
    tokens: dict[tuple, int] = defaultdict(int)
    for row in rows:
        nll[(row["policy"], row["budget"])] += row["nll_sum"]
        tokens[(row["policy"], row["budget"])] += row["tokens"]
    return {key: math.exp(nll[key] / tokens[key]) for key in nll}


def perplexity_table(rows: list[dict]) -> str:
    return grid_table(perplexities(rows))
