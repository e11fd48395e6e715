"""RULER through lm-evaluation-harness (`pip install 'kvserve[ruler]'`): the harness generates its tasks, asks the
server with its own `local-completions` model and scores with its own metric; kvserve adds only the eviction
setting (one request header per policy and budget) and keeps one JSON line per answer, so a rerun resumes.

RULER: "RULER: What's the Real Context Size of Your Long-Context Language Models?" (arXiv:2404.06654). The tasks
offered are those the harness generates without downloading anything: `niah_single_1` (one needle in repeated
noise), `niah_multikey_2` (one of many needles, the haystack made of needles), `niah_multikey_3` (the same with
UUID keys and values) and `ruler_vt` (variable tracking). Its other RULER tasks need the Paul Graham essays or QA
sets from the Hugging Face hub.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.tools.eval.client import Server, Setting, append_row, load_rows

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt")
DEFAULT_TASKS = RULER_TASKS[:3]


def harness_missing() -> str | None:
    """Why the harness cannot run here, or None."""
    from importlib.util import find_spec

    missing = [name for name in ("lm_eval", "tenacity", "wonderwords", "nltk") if find_spec(name) is None]
    if missing:
        return (
            f"lm-evaluation-harness's RULER tasks need {', '.join(missing)}: pip install 'kvserve[ruler]' "
            "(lm-eval, wonderwords, nltk)"
        )
    return None


@dataclass(frozen=True)
class RulerRun:
    server: Server
    tokenizer: str  # a tokenizer folder or name: the harness sizes its prompts with it
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]  # RULER's max_seq_length: prompt plus answer tokens
    samples: int  # per task and length (the harness's `limit`)
    out: str  # JSON lines; an existing file resumes
    concurrency: int = 1


def row_key(row: dict) -> tuple:
    return (row["policy"], row["budget"], row["task"], row["length"], row["index"])


def harness_model(run: RulerRun, setting: Setting, length: int):
    """The harness's own OpenAI-completions client, sending kvserve's headers for `setting`."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=run.server.url + "/v1/completions",
        model=run.server.model,
        tokenizer=run.tokenizer,
        tokenizer_backend="huggingface",
        tokenized_requests=False,
        max_length=length,
        num_concurrent=run.concurrency,
        header=setting.headers(),
        timeout=1800,
        max_retries=1,
    )


def evaluate(run: RulerRun, setting: Setting, tasks: list[str], length: int) -> dict[str, list[dict]]:
    """One harness run: `tasks` at one length under one setting; the harness's logged samples per task."""
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results = simple_evaluate(
        model=harness_model(run, setting, length),
        tasks=tasks,
        limit=run.samples,
        log_samples=True,
        metadata={"max_seq_lengths": [length], "tokenizer": run.tokenizer},
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return results["samples"]


def sample_row(setting: Setting, task: str, length: int, sample: dict) -> dict:
    """One answer as a row of the quality tables; the score is the harness's own (string_match_all)."""
    answer = sample["filtered_resps"][0]
    answer = answer[0] if isinstance(answer, list) else answer
    return {
        "policy": setting.label,
        "budget": setting.budget,
        "task": task,
        "length": length,
        "index": sample["doc_id"],
        "seed": 0,
        "score": float(sample[str(length)]),
        "references": list(sample["doc"]["outputs"]),
        "answer": answer,
    }


def run_settings(run: RulerRun, settings: list[Setting], progress: bool = True) -> list[dict]:
    """Every setting x length x task, skipping what `run.out` already holds; returns the rows asked for."""
    rows = load_rows(run.out)
    done = {row_key(row) for row in rows}
    for setting in settings:
        for length in run.lengths:
            todo = [
                task
                for task in run.tasks
                if any((setting.label, setting.budget, task, length, index) not in done for index in range(run.samples))
            ]
            if not todo:
                continue
            if progress:
                print(f"ruler: {setting.label} B={setting.budget} length {length}: {', '.join(todo)}", flush=True)
            for task, samples in evaluate(run, setting, todo, length).items():
                for sample in samples:
                    row = sample_row(setting, task, length, sample)
                    if row_key(row) not in done:
                        rows.append(row)
                        append_row(run.out, row)
                        done.add(row_key(row))
    wanted = {(s.label, s.budget, t, n) for s in settings for t in run.tasks for n in run.lengths}
    return [row for row in rows if row_key(row)[:4] in wanted and row["index"] < run.samples]
