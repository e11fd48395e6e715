"""`kvserve eval scoreboard`: RULER at 4k under kvpress's leaderboard protocol, the same cases through kvpress 0.5.5
and through a kvserve server, setting by setting, so that kvserve stands on the plot the field compares methods on.

A setting is `POLICY@RATIO/QUESTION` (`kvzip@0.75/outside`, `snapkv@0.5/inside`, `full`):
- `outside` is the leaderboard's first loop: the context is compressed before the question is seen. kvpress
  prefills the context under its press, then answers the question kept in full. kvserve: KVzip's context is
  compressed by its reconstruction (`POST /v1/kvserve/compress`), any other policy's where the context ends
  (`kv_document`: the policy's own scores, its queries the context's last ones); the question resumes from the
  compressed lists and is kept in full, with the reply.
- `inside` is the second loop (kvpress's `query_aware`): the question is part of what is compressed. kvpress
  compresses context and question, the answer prefix kept in full; kvserve compacts the whole prompt where it
  ends, as it serves by default.
- RATIO r: every (layer, KV head) keeps (1 - r) x the compressed tokens on average, B entries
  (`ruler4k.budget_for`), the same B on both sides (kvpress's ratio is set to give exactly B); a compressed document
  keeps whole blocks, so its B is rounded to the server's block size.
- POLICY: kvserve's name; the kvpress press is the one of that name (`parity.REFERENCE_KNOBS` makes kvserve's knobs
  the press's, span 1). `default` is kvserve's serving default (snapkv with its own knobs and span, what a request
  naming only the policy gets; kvserve side only); `/global` after the question names kvserve's kv_allocation
  (KVzip's default is global, as kvpress's KVzip ranks all heads). kvserve's own tuning of a press, compared with
  that press: `POLICY:KNOB=VALUE@...` (the policy's own knobs, these changed) and `/spanN` (else its own span).

    kvserve eval scoreboard --url http://127.0.0.1:8000 --model-dir "$(kvserve setup-model qwen2.5-coder-0.5b)" \\
        --settings full,kvzip@0.75/outside,snapkv@0.75/inside --samples 20 --out docs/eval/ruler4k/qwen05.jsonl

Cases are interleaved task by task (`ruler4k.interleaved`), so a run stopped early has as many answers of each task;
every answer is one JSON line, and a rerun resumes where the file ends. `--table-only` prints the table.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, replace
from functools import cache

from kvserve.duo.roles import HeadRoles
from kvserve.tools.eval import ruler4k
from kvserve.tools.eval.client import Server, Setting, append_row, load_rows, parse_policy
from kvserve.tools.eval.parity import (
    REFERENCE_KNOBS,
    ParityCase,
    add_side_arguments,
    duo_reference,
    duo_retrieval_heads,
    kvzap_reference,
    roles_of,
    run_kvpress_side,
)
from kvserve.tools.markdown import table

QUESTIONS = ("outside", "inside")
KVSERVE_ONLY = ("default",)  # kvserve's serving default: snapkv as the server configures it


@dataclass(frozen=True)
class BoardSetting:
    policy: str  # kvserve's policy, `full`, or `default`
    ratio: float = 0.0
    question: str = "outside"
    allocation: str = "uniform"  # kvserve's kv_allocation
    threshold: float | None = None  # KVzap's kv_threshold instead of a ratio (kvserve side; B then caps nothing)
    # kvserve's own tuning (`snapkv:kernel_size=31@0.75/inside/span16`): the policy's knobs with these changed and
    # this span, served beside the press it is tuned from; none given, a press row serves the press's knobs, span 1
    knobs: tuple[tuple[str, str], ...] = ()
    span: int | None = None

    @property
    def tuned(self) -> bool:
        return bool(self.knobs) or self.span is not None

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full"
        amount = f"t{self.threshold:g}" if self.threshold is not None else f"{self.ratio:g}"
        name = ":".join([self.policy, *(f"{key}={value}" for key, value in self.knobs)])
        label = f"{name}@{amount}/{self.question}"
        label += f"/{self.allocation}" if self.allocation != "uniform" else ""
        return label + (f"/span{self.span}" if self.span is not None else "")

    @property
    def reference(self) -> str | None:
        """The kvpress row this setting is compared with (kvpress keeps every press's own allocation); kvserve's
        default is SnapKV as the server configures it, so its row is kvpress's SnapKV at the same ratio and question,
        and a tuned setting's is the press it is tuned from. A threshold has none: it is compared with kvserve's own
        fixed budgets (what each keeps, what it scores)."""
        if self.threshold is not None:
            return None
        return BoardSetting(self.served_policy, self.ratio, self.question).label

    @property
    def served_policy(self) -> str:
        return "snapkv" if self.policy == "default" else self.policy

    @property
    def compresses_document(self) -> bool:
        """kvserve compresses the context alone, as a document (its lists then fill whole blocks)."""
        return self.policy != "full" and self.question == "outside"


def parse_setting(text: str) -> BoardSetting:
    """`full`, POLICY[:KNOB=VALUE...]@RATIO/QUESTION[/ALLOCATION][/spanN] or kvzap@tT/inside; ValueError names what
    is wrong."""
    from kvserve.policies import POLICIES

    if text == "full":
        return BoardSetting("full")
    threshold = re.fullmatch(r"kvzap@t(-?[0-9.]+)/inside", text)
    if threshold:  # (kv_threshold keeps uneven counts per head, which a compressed document cannot publish)
        return BoardSetting("kvzap", question="inside", threshold=float(threshold.group(1)))
    match = re.fullmatch(
        r"([a-z_]+)((?::[a-z_]+=[^:@/]+)*)@([0-9.]+)/(outside|inside)(?:/(uniform|global|heads|layers))?(?:/span(\d+))?",
        text,
    )
    if not match:
        raise ValueError(
            f"{text!r}: a setting is full, POLICY[:KNOB=VALUE]@RATIO/QUESTION[/ALLOCATION][/spanN] (e.g. "
            "kvzip@0.75/outside, snapkv:kernel_size=31@0.75/inside/span16) or kvzap@tTHRESHOLD/inside (e.g. "
            "kvzap@t-6/inside)"
        )
    policy, knob_text, ratio, question, allocation, span = match.groups()
    if policy not in REFERENCE_KNOBS and policy not in KVSERVE_ONLY:
        known = ", ".join([*REFERENCE_KNOBS, *KVSERVE_ONLY])
        raise ValueError(f"{text!r}: {policy} has no kvpress press here; one of {known}")
    if policy not in POLICIES and policy not in KVSERVE_ONLY:
        raise ValueError(f"{text!r}: kvserve serves no policy {policy}")
    # each knob one of the served policy's, each value one the server takes
    _, knobs = parse_policy(BoardSetting(policy).served_policy + knob_text)
    ratio_value = float(ratio)
    if not 0 < ratio_value < 1:
        raise ValueError(f"{text!r}: the ratio is in (0, 1)")
    if span is not None and int(span) < 1:
        raise ValueError(f"{text!r}: a span is at least 1")
    default_allocation = "global" if policy == "kvzip" else "uniform"
    return BoardSetting(
        policy, ratio_value, question, allocation or default_allocation, knobs=knobs,
        span=None if span is None else int(span),
    )  # fmt: skip


@dataclass(frozen=True)
class BoardCase:
    key: tuple[str, int]  # (task, index)
    outside: tuple[list[int], list[int]]  # (compressed ids, kept ids): the context, then question and answer prefix
    inside: tuple[list[int], list[int]]  # the context and question, then the template's reply start and prefix
    references: tuple[str, ...]
    max_tokens: int

    def form(self, question: str) -> tuple[list[int], list[int]]:
        return self.outside if question == "outside" else self.inside


def board_cases(tokenizer, tasks: list[str], samples: int, seed: int = 0) -> list[BoardCase]:
    cases = []
    for case in ruler4k.interleaved(ruler4k.make_cases(tokenizer, tasks, samples, seed)):
        outside = ruler4k.pipeline_ids(tokenizer, case.context, case.question, case.answer_prefix)
        inside = ruler4k.pipeline_ids(tokenizer, case.context + case.question, "", case.answer_prefix)
        cases.append(BoardCase(case.key, outside, inside, case.references, case.max_new_tokens))
    return cases


def budget_of(setting: BoardSetting, case: BoardCase, block_size: int) -> int | None:
    if setting.policy == "full":
        return None
    compressed, _ = case.form(setting.question)
    if setting.threshold is not None:  # the threshold alone decides: a cap no list reaches
        return len(compressed)
    return ruler4k.budget_for(setting.ratio, len(compressed), block_size if setting.compresses_document else 1)


# --- kvpress's side ---


def run_kvpress(
    python: str, model_dir: str, cases: list[BoardCase], settings: list[BoardSetting], out: str, block_size: int
) -> None:
    """kvpress's rows of every setting that has a press, one subprocess per question form (kvpress_side.py)."""
    for question in QUESTIONS:
        group = [s for s in settings if s.reference and s.question == question]  # (full's question is outside)
        if not group:
            continue
        forms = [ParityCase(list(c.key), *c.form(question), c.references, c.max_tokens) for c in cases]
        entries = []
        # kvpress keeps each press's own allocation: its rows are labelled uniform; default runs as kvpress's snapkv
        for setting in dict.fromkeys(replace(parse_setting(s.reference), allocation="uniform") for s in group):
            entry = {"label": setting.label, "press": setting.policy, "budget": None}
            if setting.policy != "full":
                entry["budgets"] = {json.dumps(list(c.key)): budget_of(setting, c, block_size) for c in cases}
            if setting.policy == "duoattention":
                entry.update(duo_settings(model_dir, forms, entry["budgets"]))
            if setting.policy == "kvzap":
                entry.update(kvzap_reference(model_dir))
            entries.append(entry)
        run_kvpress_side(python, model_dir, forms, entries, out)


def duo_settings(model_dir: str, forms: list[ParityCase], budgets: dict[str, int]) -> dict:
    """DuoAttention's head roles and each case's retrieval heads for kvpress's press at each case's budget."""
    roles = model_roles(model_dir)
    heads = {
        json.dumps(form.key): duo_retrieval_heads(roles, budgets[json.dumps(form.key)], len(form.context_ids))
        for form in forms
    }
    return {**duo_reference(roles, 1, []), "retrieval_heads": heads}


@cache
def model_roles(model_dir: str) -> HeadRoles:
    """The model's DuoAttention roles, read once per run (`parity.roles_of`)."""
    return roles_of(model_dir)


# --- kvserve's side ---


def server_block_size(server: Server) -> int:
    """The server's block size, from vLLM's cache_config_info series."""
    found = re.search(r'cache_config_info\{[^}]*block_size="(\d+)"', server.metrics_text())
    if not found:
        raise RuntimeError(f"{server.url}/metrics has no vllm:cache_config_info with a block_size")
    return int(found.group(1))


def served_setting(setting: BoardSetting, budget: int | None, model_dir: str, case: BoardCase) -> Setting:
    if setting.policy == "full":
        return Setting("full", None)
    if setting.policy in KVSERVE_ONLY or setting.tuned:  # the policy's own knobs and span, unless told otherwise
        from kvserve.policies import POLICIES

        span = setting.span if setting.span is not None else POLICIES[setting.served_policy].default_span
        return Setting(setting.served_policy, budget, allocation=setting.allocation, span=span, knobs=setting.knobs)
    knobs = REFERENCE_KNOBS[setting.policy]
    if setting.policy == "duoattention":
        roles = model_roles(model_dir)
        heads = duo_retrieval_heads(roles, budget, len(case.form(setting.question)[0]))
        knobs = (("retrieval_fraction", repr(heads / roles.gates.numel())),)
    if setting.threshold is not None:  # the same window as the fixed budgets it is compared with
        knobs = (*knobs, ("threshold", repr(setting.threshold)))
    return Setting(setting.served_policy, budget, allocation=setting.allocation, knobs=knobs)


def run_kvserve(
    server: Server, model_dir: str, cases: list[BoardCase], settings: list[BoardSetting], out: str, block_size: int
) -> None:
    rows = load_rows(out)
    done = {(row["label"], tuple(row["key"])) for row in rows if row["side"] == "kvserve"}
    # kvpress's rows record the B they kept: the same B here, or the comparison is not of the same memory
    theirs = {(row["label"], tuple(row["key"])): row.get("budget") for row in rows if row["side"] == "kvpress"}
    for case in cases:  # case by case, as kvpress's side: a run stopped early is balanced over the settings
        for setting in settings:
            if (setting.label, case.key) in done:
                continue
            budget = budget_of(setting, case, block_size)
            if theirs.get((setting.reference, case.key), budget) != budget:
                raise SystemExit(
                    f"{setting.label} {case.key}: kvpress's row kept {theirs[(setting.reference, case.key)]} entries, "
                    f"this server's block size ({block_size}) gives {budget}: run kvpress's side with --block-size "
                    f"{block_size}"
                )
            served = served_setting(setting, budget, model_dir, case)
            compressed, kept = case.form(setting.question)
            extra = {}
            if setting.compresses_document:
                if served.compresses_documents():
                    server.compress(served, compressed)  # KVzip: the context reconstructed, then compressed
                extra["kv_document"] = len(compressed)
            body = server.complete(served, compressed + kept, max_tokens=case.max_tokens, **extra)
            evicted = body["usage"].get("kv_tokens_evicted", 0)
            if budget is not None and not evicted:
                raise RuntimeError(f"{setting.label} {case.key}: served without eviction (kv_tokens_evicted 0)")
            answer = body["choices"][0]["text"]
            append_row(
                out,
                {
                    "side": "kvserve",
                    "label": setting.label,
                    "key": list(case.key),
                    "answer": answer,
                    "references": list(case.references),
                    "context_tokens": len(compressed),
                    "budget": budget,
                    "kv_tokens_evicted": evicted,
                },
            )
            print(f"kvserve {setting.label} {case.key}: {answer[:60]!r}", flush=True)


# --- the table ---


def scored(rows: list[dict]) -> list[dict]:
    """Rows with their task and RULER score."""
    return [
        {**row, "task": row["key"][0], "score": ruler4k.string_match(row["key"][0], row["answer"], row["references"])}
        for row in rows
    ]


def by_setting(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Scored rows (`scored`) grouped by (side, label)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for row in scored(rows):
        by.setdefault((row["side"], row["label"]), []).append(row)
    return by


def cell(rows: list[dict]) -> str:
    if not rows:
        return ""
    mean, low, high, n = ruler4k.mean_over_tasks(rows)
    return f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}] (n={n})"


def board_table(rows: list[dict]) -> str:
    """Per setting: kvpress's and kvserve's RULER-4k mean over tasks (x100) with its 95% interval and answer count,
    kvserve minus kvpress on the cases both answered, and each side's share of its own full."""
    by = by_setting(rows)
    # a kvserve row stands beside the press it names; a press no kvserve row names has a row of its own
    named = {parse_setting(label).reference for side, label in by if side == "kvserve"}
    labels = {label for side, label in by if side == "kvserve" or label not in named}
    labels = sorted(labels, key=label_order)
    body = []
    for label in labels:
        setting = parse_setting(label)
        ours, theirs = by.get(("kvserve", label), []), by.get(("kvpress", setting.reference or ""), [])
        shares = " / ".join(
            share(group, by.get((side, "full"), [])) or "-" for side, group in (("kvpress", theirs), ("kvserve", ours))
        )
        body.append([label, cell(theirs), cell(ours), paired_difference(theirs, ours), shares])
    return table(["setting", "kvpress", "kvserve", "kvserve - kvpress (same cases)", "share of full"], body)


def label_order(label: str) -> tuple:
    if label == "full":
        return (0, 0.0, "")
    setting = parse_setting(label)
    return (1 if setting.threshold is None else 2, setting.ratio, setting.question, setting.policy,
            setting.allocation, setting.threshold or 0.0, setting.knobs, setting.span or 0)  # fmt: skip


def paired_difference(theirs: list[dict], ours: list[dict]) -> str:
    """kvserve minus kvpress on the cases both answered, x100, with its 95% interval (`ruler4k.paired_difference`)."""
    return difference_text(*ruler4k.paired_difference(ours, theirs))


def difference_text(mean: float, low: float, high: float, n: int) -> str:
    """A paired difference (`ruler4k.paired_difference`) x100 with its interval; empty without shared cases."""
    return "" if not n else f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] (n={n})"


def full_on_same_cases(rows: list[dict], full: list[dict]) -> float:
    """full's mean over tasks on the cases `rows` answered: the base of a share of full."""
    keys = {tuple(row["key"]) for row in rows}
    return ruler4k.mean_over_tasks([row for row in full if tuple(row["key"]) in keys])[0]


def share(rows: list[dict], full: list[dict]) -> str:
    if not rows or not full:
        return ""
    base = full_on_same_cases(rows, full)
    return "" if not base else f"{ruler4k.mean_over_tasks(rows)[0] / base:.0%}"


def main(args) -> None:
    settings = [parse_setting(text) for text in args.settings.split(",") if text]
    if not args.table_only:
        from transformers import AutoTokenizer

        if not args.model_dir:
            raise SystemExit("kvserve eval scoreboard: --model-dir is required to run cases")
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        tasks = [task for task in args.tasks.split(",") if task]
        cases = board_cases(tokenizer, tasks, args.samples, args.seed)
        server = Server(args.url) if args.side == "kvserve" else None
        block_size = server_block_size(server) if server else args.block_size
        if args.side == "kvpress":
            run_kvpress(args.reference_python, args.model_dir, cases, settings, args.out, block_size)
        else:
            run_kvserve(server, args.model_dir, cases, settings, args.out, block_size)
    print(board_table(load_rows(args.out)))


def add_parser(commands) -> None:
    parser = commands.add_parser("scoreboard", help="RULER-4k under kvpress's leaderboard protocol, both sides")
    add_side_arguments(parser)
    parser.add_argument("--side", choices=("kvserve", "kvpress"), default="kvserve")
    parser.add_argument(
        "--settings",
        default="full",
        help="comma list of full, POLICY[:KNOB=VALUE]@RATIO/QUESTION[/ALLOCATION][/spanN] and kvzap@tT/inside",
    )
    parser.add_argument("--tasks", default=",".join(ruler4k.TASKS), help="RULER tasks (all that can be generated)")
    parser.add_argument("--samples", type=int, default=10, help="cases per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-size", type=int, default=32, help="kvpress side: the kvserve server's block size (B of documents)"
    )
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--out", required=True, help="JSON lines of both sides' answers; an existing file resumes")
    parser.set_defaults(handler=main)


if __name__ == "__main__":
    sys.exit("run as `kvserve eval scoreboard ...`")
