"""Long-context tasks in the style of RULER ("RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654) that lm-evaluation-harness cannot run offline, generated deterministically from a seed
over `pydoc_data` prose. RULER's single-needle, multi-key and variable-tracking tasks run through the harness itself
(`kvserve eval ruler`, `kvserve/tools/eval/ruler.py`); the harness's multi-value and multi-query tasks hide their
needles in the Paul Graham essays, which it downloads from the Hugging Face hub, and it has no passkey task.

Each task hides facts ("needles") at chosen depths of a haystack of about `length` tokens and ends the prompt with a
question and the start of the answer, so a completion model answers in its first few tokens. Scoring is RULER's
"string match all": the fraction of reference strings that appear in the answer (case-insensitive).

Tasks (names as the CLI takes them):
- `passkey`: a 5-digit pass key repeated twice in one sentence pair (the classic test; same prompt as issue 2's).
- `niah_multivalue`: four numbers for the same key word; all four are asked for.
- `niah_multiquery`: four needles with different keys; two of them are asked for.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.tools.eval.haystack import haystack, passkey_prompt

KEY_WORDS = (
    "lantern",
    "walrus",
    "quartz",
    "saffron",
    "glacier",
    "harbor",
    "falcon",
    "juniper",
    "meadow",
    "obsidian",
    "pepper",
    "raven",
    "sapphire",
    "thistle",
    "umbrella",
    "velvet",
    "willow",
    "zephyr",
    "anchor",
    "biscuit",
    "cobalt",
    "dolphin",
    "ember",
    "fjord",
    "granite",
    "hazel",
    "iris",
    "jasmine",
    "kettle",
    "lilac",
)


@dataclass(frozen=True)
class Case:
    task: str
    length: int  # target prompt length in tokens
    index: int  # sample number within (task, length)
    seed: int
    prompt: str
    references: tuple[str, ...]  # strings the answer must contain
    max_tokens: int
    depth: float  # depth of the (first) needle, 0 = start of the haystack, 1 = end

    @property
    def key(self) -> tuple:
        return (self.task, self.length, self.index, self.seed)


def score(answer: str, references: tuple[str, ...] | list[str]) -> float:
    """Fraction of references found in the answer (RULER's string_match_all)."""
    answer = answer.lower()
    return sum(ref.lower() in answer for ref in references) / len(references)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _embed(
    tokenizer, length: int, needles: list[str], depths: list[float], intro: str, question: str, seed: int
) -> str:
    """Haystack of the remaining token budget with each needle inserted at its depth (depths sorted)."""
    fixed = len(tokenizer.encode(intro + "".join(needles) + question, add_special_tokens=False))
    filler = haystack(tokenizer, length - fixed, seed)
    pieces, start = [intro], 0
    for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda pair: pair[1]):
        cut = int(len(filler) * depth)
        pieces += [tokenizer.decode(filler[start:cut]), needle]
        start = cut
    pieces += [tokenizer.decode(filler[start:]), question]
    return "".join(pieces)


NIAH_INTRO = (
    "Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)


def _needle(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}. "


def _niah(
    tokenizer, length: int, rng: random.Random, seed: int, num_keys: int, values_per_key: int, asked: int
) -> tuple[str, tuple[str, ...], float]:
    keys = rng.sample(KEY_WORDS, num_keys)
    needles, answers = [], {}
    for key in keys:
        answers[key] = [_number(rng) for _ in range(values_per_key)]
        needles += [_needle(key, value) for value in answers[key]]
    depths = [rng.uniform(0.05, 0.95) for _ in needles]
    queried = keys[:asked]
    if values_per_key > 1:  # multi-value: every value of one key
        question = (
            f"\nWhat are all the special magic numbers for {queried[0]} mentioned in the provided text? "
            f"The special magic numbers for {queried[0]} mentioned in the provided text are"
        )
    else:  # multi-query: the values of several keys
        names = ", ".join(queried[:-1]) + f" and {queried[-1]}"
        question = (
            f"\nWhat are the special magic numbers for {names} mentioned in the provided text? "
            f"The special magic numbers for {names} mentioned in the provided text are"
        )
    references = tuple(value for key in queried for value in answers[key])
    return _embed(tokenizer, length, needles, depths, NIAH_INTRO, question, seed), references, depths[0]


def _passkey(tokenizer, length: int, rng: random.Random, seed: int) -> tuple[str, tuple[str, ...], float]:
    depth = round(rng.uniform(0.05, 0.95), 2)
    prompt, key = passkey_prompt(tokenizer, length, depth, seed)
    return prompt, (key,), depth


Builder = Callable[[object, int, random.Random, int], tuple[str, tuple[str, ...], float]]
TASKS: dict[str, tuple[Builder, int]] = {  # name -> (builder, max answer tokens)
    "passkey": (_passkey, 12),
    "niah_multivalue": (lambda tok, n, rng, seed: _niah(tok, n, rng, seed, 1, 4, 1), 48),
    "niah_multiquery": (lambda tok, n, rng, seed: _niah(tok, n, rng, seed, 4, 1, 2), 32),
}


def make_case(tokenizer, task: str, length: int, index: int, seed: int = 0) -> Case:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    builder, max_tokens = TASKS[task]
    # one stream per case: the same (task, length, index, seed) always gives the same prompt
    rng = random.Random(f"{task}/{length}/{index}/{seed}")
    haystack_seed = rng.randrange(1 << 30)
    prompt, references, depth = builder(tokenizer, length, rng, haystack_seed)
    return Case(
        task=task,
        length=length,
        index=index,
        seed=seed,
        prompt=prompt,
        references=references,
        max_tokens=max_tokens,
        depth=depth,
    )


def make_cases(tokenizer, tasks: list[str], lengths: list[int], samples: int, seed: int = 0) -> list[Case]:
    return [
        make_case(tokenizer, task, length, index, seed)
        for length in lengths
        for task in tasks
        for index in range(samples)
    ]
