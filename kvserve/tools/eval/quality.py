"""Task accuracy for settings (policy x budget) over one or more servers; resumable JSON lines.

Each server answers one request at a time; the cases are spread over the servers (on a machine with spare cores:
on CPU each vLLM server keeps one core busy for its worker and, while it waits, another for its engine core).
A row is written as soon as its answer arrives, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import replace

from kvserve.tools.eval.client import Server, Setting, append_row, gate_keep_ratios, load_rows
from kvserve.tools.eval.report import grid_table
from kvserve.tools.eval.tasks import Case, score, split_question


def row_key(row: dict) -> tuple:
    return (row["policy"], row["budget"], row["task"], row["length"], row["index"], row["seed"])


def run(
    servers: list[Server], settings: list[Setting], cases: list[Case], out: str, progress: bool = True
) -> list[dict]:
    rows = load_rows(out)
    done = {row_key(r) for r in rows}
    todo: queue.Queue = queue.Queue()
    # settings whose budget another setting's rows decide run after all others (they read those rows)
    for setting in sorted(settings, key=lambda s: s.match is not None):
        for case in cases:
            if (setting.label, setting.budget, *case.key) not in done:
                todo.put((setting, case))
    bar = _progress_bar(todo.qsize(), progress)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(server: Server) -> None:
        while not errors:
            try:
                setting, case = todo.get_nowait()
            except queue.Empty:
                return
            try:
                if setting.match:
                    with lock:
                        budget = matched_budget(rows, setting.match, case)
                    row = answer(server, replace(setting, budget=budget), case)
                    row.update(policy=setting.label, budget=None, matched_budget=budget)
                else:
                    row = answer(server, setting, case)
            except BaseException as error:  # noqa: BLE001 - reported after the other workers stop
                errors.append(error)
                return
            with lock:
                rows.append(row)
                append_row(out, row)
                bar.update(1)

    threads = [threading.Thread(target=work, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    if errors:
        raise errors[0]
    wanted = {(s.label, s.budget, *c.key) for s in settings for c in cases}
    return [r for r in rows if row_key(r) in wanted]


def matched_budget(rows: list[dict], label: str, case: Case) -> int:
    """The entries per (layer, KV head) the `label` setting kept of `case`'s prompt (its prompt less what it
    evicted, averaged over the lists): the budget that gives another policy the same memory on that case."""
    for row in rows:
        if row["policy"] == label and (row["task"], row["length"], row["index"], row["seed"]) == case.key:
            return max(int(round(row["prompt_tokens"] - (row["kv_tokens_evicted"] or 0))), 1)
    raise RuntimeError(f"no {label} row for case {case.key}: run {label} on the same cases first (same --out)")


def answer(server: Server, setting: Setting, case: Case) -> dict:
    freed_before = server.blocks_freed()
    gate_before = server.gate_counts()
    start = time.time()
    document = setting.compresses_documents()
    if document:  # the case's document compressed first (without the question), then the question resumes from it
        compressed = server.compress(setting, split_question(case.prompt)[0])
        kv_document = compressed["kv"]["kv_document"]  # the rest of its settings are the setting's own headers
        body = server.complete(setting, case.prompt, max_tokens=case.max_tokens, kv_document=kv_document)
        if not body["usage"].get("kv_tokens_evicted"):
            raise RuntimeError(f"case {case.key}: the question did not resume from its compressed document")
    else:
        body = server.complete(setting, case.prompt, max_tokens=case.max_tokens)
    text = body["choices"][0]["text"]
    row = {
        "policy": setting.label,
        "budget": setting.budget,
        "task": case.task,
        "length": case.length,
        "index": case.index,
        "seed": case.seed,
        "depth": round(case.depth, 3),
        "references": list(case.references),
        "answer": text,
        "score": score(text, case.references),
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "blocks_freed": server.blocks_freed() - freed_before,
        "kv_tokens_evicted": body["usage"].get("kv_tokens_evicted"),
        "seconds": round(time.time() - start, 3),
    }
    if document:
        row["document_tokens"] = compressed["document_tokens"]
        row["compress_seconds"] = compressed["compress_seconds"]
    keep_by_layer = gate_keep_ratios(server, gate_before)
    if keep_by_layer is not None:
        row["gate_keep_by_layer"] = keep_by_layer
    return row


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="cases", unit="req")


def mean_scores(rows: list[dict], by: tuple[str, ...]) -> dict[tuple, tuple[float, int]]:
    """Mean score and count per group of the given row fields."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[field] for field in by)].append(row["score"])
    return {key: (sum(values) / len(values), len(values)) for key, values in groups.items()}


def summary_table(rows: list[dict], column: str = "task") -> str:
    """Mean score per setting and task (or another row field: `column`), plus the overall mean; budgets as rows of
    each policy."""
    tasks = list(dict.fromkeys(r[column] for r in rows))
    by_task = mean_scores(rows, ("policy", "budget", column))
    overall = mean_scores(rows, ("policy", "budget"))
    lines = ["| policy | budget | " + " | ".join(map(str, tasks)) + " | mean | n |", "|---" * (len(tasks) + 4) + "|"]
    for (policy, budget), (mean, count) in sorted(overall.items(), key=_setting_order):
        cells = [f"{by_task[(policy, budget, t)][0]:.2f}" if (policy, budget, t) in by_task else "-" for t in tasks]
        lines.append(f"| {policy} | {budget or '-'} | " + " | ".join(cells) + f" | {mean:.2f} | {count} |")
    return "\n".join(lines)


def matrix_table(rows: list[dict]) -> str:
    """Mean score over all tasks and lengths: policy rows x budget columns (`full` is the reference row)."""
    return grid_table({key: mean for key, (mean, _) in mean_scores(rows, ("policy", "budget")).items()})


def best_per_budget(rows: list[dict]) -> str:
    """The best policies at each budget (all that tie) and their score relative to full cache."""
    overall = mean_scores(rows, ("policy", "budget"))
    full = overall.get(("full", None), (float("nan"), 0))[0]
    lines = []
    for budget in sorted({b for _, b in overall if b is not None}):
        scores = {p: mean for (p, b), (mean, _) in overall.items() if b == budget}
        best = max(scores.values())
        leaders = ", ".join(sorted(p for p, mean in scores.items() if mean == best)) if best > 0 else "none above 0"
        ratio = best / full if full else float("nan")
        lines.append(f"B={budget}: {best:.2f} ({leaders}); full {full:.2f}, ratio {ratio:.2f}")
    return "\n".join(lines)


def _setting_order(item) -> tuple:
    (policy, budget), _ = item
    return (policy != "full", policy, budget or 0)


def gate_summary(rows: list[dict]) -> str:
    """Attention-Gate rows: mean share of prompt tokens kept (all layers and heads) and the eviction ratio per layer,
    with the average budget it amounts to at each prompt length (the budget to give other policies to compare)."""
    gated = [r for r in rows if r.get("gate_keep_by_layer")]
    if not gated:
        return ""
    layers = len(gated[0]["gate_keep_by_layer"])
    per_layer = [sum(r["gate_keep_by_layer"][i] for r in gated) / len(gated) for i in range(layers)]
    keep = sum(per_layer) / layers
    lines = [
        f"attention_gate kept {keep:.3f} of prompt tokens on average over {len(gated)} requests "
        f"(eviction ratio {1 - keep:.3f}); average budget by prompt length: "
        + ", ".join(f"{length}: {keep * length:.0f}" for length in sorted({r["length"] for r in gated})),
        "eviction ratio by layer: " + " ".join(f"{i}:{1 - v:.2f}" for i, v in enumerate(per_layer)),
    ]
    return "\n".join(lines)
