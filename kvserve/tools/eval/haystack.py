"""Deterministic haystack text and passkey prompts from Python's own documentation (`pydoc_data.topics`).

No data set can be downloaded here; this prose is always present and long enough (~465 kB).
"""

from __future__ import annotations

import random
import re
from functools import cache


@cache
def corpus() -> str:
    from pydoc_data.topics import topics

    text = " ".join(topics[key] for key in sorted(topics))
    return re.sub(r"\s+", " ", text)


def haystack(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` tokens of documentation prose, starting at a seed-chosen sentence."""
    text = corpus()
    rng = random.Random(seed)
    start = rng.randrange(0, len(text) // 2)
    start = text.find(". ", start) + 2
    ids = tokenizer.encode(text[start : start + num_tokens * 8], add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"haystack too short for {num_tokens} tokens")
    return ids[:num_tokens]


def passkey_prompt(tokenizer, num_tokens: int, depth: float, seed: int = 0) -> tuple[str, str]:
    """A prompt of about `num_tokens` tokens hiding a 5-digit pass key at `depth` (0 = start, 1 = end).

    Returns (prompt text, pass key).
    """
    rng = random.Random(seed * 1000 + int(depth * 100))
    key = str(rng.randrange(10000, 100000))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    budget = num_tokens - len(tokenizer.encode(needle + question, add_special_tokens=False))
    filler = haystack(tokenizer, budget, seed)
    cut = int(len(filler) * depth)
    text = (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it."
        + tokenizer.decode(filler[:cut])
        + needle
        + tokenizer.decode(filler[cut:])
        + question
    )
    return text, key
