"""Synthetic retrieval samples for DuoAttention's gates, the paper's kind of data (its Section 3.2): a haystack of
prose with several passkeys (sequences of words) hidden at random depths, then a request to recite them, followed by
the passkeys themselves. The loss reads the positions of that answer, where a head that retrieves from far back
matters and one that only looks at sinks and recent tokens does not.

The prose is the train split of Python's documentation (`kvserve.tools.training.corpus.load_corpus`, the topics the
held-out split does not hold); the passkey words are drawn from that prose's own vocabulary, so no word list is needed.
Different from the evaluation tasks (`kvserve.tools.eval.tasks`): words, not numbers, several keys recited in order.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INTRO = "There are secret word sequences hidden in the following text. Memorize them in order.\n"
QUESTION = "\nRecite every secret word sequence above, in order. The secret word sequences are:"


@dataclass(frozen=True)
class RetrievalSample:
    ids: list[int]  # the whole sequence: intro, haystack with passkeys, question, answer
    answer_start: int  # the first position of the answer (the recited passkeys)


def vocabulary(text: str, minimum_length: int = 4) -> list[str]:
    """The distinct lower-case words of `text` (letters only, at least `minimum_length` long), sorted."""
    return sorted({word.lower() for word in re.findall(r"[A-Za-z]+", text) if len(word) >= minimum_length})


def retrieval_sample(
    tokenizer, stream: list[int], words: list[str], length: int, rng: random.Random, keys: int = 4, key_words: int = 6
) -> RetrievalSample:
    """About `length` tokens: `keys` passkeys of `key_words` words at sorted random depths in a window of `stream`,
    the question, and the passkeys recited."""
    passkeys = [" ".join(rng.sample(words, key_words)) for _ in range(keys)]
    needles = [f" Secret word sequence {i + 1}: {key}. " for i, key in enumerate(passkeys)]
    answer = " " + "; ".join(passkeys) + "."
    encode = tokenizer.encode
    fixed = [encode(text, add_special_tokens=False).ids for text in (INTRO, *needles, QUESTION)]
    answer_ids = encode(answer, add_special_tokens=False).ids
    filler_length = length - sum(len(part) for part in fixed) - len(answer_ids)
    if filler_length < keys:
        raise ValueError(f"{length} tokens leave no room for a haystack around {keys} passkeys")
    start = rng.randrange(0, len(stream) - filler_length)
    filler = stream[start : start + filler_length]
    cuts = sorted(rng.randrange(0, filler_length) for _ in range(keys))
    ids, previous = list(fixed[0]), 0
    for cut, needle in zip(cuts, fixed[1:-1], strict=True):
        ids += filler[previous:cut] + needle
        previous = cut
    ids += filler[previous:] + fixed[-1]
    return RetrievalSample(ids + answer_ids, len(ids))
