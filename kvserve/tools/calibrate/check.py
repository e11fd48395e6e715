"""The profile's quality check: a short run of the judged tasks through the model's own server, and per target share
of the full cache's score the setting that needs the least memory.

The full cache answers every case first; only the cases it answers right are kept (a case the full cache misses says
nothing about eviction), and a setting's share is the fraction of those it still answers right. Settings run in
order of memory, smallest budget first for each policy: a setting stops as soon as its misses leave the lowest target
out of reach, and a policy's larger budgets are skipped once a smaller one keeps the highest target (a larger budget
keeps a superset of the same scores' choices). Rows are appended as answers arrive, so an interrupted check resumes.

The recommendation for a target is the smallest budget whose share reaches it (ties: the higher share, then the
order of `policies`), as kv_* settings a server takes as its defaults.

The time estimate counts `expected_requests`, what the check is expected to send under those stops, rather than the
most it could send (`CheckPlan.requests`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.policies import POLICIES, ScoredPolicy
from kvserve.tools.eval.client import Server, Setting, append_row, load_rows, parse_policy, settings
from kvserve.tools.eval.quality import answer, row_key
from kvserve.tools.eval.suite import wilson
from kvserve.tools.eval.tasks import Case, make_cases

FULL = Setting("full", None)


@dataclass(frozen=True)
class CheckPlan:
    # multikey_one, not kv_one: the lookup among several keys is where policies lose (the suite's "hard half")
    tasks: tuple[str, ...] = ("passkey", "multikey_one", "chat_followup", "niah_multiquery")
    lengths: tuple[int, ...] = (2000,)
    samples: int = 3
    policies: tuple[str, ...] = (
        # the server's built-in default first (ties go to the earlier policy), then SnapKV as its paper pools
        "snapkv",
        "snapkv:kernel_size=7",
        "duoattention",
        "tova",
        "ahakv",
        "keydiff",
        "expected_attention",
        "snapkv+caote",
        "ems",
        "mat",
        "h2o",
        "streamingllm",
    )
    budgets: tuple[int, ...] = (128, 256, 512)
    spans: tuple[int, ...] = (8,)
    targets: tuple[float, ...] = (0.9, 0.95)
    seed: int = 0

    def settings(self) -> list[Setting]:
        """Every policy at every budget and span it can use (spans apply to score-based policies; the others run at
        span 1), each policy's budgets ascending, in the order of `policies`."""
        chosen = []
        for policy in self.policies:
            name, _ = parse_policy(policy)  # ValueError naming an unknown policy or knob
            if name == "full" or POLICIES[name].ragged:
                raise ValueError(f"{policy}: the check compares policies at budgets; {name} has none")
            spans = self.spans if issubclass(POLICIES[name], ScoredPolicy) else (1,)
            chosen += sorted(settings([policy], list(self.budgets), spans=spans), key=lambda s: (s.span, s.budget))
        return chosen

    def cases(self, tokenizer) -> list[Case]:
        return make_cases(tokenizer, list(self.tasks), list(self.lengths), self.samples, self.seed)

    def requests(self) -> int:
        """The most requests the check sends (early stops send fewer)."""
        return (1 + len(self.settings())) * case_count(self)


def case_count(plan: CheckPlan) -> int:
    """The check's cases: each task at each length, `samples` times."""
    return len(plan.tasks) * len(plan.lengths) * plan.samples


def expected_requests(plan: CheckPlan, kept: int | None = None) -> float:
    """The requests the check is expected to send, by `run_check`'s rule: the full cache answers every case, then each
    setting answers the `kept` cases the full cache answered right (all of them while that is unknown) until it
    stops early, and a policy's next budget runs only if no smaller one kept the highest target.

    How a policy does on the model is what the check measures, so nothing is assumed about it: each setting's share of
    missed cases is taken as equally likely anywhere in [0, 1], independently of the others. The recorded check of
    Qwen2.5-Coder-0.5B-Instruct (docs/eval/qwen05/calibrate.json) sent 241 requests; this expects 185 of its plan
    (the upper bound, `CheckPlan.requests`: 444)."""
    cases = case_count(plan)
    kept = cases if kept is None else kept
    if not kept:
        return float(cases)  # nothing to keep a share of: every setting is skipped
    answers = _expected_answers(kept, stop_at=_misses_allowed(kept, min(plan.targets)) + 1)
    keeps_highest = (_misses_allowed(kept, max(plan.targets)) + 1) / (kept + 1)  # P(misses <= allowed), q uniform
    budgets = Counter(setting.label for setting in plan.settings())  # per policy (and span), ascending
    runs = sum((1 - keeps_highest) ** smaller for count in budgets.values() for smaller in range(count))
    return cases + runs * answers


def _misses_allowed(kept: int, target: float) -> int:
    """The most whole misses among `kept` cases that still keep `target` (run_check's tolerance)."""
    return int(kept * (1 - target) + 1e-9)


def _expected_answers(kept: int, stop_at: int) -> float:
    """Cases a setting answers before its `stop_at`-th miss stops it (or all `kept`) over a miss rate uniform on
    [0, 1]: case n+1 is asked when the first n held fewer than `stop_at` misses, and over a uniform rate each count
    of misses among n cases is equally likely (1 / (n + 1) each)."""
    return sum(min(stop_at, asked + 1) / (asked + 1) for asked in range(kept))


@dataclass
class SettingResult:
    label: str
    policy: str
    budget: int
    span: int
    knobs: dict
    answered: int  # of the cases the full cache answers right
    correct: float
    complete: bool  # False: stopped early, its share can no longer reach the lowest target
    share: float = field(init=False)
    low: float = field(init=False)
    high: float = field(init=False)

    def __post_init__(self) -> None:
        self.share = round(self.correct / self.answered, 4) if self.answered else 0.0
        low, high = wilson(self.share, self.answered)
        self.low, self.high = round(low, 4), round(high, 4)

    def kv_settings(self) -> dict:
        return {"kv_policy": self.policy, "kv_budget": self.budget, "kv_span": self.span, **self.knobs}


def recommend(results: list[SettingResult], targets: tuple[float, ...], order: list[str]) -> dict[str, dict | None]:
    """Per target: the least-memory setting whose share reaches it (complete runs only)."""
    chosen: dict[str, dict | None] = {}
    for target in targets:
        passing = [r for r in results if r.complete and r.share >= target]
        passing.sort(key=lambda r: (r.budget, -r.share, order.index(r.label.split("/")[0])))
        chosen[f"{target:g}"] = (
            {**passing[0].kv_settings(), "share": passing[0].share, "interval": [passing[0].low, passing[0].high]}
            if passing
            else None
        )
    return chosen


def run_check(
    server: Server,
    plan: CheckPlan,
    tokenizer,
    rows_path: Path,
    tick: Callable[[int], None] = lambda n: None,
    served: Callable[[dict], None] = lambda row: None,
) -> dict:
    """Run the check (resuming from `rows_path`) and return the profile's `check` record. `tick(n)` is called with
    the number of requests each step accounts for (answered, or skipped by an early stop); `served(row)` with each
    row the server answered in this run, not those resumed from `rows_path` (its `seconds` time the server)."""
    done = {row_key(row): row for row in load_rows(str(rows_path))}

    def answered(setting: Setting, case: Case) -> dict:
        key = (setting.label, setting.budget, *case.key)
        if key not in done:
            done[key] = answer(server, setting, case)
            append_row(str(rows_path), done[key])
            served(done[key])
        tick(1)
        return done[key]

    cases = plan.cases(tokenizer)
    kept = [case for case in cases if answered(FULL, case)["score"] >= 1.0]
    record: dict = {"plan": {**asdict(plan)}, "cases": len(cases), "full_answers": len(kept)}
    results: list[SettingResult] = []
    reached: set[str] = set()  # policies (label without budget) whose smaller budget kept the highest target
    for setting in plan.settings():
        family = setting.label
        if family in reached or not kept:
            tick(len(cases))
            continue
        allowed_misses = len(kept) * (1 - min(plan.targets))
        correct = missed = 0.0
        for number, case in enumerate(kept):
            score = answered(setting, case)["score"]
            correct, missed = correct + score, missed + (1 - score)
            if missed > allowed_misses + 1e-9:
                tick(len(cases) - number - 1)
                break
        else:
            tick(len(cases) - len(kept))
        complete = missed <= allowed_misses + 1e-9
        result = SettingResult(
            setting.label,
            setting.policy,
            setting.budget,
            setting.span,
            {f"kv_{k}": v for k, v in setting.knobs},
            answered=len(kept) if complete else number + 1,
            correct=correct,
            complete=complete,
        )
        results.append(result)
        if complete and result.share >= max(plan.targets):
            reached.add(family)
    order = list(plan.policies)
    record["results"] = [asdict(r) for r in results]
    record["recommended"] = recommend(results, plan.targets, order) if kept else {f"{t:g}": None for t in plan.targets}
    if not kept:
        record["why_none"] = f"the full cache answers none of the {len(cases)} check cases: nothing to keep a share of"
    return record
