"""`kvserve eval parity`: the same cases through kvpress's presses and through kvserve's server, at the same entries
kept, compressing the context before the question on both sides.

Why: a method is done when it scores at least what its reference implementation scores on the same model and cases.
kvpress (NVIDIA's library of KV-cache presses on transformers) is that reference for KVzip, SnapKV, TOVA,
StreamingLLM, Expected Attention, KeyDiff and DuoAttention.

The cases are the quality suite's (`kvserve/tools/eval/tasks.py`), put in the form kvpress's pipeline gives them: the
document as a chat's user message (the model's chat template around it), then the question, the template's end of
the user turn and start of the reply, and the start of the answer. Both sides get exactly these tokens:
- kvpress (`kvpress_side.py`, in kvpress's own environment): the context is prefilled under the press, then the
  pipeline's own greedy decoding answers the question (kept in full);
- kvserve (a running server): the context is compressed first with `POST /v1/kvserve/compress` (`kv_document`),
  whatever the policy, and the question resumes from the compressed lists, kept in full.
A budget B is B entries per (layer, KV head) of the context on average on both sides (kvpress: compression_ratio =
1 - B / context tokens). kvpress's presses keep B in every head of a layer, except KVzip, which by default ranks all
layers and heads together (`kvzip_layerwise`: each layer keeps the same share); kvserve's rows say their
`kv_allocation`.

    kvserve eval parity --url http://127.0.0.1:8000 --model-dir "$(kvserve setup-model qwen2.5-coder-0.5b)" \\
        --policies kvzip,snapkv --budgets 256,512 --tasks passkey,multikey_one --lengths 1000,2000,4000 \\
        --samples 4 --out docs/eval/parity/qwen05.jsonl

The table (`--table-only` reprints it from the file): per policy and budget, each side's mean score with its 95%
interval (Wilson), and kvserve minus kvpress.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvserve.duo.roles import HeadRoles
from kvserve.tools.eval.client import Server, Setting, append_row, load_rows
from kvserve.tools.eval.suite import wilson
from kvserve.tools.eval.tasks import make_cases, score, split_question
from kvserve.tools.markdown import table

KVPRESS_SIDE = Path(__file__).with_name("kvpress_side.py")
# kvserve's policy -> the knobs that make it the kvpress press of the same name (`kvpress_side.PRESSES`) compares
# with: SnapKV's window of 64 queries and pooling over 5 keys, KeyDiff without a protected window (kvpress's keep
# none), TOVA ranking by the whole layer's votes (kvpress's, and TOVA's own code); the others' defaults already are
# kvpress's (4 sinks). kvserve's rows keep single tokens (kv_span 1), as every press does.
REFERENCE_KNOBS: dict[str, tuple[tuple[str, str], ...]] = {
    "kvzip": (),
    "snapkv": (("window", "64"), ("kernel_size", "5")),
    "tova": (("vote_scope", "layer"),),
    "streamingllm": (),
    "expected_attention": (),
    "keydiff": (("window", "0"),),
    "duoattention": (),  # the retrieval fraction is the case's (`duo_retrieval_heads`)
    "kvzap": (("window", "0"),),  # kvpress's KVzapPress ranks every entry by its prediction alone
}
REFERENCE_PRESS = tuple(REFERENCE_KNOBS)


@dataclass(frozen=True)
class ParityCase:
    key: tuple
    context_ids: list[int]
    question_ids: list[int]
    references: tuple[str, ...]
    max_tokens: int


def pipeline_form(tokenizer, prompt: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of a suite prompt as kvpress's pipeline builds them: the document in a user
    message of the chat template, the question after it with the template's end of turn and start of the reply, then
    the answer's opening words ("The pass key is")."""
    document, question = split_question(prompt)
    asked, mark, answer_start = question.rpartition("?")
    if not mark:
        raise ValueError(f"the case's question has no '?': {question!r}")
    separator = "#" * (len(document) + 10)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": document + separator}], add_generation_prompt=True, tokenize=False
    )
    context, suffix = rendered.split(separator)
    question_text = asked + "?" + suffix + answer_start.strip()
    return tokenizer.encode(context, add_special_tokens=False), tokenizer.encode(
        question_text, add_special_tokens=False
    )


def parity_cases(tokenizer, tasks: list[str], lengths: list[int], samples: int, seed: int) -> list[ParityCase]:
    cases = []
    for case in make_cases(tokenizer, tasks, lengths, samples, seed):
        context_ids, question_ids = pipeline_form(tokenizer, case.prompt)
        cases.append(ParityCase(list(case.key), context_ids, question_ids, case.references, case.max_tokens))
    return cases


def duo_retrieval_heads(roles: HeadRoles, budget: int, context_tokens: int) -> int:
    """How many heads keep the whole context in DuoAttention's plain form (kvpress's press) so that the model holds
    L x H x B entries of it, the other heads keeping their sinks and newest entries w: R x n + (L x H - R) x w =
    L x H x B, R rounded to the nearest head (at least one)."""
    heads, streaming = roles.gates.numel(), roles.sink_tokens + roles.recent
    return min(heads, max(1, round(heads * (budget - streaming) / max(context_tokens - streaming, 1))))


def duo_reference(roles: HeadRoles, budget: int, cases: list[ParityCase]) -> dict:
    """DuoAttention's setting for kvpress's side: kvserve's roles as the press's head scores (each head's rank in
    kvserve's order, so that ties pick the same heads on both sides) and each case's number of retrieval heads."""
    order = torch.sort(roles.gates.flatten(), descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel() - 1, -1, -1)
    return {
        "roles": {
            "sink_tokens": roles.sink_tokens,
            "recent": roles.recent,
            "gates": rank.view_as(roles.gates).tolist(),
        },
        "retrieval_heads": {
            json.dumps(case.key): duo_retrieval_heads(roles, budget, len(case.context_ids)) for case in cases
        },
    }


def question_inside(case: ParityCase) -> ParityCase:
    """The same prompt with the question inside the compressed part: the press compresses all but the prompt's last
    token, as kvserve compacts a whole prompt where it ends (its default, eager eviction)."""
    prompt = case.context_ids + case.question_ids
    return ParityCase(case.key, prompt[:-1], prompt[-1:], case.references, case.max_tokens)


def compresses_before_question(policy: str) -> bool:
    """kvserve compacts before the question, at the context's end, only through a compressed document
    (`kv_document`), which KVzip's reconstruction scores; every other policy is compared with the question inside."""
    return policy.startswith("kvzip")


def settings_of(policies: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    rows: list[tuple[str, int | None]] = [("full", None)]
    for policy in policies:
        if policy not in REFERENCE_PRESS and policy != "kvzip_layerwise":
            raise SystemExit(
                f"kvserve eval parity: no kvpress reference for {policy!r}; one of {', '.join(REFERENCE_PRESS)}"
            )
        rows += [(policy, budget) for budget in budgets]
    return rows


def run_reference(python: str, model_dir: str, cases: list[ParityCase], settings, out: str) -> None:
    """kvpress's side, in its own environment (a subprocess); its rows are appended to `out`."""
    outside = [(policy, budget) for policy, budget in settings if compresses_before_question(policy) or not budget]
    inside = [(policy, budget) for policy, budget in settings if (policy, budget) not in outside]
    for group, form in ((outside, lambda case: case), (inside, question_inside)):
        if group:
            _reference_run(python, model_dir, [form(case) for case in cases], group, out)


def _reference_run(python: str, model_dir: str, cases: list[ParityCase], settings, out: str) -> None:
    entries = [
        {
            "label": label_of(policy, budget),
            "press": policy,
            "budget": budget,
            **(duo_reference(roles_of(model_dir), budget, cases) if policy == "duoattention" else {}),
            **(kvzap_reference(model_dir) if policy == "kvzap" else {}),
        }
        for policy, budget in settings
    ]
    run_kvpress_side(python, model_dir, cases, entries, out)


def run_kvpress_side(python: str, model_dir: str, cases: list[ParityCase], settings: list[dict], out: str) -> None:
    """kvpress_side.py in kvpress's environment over `cases` under each setting entry (label, press, budget or
    budgets, DuoAttention's roles); its rows are appended to `out`."""
    spec = {
        "model": model_dir,
        "settings": settings,
        "cases": [
            {
                "key": case.key,
                "context_ids": case.context_ids,
                "question_ids": case.question_ids,
                "references": list(case.references),
                "max_tokens": case.max_tokens,
            }
            for case in cases
        ],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        with terminated_as_exit():
            subprocess.run([python, str(KVPRESS_SIDE), f.name, out], check=True)
    finally:
        Path(f.name).unlink()


@contextmanager
def terminated_as_exit():
    """SIGTERM raises SystemExit while inside, so `subprocess.run` kills its child on the way out: a terminated
    evaluation must not leave kvpress's process appending rows to the result file after it (one did, and the page
    generated from that file went stale)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:  # a handler not installed from Python reads as None, which signal.signal does not take back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@cache
def kvzap_reference(model_dir: str) -> dict:
    """What kvpress's KVzapPress needs to score as kvserve does: the surrogate kvserve serves the model with, written
    in kvpress's form (once per run, into kvserve's cache folder)."""
    from kvserve.kvzap.registry import checked_surrogates
    from kvserve.model import cache_dir
    from kvserve.tools.training.kvzap import as_kvpress
    from kvserve.tools.training.llama import PlainLlama

    surrogates = checked_surrogates(model_dir)
    folder = cache_dir() / "kvzap-kvpress" / Path(model_dir).name
    as_kvpress(surrogates, PlainLlama(Path(model_dir)), folder)
    return {"kvzap_model": str(folder), "kvzap_kind": surrogates.kind, "model_name": Path(model_dir).name}


def roles_of(model_dir: str) -> HeadRoles:
    """The DuoAttention head roles kvserve serves the model with (shipped, or its calibrated profile's)."""
    from transformers import AutoConfig

    return HeadRoles.for_model(Path(model_dir).name, AutoConfig.from_pretrained(model_dir).num_key_value_heads)


def label_of(policy: str, budget: int | None, allocation: str = "uniform") -> str:
    label = policy if budget is None else f"{policy}@{budget}"
    return label + (f"/{allocation}" if allocation != "uniform" else "")


def run_kvserve(
    server: Server, cases: list[ParityCase], settings, allocation: str, out: str, roles: HeadRoles | None = None
) -> None:
    """kvserve's side: KVzip's context compressed first (`kv_document`), then the question resumes from it; the other
    policies compact the whole prompt where it ends. DuoAttention's retrieval fraction is the case's (`roles`)."""
    done = {(row["label"], tuple(row["key"])) for row in load_rows(out) if row.get("side") == "kvserve"}
    for policy, budget in settings:
        if policy == "kvzip_layerwise":
            continue
        if budget is not None and allocation != "uniform" and not compresses_before_question(policy):
            continue  # kvpress's other presses keep B in every head: compared with kvserve's uniform only
        label = label_of(policy, budget, allocation if budget else "uniform")
        knobs = REFERENCE_KNOBS.get(policy, ())
        setting = Setting(policy=policy, budget=budget, allocation=allocation if budget else "uniform", knobs=knobs)
        document = budget is not None and compresses_before_question(policy)
        for case in cases:
            if (label, tuple(case.key)) in done:
                continue
            if policy == "duoattention" and budget is not None:
                if roles is None:
                    raise ValueError("DuoAttention's parity rows need the model's head roles")
                heads = duo_retrieval_heads(roles, budget, len(question_inside(case).context_ids))
                fraction = heads / roles.gates.numel()
                setting = Setting(policy=policy, budget=budget, knobs=(("retrieval_fraction", repr(fraction)),))
            prompt = case.context_ids + case.question_ids
            extra = {}
            if document and budget < len(case.context_ids):
                compressed = server.compress(setting, case.context_ids)
                extra["kv_document"] = compressed["kv"]["kv_document"]
            body = server.complete(setting, prompt, max_tokens=case.max_tokens, **extra)
            if extra and not body["usage"].get("kv_tokens_evicted"):
                raise RuntimeError(f"case {case.key}: the question did not resume from its compressed context")
            text = body["choices"][0]["text"]
            append_row(
                out,
                {
                    "side": "kvserve",
                    "label": label,
                    "key": case.key,
                    "answer": text,
                    "references": list(case.references),
                    "context_tokens": len(case.context_ids),
                    "kv_tokens_evicted": body["usage"].get("kv_tokens_evicted", 0),
                },
            )
            print(f"kvserve {label} {case.key}: {text!r}", flush=True)


def parity_table(rows: list[dict]) -> str:
    """Per setting: where the question was, each side's mean score over its cases [95% interval], kvserve minus
    kvpress, and each side's mean as a share of its own `full` (the two sides' full caches differ in bf16 rounding,
    which flips a few answers of a small model)."""
    by: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        by.setdefault((row["side"], row["label"]), []).append(score(row["answer"], row["references"]))
    # a kvserve row names its allocation (`kvzip@256/global`): it is compared with kvpress's press at that B
    references = sorted({label.split("/")[0] for _, label in by}, key=lambda label: (label != "full", label))

    def cell(side: str, label: str) -> str:
        values = by.get((side, label))
        if not values:
            return ""
        mean = sum(values) / len(values)
        low, high = wilson(mean, len(values))
        return f"{mean:.2f} [{low:.2f}, {high:.2f}] (n={len(values)})"

    def share(side: str, label: str) -> str:
        values, full = by.get((side, label)), by.get((side, "full"))
        if not values or not full or not sum(full):
            return ""
        return f"{sum(values) / len(values) / (sum(full) / len(full)):.0%}"

    body = []
    for reference in references:
        ours = sorted(label for side, label in by if side == "kvserve" and label.split("/")[0] == reference)
        for label in ours or [reference]:
            kvp, kvs = by.get(("kvpress", reference)), by.get(("kvserve", label))
            diff = "" if not (kvp and kvs) else f"{sum(kvs) / len(kvs) - sum(kvp) / len(kvp):+.2f}"
            policy = reference.split("@")[0]
            where = "" if policy == "full" else "outside" if compresses_before_question(policy) else "inside"
            shares = f"{share('kvpress', reference)} / {share('kvserve', label)}" if label != "full" else ""
            body.append([label, where, cell("kvpress", reference), cell("kvserve", label), diff, shares])
    header = ["setting (kvserve's allocation)", "question", "kvpress", "kvserve", "kvserve - kvpress"]
    return table([*header, "share of its own full: kvpress / kvserve"], body)


def main(args) -> None:
    if not args.table_only:
        from transformers import AutoTokenizer

        if not args.model_dir:
            raise SystemExit("kvserve eval parity: --model-dir is required to run cases")
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        budgets = [int(b) for b in args.budgets.split(",") if b]
        settings = settings_of([p for p in args.policies.split(",") if p], budgets)
        cases = parity_cases(
            tokenizer, args.tasks.split(","), [int(n) for n in args.lengths.split(",")], args.samples, args.seed
        )
        if args.side in ("both", "kvpress"):
            run_reference(args.reference_python, args.model_dir, cases, settings, args.out)
        if args.side in ("both", "kvserve"):
            server = Server(args.url)
            roles = roles_of(args.model_dir) if any(policy == "duoattention" for policy, _ in settings) else None
            for allocation in args.allocations.split(","):
                run_kvserve(server, cases, settings, allocation, args.out, roles)
    print(parity_table(load_rows(args.out)))


def add_side_arguments(parser) -> None:
    """The options of a command that runs cases through kvpress and a kvserve server (parity, scoreboard)."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running kvserve server of the model")
    parser.add_argument("--model-dir", help="the model's transformers directory (both sides load it)")
    parser.add_argument("--reference-python", default=".kvpress-venv/bin/python", help="kvpress's environment")


def add_parser(commands) -> None:
    parser = commands.add_parser("parity", help="the same cases through kvpress's presses and kvserve's server")
    add_side_arguments(parser)
    parser.add_argument("--policies", default="kvzip", help=f"comma list of {', '.join(REFERENCE_PRESS)}")
    parser.add_argument("--budgets", default="512")
    parser.add_argument("--allocations", default="uniform", help="kvserve's kv_allocation values (comma list)")
    parser.add_argument("--tasks", default="passkey,multikey_one")
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=("both", "kvpress", "kvserve"), default="both")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--out", required=True, help="JSON lines of both sides' answers; an existing file resumes")
    parser.set_defaults(handler=main)


if __name__ == "__main__":
    sys.exit("run as `kvserve eval parity ...`")
