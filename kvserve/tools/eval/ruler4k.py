"""RULER at 4k tokens as kvpress's leaderboard runs it: the cases, the split of each into context, question and answer
prefix, RULER's string match, and the ratio a compression is named by.

RULER: "RULER: What's the Real Context Size of Your Long-Context Language Models?" (arXiv:2404.06654). kvpress's
leaderboard (NVIDIA's kvpress, `evaluation/`) scores each press on RULER's 13 tasks at 4,096 tokens, the context
compressed before the question is seen, at compression ratios 0.25 to 0.875. Its data set is RULER's own generator's
output split at each task's last question; here the same generators run locally, as lm-evaluation-harness ships them
(`lm_eval.tasks.ruler`), sized with the served model's tokenizer, and the split is kvpress's:
- the context: everything before the task's last question (its instructions, haystack and needles; for `vt` and
  `cwe` the worked example too);
- the question: from there to the end of RULER's input;
- the answer prefix: RULER's start of the answer ("The special magic number for X mentioned in the provided text
  is", "Answer: ...").

Differences from kvpress's data set, all forced by what can be had here:
- five tasks hide their needles in Paul Graham's essays, which the harness downloads; here the haystack is Python's
  own documentation (`pydoc_data.topics`, `kvserve/tools/eval/haystack.py`), cut into sentences by NLTK's Punkt
  with its default parameters (the trained `punkt_tab` model is a download too);
- `qa_1` (SQuAD) and `qa_2` (HotpotQA) need their data sets from the hub: not run (`MISSING`);
- the harness leaves `cwe`'s worked example out of its input; RULER puts it before the list, and so does this.

Scoring is RULER's (kvpress's `calculate_metrics`): control characters removed from the stripped answer, then
`string_match_all` (the share of references found in it, case-insensitive) for every task but QA, whose metric is
`string_match_part` (any reference found). A setting's score is the mean over tasks of each task's mean.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

import numpy as np

LENGTH = 4096  # RULER's max_seq_length: context, question and the answer's tokens
RATIOS = (0.25, 0.5, 0.75, 0.875)  # the leaderboard's compression ratios

# kvpress's split points (RULER's templates): the last match of a task's question pattern starts its question
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}  # RULER's tokens_to_generate


def _niah(haystack: str, keys: str = "words", values: str = "numbers", **counts: int) -> dict:
    """A niah task as the harness generates it (`lm_eval/tasks/ruler/niah_utils.py`): its haystack and needles."""
    return {"type_haystack": haystack, "type_needle_k": keys, "type_needle_v": values, **counts}


NIAH = {
    "niah_single_1": _niah("repeat"),
    "niah_single_2": _niah("essay"),
    "niah_single_3": _niah("essay", values="uuids"),
    "niah_multikey_1": _niah("essay", num_needle_k=4),
    "niah_multikey_2": _niah("needle"),
    "niah_multikey_3": _niah("needle", keys="uuids", values="uuids"),
    "niah_multivalue": _niah("essay", num_needle_v=4),
    "niah_multiquery": _niah("essay", num_needle_q=4),
}
TASKS = (*NIAH, "vt", "cwe", "fwe")
MISSING = {
    "qa_1": "SQuAD, which lm-evaluation-harness downloads from the Hugging Face hub",
    "qa_2": "HotpotQA, which lm-evaluation-harness downloads from the Hugging Face hub",
}


@dataclass(frozen=True)
class RulerCase:
    task: str
    index: int  # the case's number within its task (the generator's order)
    context: str
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    max_new_tokens: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.task, self.index)


def category(task: str) -> str:
    return task.split("_")[0]


def split_input(text: str, task: str) -> tuple[str, str]:
    """(context, question) of RULER's input as kvpress splits it: at the last match of the task's question."""
    matches = list(QUESTION_PATTERNS[category(task)].finditer(text))
    if not matches:
        raise ValueError(f"{task}: RULER's input has no question matching {QUESTION_PATTERNS[category(task)].pattern}")
    start = matches[-1].start()
    return text[:start], text[start:]


def clean(answer: str) -> str:
    """An answer as RULER's and kvpress's metrics read it: stripped, control characters removed."""
    return re.sub(r"[\x00-\x1f]", "", answer.strip()).strip()


def string_match(task: str, answer: str, references: Iterable[str]) -> float:
    """RULER's metric of one answer: string_match_part for QA (any reference), string_match_all otherwise (the
    share of references), case-insensitive."""
    answer, references = clean(answer).lower(), list(references)
    found = [reference.lower() in answer for reference in references]
    return float(any(found)) if category(task) == "qa" else sum(found) / len(found)


def budget_for(ratio: float, tokens: int, multiple: int = 1) -> int:
    """Entries a (layer, KV head) keeps of `tokens` at compression ratio `ratio` on average: (1 - ratio) x tokens,
    rounded to the nearest `multiple` (a compressed document's lists fill whole blocks), at least one multiple."""
    if not 0 <= ratio < 1:
        raise ValueError(f"a compression ratio is in [0, 1), got {ratio}")
    return max(multiple, round((1 - ratio) * tokens / multiple) * multiple)


def task_means(rows: Iterable[dict]) -> dict[str, list[float]]:
    """Each task's scores (rows with `task` and `score`)."""
    by: dict[str, list[float]] = {}
    for row in rows:
        by.setdefault(row["task"], []).append(row["score"])
    return by


def mean_over_tasks(rows: Iterable[dict], z: float = 1.96) -> tuple[float, float, float, int]:
    """(mean over tasks of each task's mean score, 95% interval low, high, answers). The interval adds the tasks'
    variances, each bounded as a proportion's (a score in [0, 1] with mean p varies at most p(1 - p)) with
    Agresti-Coull's correction, so a task whose answers all agree still counts its few answers as uncertain."""
    by = task_means(rows)
    if not by:
        return math.nan, math.nan, math.nan, 0
    variance = 0.0
    for scores in by.values():
        n = len(scores)
        adjusted = (sum(scores) + z * z / 2) / (n + z * z)
        variance += adjusted * (1 - adjusted) / (n + z * z)
    mean = sum(sum(scores) / len(scores) for scores in by.values()) / len(by)
    half = z * math.sqrt(variance) / len(by)
    return mean, max(mean - half, 0.0), min(mean + half, 1.0), sum(len(scores) for scores in by.values())


def paired_difference(ours: Iterable[dict], theirs: Iterable[dict], z: float = 1.96) -> tuple[float, float, float, int]:
    """(mean over tasks of ours - theirs on the cases both answered, 95% interval low, high, cases). Each task's
    differences d = ours - theirs lie in [-1, 1]; their variance is the sample variance of d with Agresti-Coull's
    z^2/2 pseudo-answers split between the extremes +1 and -1, so that two sides agreeing on a few cases still leave
    an interval as wide as those few cases allow; the tasks' variances of their means add, as in `mean_over_tasks`."""
    mine = {tuple(row["key"]): row for row in ours}
    by: dict[str, list[float]] = {}
    for row in theirs:
        other = mine.get(tuple(row["key"]))
        if other is not None:
            by.setdefault(row["task"], []).append(other["score"] - row["score"])
    if not by:
        return math.nan, math.nan, math.nan, 0
    pseudo = z * z / 4  # at +1 and at -1 each
    variance = 0.0
    for diffs in by.values():
        n = len(diffs)
        weight = n + 2 * pseudo
        centre = sum(diffs) / weight  # the pseudo-answers cancel in the sum
        spread = sum((d - centre) ** 2 for d in diffs) + pseudo * ((1 - centre) ** 2 + (1 + centre) ** 2)
        variance += spread / weight / n
    mean = sum(sum(diffs) / len(diffs) for diffs in by.values()) / len(by)
    half = z * math.sqrt(variance) / len(by)
    return mean, mean - half, mean + half, sum(len(diffs) for diffs in by.values())


# --- generation: the harness's own generators, seeded ---


@cache
def _essay_words() -> tuple[str, ...]:
    from kvserve.tools.eval.haystack import corpus

    return tuple(corpus().split(" "))


@cache
def _harness_ruler():
    """lm-evaluation-harness's RULER generators, imported without their network: importing `prepare_niah` asks
    NLTK to download `punkt_tab`, which cannot be had here; its sentence splitter becomes Punkt with default
    parameters."""
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    download, nltk.download = nltk.download, lambda *args, **kwargs: False
    try:
        from lm_eval.tasks.ruler import cwe_utils, fwe_utils, prepare_niah, vt_utils
    finally:
        nltk.download = download
    prepare_niah.sent_tokenize = PunktSentenceTokenizer().tokenize
    prepare_niah.cached_sent_tokenize.cache_clear()
    return prepare_niah, vt_utils, cwe_utils, fwe_utils


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)


def _raw(task: str, tokenizer, samples: int, seed: int) -> list[dict]:
    """The harness's RULER docs for `task` (input, outputs, gen_prefix), its random state seeded first."""
    niah, vt, cwe, fwe = _harness_ruler()
    _seed(seed)
    if task in NIAH:
        spec = dict(NIAH[task])
        kind = spec["type_haystack"]
        haystack = list(_essay_words()) if kind == "essay" else niah.get_haystack(type_haystack=kind)
        return niah.generate_samples(
            haystack, TOKENIZER=tokenizer, max_seq_length=LENGTH, template=niah_template(), num_samples=samples, **spec
        )
    if task == "vt":
        example = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)
        return vt.sys_vartrack_w_noise_random(
            tokenizer=tokenizer, num_samples=samples, max_seq_length=LENGTH, icl_example=example[0]
        )
    if task == "cwe":
        cwe.RNG.seed(seed)  # the module's own generator shuffles every list
        docs = cwe.sys_word_pair_random(num_samples=samples, max_seq_length=LENGTH, tokenizer=tokenizer)
        return [{**doc, "input": doc["input_example"] + "\n" + doc["input"]} for doc in docs]
    if task == "fwe":
        return fwe.sys_kwext(tokenizer=tokenizer, max_seq_length=LENGTH, num_samples=samples)
    raise ValueError(f"unknown RULER task {task!r}; one of {', '.join(TASKS)}")


def niah_template() -> str:
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE

    return TEMPLATE


def make_cases(tokenizer, tasks: Iterable[str], samples: int, seed: int = 0) -> list[RulerCase]:
    """`samples` cases of each task, split kvpress's way; the same seed gives the same cases, and a case's text does
    not depend on how many come after it."""
    import contextlib
    import io

    cases = []
    for task in tasks:
        if task in MISSING:
            raise ValueError(f"{task} needs {MISSING[task]}: it cannot be generated here")
        with contextlib.redirect_stdout(io.StringIO()):  # (the generators print their sizing loops)
            docs = _raw(task, tokenizer, samples, seed)
        for index, doc in enumerate(docs):
            context, question = split_input(doc["input"], task)
            cases.append(
                RulerCase(
                    task=task,
                    index=index,
                    context=context,
                    question=question,
                    answer_prefix=doc["gen_prefix"].strip(),
                    references=tuple(str(output) for output in doc["outputs"]),
                    max_new_tokens=MAX_NEW_TOKENS[category(task)],
                )
            )
    return cases


def interleaved(cases: list[RulerCase]) -> list[RulerCase]:
    """Cases ordered index by index over the tasks, so that a run stopped early has as many answers of each task."""
    return sorted(cases, key=lambda case: (case.index, TASKS.index(case.task)))


def pipeline_ids(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids) as kvpress's pipeline builds them: the context as a chat's user message (the
    template's text before the message's end), then the question, the template's end of the user turn and start of
    the reply, and the answer prefix. A model without a chat template: its BOS, the context; the question, a newline
    and the answer prefix."""
    if not getattr(tokenizer, "chat_template", None):
        bos = tokenizer.bos_token or ""
        ids: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        return ids(bos + context), ids(question + "\n" + answer_prefix)
    separator = "#" * (len(context) + 10)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
    )
    before, suffix = rendered.split(separator)
    return (
        tokenizer.encode(before, add_special_tokens=False),
        tokenizer.encode(question + suffix + answer_prefix, add_special_tokens=False),
    )
