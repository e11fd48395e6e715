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
- `multikey_one`: RULER's multi-key lookup (niah_multikey_1): four needles with different keys, one asked for, the
  prompt ending in the asked needle's own opening words ("One of the special magic numbers for walrus is:"), as
  the passkey prompt ends in "The pass key is". Asked so, `full` answers it on both models (served, greedy: the 135M
  default model 0.67 / 0.83 / 0.58 at 1k / 2k / 4k tokens, 12 cases each; the 0.5B Qwen2 model 24 of 24), where
  RULER's own question ("The special magic number for walrus mentioned in the provided text is") leaves the 135M
  model near 0.
  Asking two of the four keys the same way gets the first value only, on both models (0.50 at 1k): the models do
  not go on to the second key, so the two-key lookups are `niah_multiquery` and `kv_two`, which only the larger
  model passes.
- `kv_one` / `kv_two`: three words' pass keys (4-digit numbers, each stated twice in its sentence as the passkey's
  is), one or two of them asked for.
- `kv_values`: two pass keys of one word, both asked for.
- `chat_followup`: three words' pass keys in a document the user shares in a first chat turn; the assistant
  acknowledges it, and one word's key is asked for in a second turn (the model's chat template, sent as one prompt).

On the 135M default model `full` scores about 0.7 on `chat_followup` and passkey, but 0.4 on `kv_one` and under 0.1
on the tasks that ask for two values (`kv_two`, `kv_values`, `niah_multi*`): the model names one value, or none,
whatever the format (plain, chat, an example in the instructions were tried); the quality suite judges only the
tasks `full` passes (`kvserve eval suite`).
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


def split_question(prompt: str) -> tuple[str, str]:
    """(document, question) of a case's prompt: every task's question starts with its last "What" (the passkey's,
    the lookups', the chat's last user turn's). A space before it goes with the question and a newline stays with the
    document, as the tokenizers split them (a space joins the next word; Qwen's joins a newline to the punctuation
    before it), so the document's tokens are the prompt's first tokens. A compressed document (`kv_document`) is
    compressed without the question."""
    start = prompt.rfind("What")
    if start <= 0:
        raise ValueError("the prompt has no question starting with 'What'")
    if prompt[start - 1] == " ":
        start -= 1
    return prompt[:start], prompt[start:]


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
    tokenizer,
    length: int,
    rng: random.Random,
    seed: int,
    num_keys: int,
    values_per_key: int,
    asked: int,
    own_prefix: bool = False,
) -> tuple[str, tuple[str, ...], float]:
    keys = rng.sample(KEY_WORDS, num_keys)
    needles, answers = [], {}
    for key in keys:
        answers[key] = [_number(rng) for _ in range(values_per_key)]
        needles += [_needle(key, value) for value in answers[key]]
    depths = [rng.uniform(0.05, 0.95) for _ in needles]
    queried = keys[:asked]
    if own_prefix:  # one key, asked in a lookup that ends in its needle's own opening words, as the passkey's does
        question = (
            f"\nWhat is the special magic number for {queried[0]} mentioned in the provided text? "
            f"One of the special magic numbers for {queried[0]} is:"
        )
    elif values_per_key > 1:  # multi-value: every value of one key
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


FACTS_INTRO = "There are pass keys hidden inside a lot of irrelevant text. Find them and memorize them.\n"


def _fact(key: str, value: str) -> str:
    # said twice, as the passkey is: a fact stated once in 4k tokens of prose is beyond the 135M default model
    return f" The pass key of {key} is {value}. Remember it. {value} is the pass key of {key}. "


def _one_of_facts(key: str, value: str) -> str:
    return f" One pass key of {key} is {value}. Remember it. {value} is a pass key of {key}. "


def _facts(
    rng: random.Random, num_keys: int, values_per_key: int, fact: Callable[[str, str], str] = _fact
) -> tuple[list[str], dict[str, list[str]], list[float]]:
    """`num_keys` words with `values_per_key` distinct 4-digit codes each, stated by `fact` at random depths.
    Returns (needles in key order, codes by key in the same order, depths)."""
    keys = rng.sample(KEY_WORDS, num_keys)
    codes = {key: [str(code) for code in rng.sample(range(1000, 10000), values_per_key)] for key in keys}
    needles = [fact(key, code) for key in keys for code in codes[key]]
    return needles, codes, [rng.uniform(0.05, 0.95) for _ in needles]


def _names(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f" and {keys[-1]}"


def _chat(tokenizer, turns: list[str], answer_start: str) -> str:
    """User and assistant turns alternating, the user's first, rendered with the model's chat template, then the
    start of the assistant's answer (so the answer's first tokens are the value, as in RULER's prompts)."""
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_start


CHAT_TEMPLATE_TOKENS = 48  # what the chat template adds around the turns, left out of the haystack


def _kv_facts(
    tokenizer, length: int, rng: random.Random, seed: int, num_keys: int, asked: int
) -> tuple[str, tuple[str, ...], float]:
    """Several word -> code facts in the prose; the codes of the first `asked` words are asked for after it."""
    needles, codes, depths = _facts(rng, num_keys, 1)
    queried = list(codes)[:asked]
    names = _names(queried)
    question = f" What is the pass key of {names}?" if asked == 1 else f" What are the pass keys of {names}?"
    answer = f"The pass key of {names} is" if asked == 1 else f"The pass keys of {names} are"
    prompt = _embed(tokenizer, length, needles, depths, FACTS_INTRO, f"{question} {answer}", seed)
    return prompt, tuple(codes[key][0] for key in queried), depths[0]


def _kv_values(
    tokenizer, length: int, rng: random.Random, seed: int, values_per_key: int
) -> tuple[str, tuple[str, ...], float]:
    """One word with several codes, given at different depths; all of them are asked for."""
    needles, codes, depths = _facts(rng, 1, values_per_key, _one_of_facts)
    key, values = next(iter(codes.items()))
    question = f" What are all the pass keys of {key}?"
    prompt = _embed(tokenizer, length, needles, depths, FACTS_INTRO, f"{question} The pass keys of {key} are", seed)
    return prompt, tuple(values), depths[0]


def _chat_followup(
    tokenizer, length: int, rng: random.Random, seed: int, num_keys: int
) -> tuple[str, tuple[str, ...], float]:
    """The facts come in a document the user shares in a first chat turn, the assistant acknowledges it, and the
    user asks for one code in a second turn: the question is not in the turn that brought the facts."""
    needles, codes, depths = _facts(rng, num_keys, 1)
    key = next(iter(codes))
    document = _embed(tokenizer, length - CHAT_TEMPLATE_TOKENS, needles, depths, FACTS_INTRO, "", seed)
    reply = "I have read the text and memorized the pass keys."
    question = f"What is the pass key of {key}?"
    return _chat(tokenizer, [document, reply, question], f"The pass key of {key} is"), (codes[key][0],), depths[0]


def _passkey(tokenizer, length: int, rng: random.Random, seed: int) -> tuple[str, tuple[str, ...], float]:
    depth = round(rng.uniform(0.05, 0.95), 2)
    prompt, key = passkey_prompt(tokenizer, length, depth, seed)
    return prompt, (key,), depth


Builder = Callable[[object, int, random.Random, int], tuple[str, tuple[str, ...], float]]
TASKS: dict[str, tuple[Builder, int]] = {  # name -> (builder, max answer tokens)
    "passkey": (_passkey, 12),
    "niah_multivalue": (lambda tok, n, rng, seed: _niah(tok, n, rng, seed, 1, 4, 1), 48),
    "niah_multiquery": (lambda tok, n, rng, seed: _niah(tok, n, rng, seed, 4, 1, 2), 32),
    "multikey_one": (lambda tok, n, rng, seed: _niah(tok, n, rng, seed, 4, 1, 1, own_prefix=True), 16),
    "kv_one": (lambda tok, n, rng, seed: _kv_facts(tok, n, rng, seed, 3, 1), 16),
    "kv_two": (lambda tok, n, rng, seed: _kv_facts(tok, n, rng, seed, 3, 2), 24),
    "kv_values": (lambda tok, n, rng, seed: _kv_values(tok, n, rng, seed, 2), 24),
    "chat_followup": (lambda tok, n, rng, seed: _chat_followup(tok, n, rng, seed, 3), 16),
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
