"""RULER at 4k under kvpress's leaderboard protocol (`kvserve eval scoreboard`, `kvserve/tools/eval/ruler4k.py`): the
cases are lm-evaluation-harness's generators, seeded; the split is kvpress's; the score is RULER's string match; a
ratio names the same B on both sides; the report draws its figure from a result file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvserve.tools.eval import kvpress_side, ruler4k, scoreboard

TASKS = ["niah_single_1", "niah_multivalue", "niah_multikey_3", "vt", "cwe", "fwe"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture(scope="module")
def cases(tokenizer):
    return ruler4k.make_cases(tokenizer, TASKS, 2, seed=0)


def test_cases_are_seeded_and_do_not_depend_on_how_many_are_made(tokenizer, cases):
    again = ruler4k.make_cases(tokenizer, TASKS, 3, seed=0)
    assert [case for case in again if case.index < 2] == cases
    other = ruler4k.make_cases(tokenizer, TASKS, 2, seed=1)
    assert all(a.context != b.context for a, b in zip(cases, other, strict=True))


def test_each_case_is_split_at_its_last_question_with_its_answers_in_the_context(tokenizer, cases):
    for case in cases:
        pattern = ruler4k.QUESTION_PATTERNS[ruler4k.category(case.task)]
        assert pattern.match(case.question), case.key
        assert not pattern.search(case.question[1:]), case.key  # the last question: no other after its start
        assert all(reference in case.context for reference in case.references), case.key
        tokens = len(tokenizer(case.context + case.question).input_ids) + case.max_new_tokens
        assert tokens <= ruler4k.LENGTH + 8, case.key  # RULER's 4k: prompt and answer (the template adds a few)
    assert {case.task for case in cases} == set(TASKS)
    assert "Question: What are the 10 most common words" in next(c for c in cases if c.task == "cwe").context


@pytest.mark.parametrize(
    "task, answer, references",
    [
        ("niah_single_1", " 4430567.", ["4430567"]),
        ("niah_multivalue", "1234567, 7654321 and more", ["1234567", "7654321", "1111111", "2222222"]),
        ("vt", "\x07 VAR abcde ", ["ABCDE", "FGHIJ"]),
        ("cwe", "nothing", ["pudding", "cable"]),
    ],
)
def test_the_score_is_rulers_string_match_all(task, answer, references):
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    expected = string_match_all(postprocess_pred([answer]), [references])  # the harness's RULER metric
    assert ruler4k.string_match(task, answer, references) == pytest.approx(expected)


def test_qa_is_scored_by_any_reference_found():
    assert ruler4k.string_match("qa_1", "it was Paris", ["paris", "lyon"]) == 1.0
    assert ruler4k.string_match("qa_1", "it was Rome", ["paris", "lyon"]) == 0.0
    assert ruler4k.string_match("niah_multivalue", "it was Paris", ["paris", "lyon"]) == 0.5


@pytest.mark.parametrize("ratio", ruler4k.RATIOS)
@pytest.mark.parametrize("tokens", [3673, 3821, 4000])
def test_a_ratio_keeps_one_minus_r_of_the_tokens_and_kvpress_keeps_the_same(ratio, tokens):
    budget = ruler4k.budget_for(ratio, tokens)
    assert abs(budget - (1 - ratio) * tokens) <= 0.5
    blocks = ruler4k.budget_for(ratio, tokens, 32)
    assert blocks % 32 == 0 and abs(blocks - (1 - ratio) * tokens) <= 16
    key = ["vt", 0]
    kvpress_ratio = kvpress_side.compression_ratio({"budgets": {json.dumps(key): budget}}, {"key": key}, tokens)
    assert int(tokens * (1 - kvpress_ratio)) == budget  # kvpress's ScorerPress: n_kept = int(k_len * (1 - ratio))


def test_a_ratio_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError):
        ruler4k.budget_for(1.0, 100)


def test_the_mean_is_over_tasks_and_its_interval_adds_their_bounded_variances():
    rows = [{"task": "a", "score": s} for s in (1, 1, 1, 0)] + [{"task": "b", "score": s} for s in (0.5, 0.5)]
    mean, low, high, n = ruler4k.mean_over_tasks(rows)
    assert mean == pytest.approx((0.75 + 0.5) / 2) and n == 6
    z = 1.96
    variance = 0.0
    for total, count in ((3, 4), (1, 2)):
        p = (total + z * z / 2) / (count + z * z)
        variance += p * (1 - p) / (count + z * z)
    assert high - mean == pytest.approx(z * math.sqrt(variance) / 2)
    assert low < mean < high
    more = rows * 10
    assert ruler4k.mean_over_tasks(more)[2] - ruler4k.mean_over_tasks(more)[1] < high - low


def test_the_paired_difference_is_over_tasks_with_an_interval_from_each_tasks_differences():
    def rows(side_scores: dict[str, list[float]]) -> list[dict]:
        return [
            {"task": task, "key": [task, index], "score": score}
            for task, scores in side_scores.items()
            for index, score in enumerate(scores)
        ]

    ours = {"a": [1, 1, 0, 1, 0.5], "b": [0, 1, 1]}
    theirs = {"a": [1, 0, 0, 0, 0.25], "b": [0, 1, 0, 1]}  # b's fourth case has no answer of ours: left out
    mean, low, high, n = ruler4k.paired_difference(rows(ours), rows(theirs))
    assert n == 8
    # by hand: each task's differences, Agresti-Coull's z^2/4 pseudo-differences at +1 and at -1
    z, expected_mean, variance = 1.96, [], 0.0
    for task in ("a", "b"):
        d = np.array(ours[task]) - np.array(theirs[task][: len(ours[task])])
        expected_mean.append(d.mean())
        values = np.concatenate([d, [1.0, -1.0]])
        weights = np.concatenate([np.ones_like(d), [z * z / 4] * 2])
        centre = np.average(values, weights=weights)
        variance += np.average((values - centre) ** 2, weights=weights) / d.size
    assert mean == pytest.approx(np.mean(expected_mean))
    assert high - mean == pytest.approx(mean - low) == pytest.approx(z * math.sqrt(variance) / 2)
    # sides that agree: zero, inside an interval; one side always right: an interval clear of zero
    same = ruler4k.paired_difference(rows(ours), rows(ours))
    assert same[0] == 0 and same[1] < 0 < same[2]
    right, wrong = rows({"a": [1] * 20, "b": [1] * 20}), rows({"a": [0] * 20, "b": [0] * 20})
    assert ruler4k.paired_difference(right, wrong)[1] > 0 > ruler4k.paired_difference(wrong, right)[2]
    assert math.isnan(ruler4k.paired_difference(rows({"a": [1]}), rows({"b": [1]}))[0])


@pytest.mark.parametrize(
    "text, label",
    [
        ("full", "full"),
        ("kvzip@0.75/outside", "kvzip@0.75/outside/global"),
        ("snapkv@0.5/inside", "snapkv@0.5/inside"),
        ("default@0.875/inside", "default@0.875/inside"),
        ("kvzap@t-6.5/inside", "kvzap@t-6.5/inside"),
        ("snapkv:kernel_size=31@0.75/inside/span16", "snapkv:kernel_size=31@0.75/inside/span16"),
        ("kvzip@0.75/outside/span8", "kvzip@0.75/outside/global/span8"),
    ],
)
def test_settings_are_named_by_policy_ratio_and_question(text, label):
    assert scoreboard.parse_setting(text).label == label
    assert scoreboard.parse_setting(label) == scoreboard.parse_setting(text)


def test_the_default_is_served_with_the_policys_own_knobs_and_span_and_the_press_with_kvpress_s():
    """`default` is what a request naming only the policy gets (its class's knobs and span: a request's headers
    always carry a span, so one left at 1 would measure a setting nobody is served); the row compared with a press
    scores token by token with the press's knobs."""
    from kvserve.policies import POLICIES

    case = scoreboard.BoardCase(("niah_single_1", 0), ([1] * 100, [2]), ([1] * 100, [2]), ("x",), 8)
    default = scoreboard.served_setting(scoreboard.parse_setting("default@0.5/inside"), 50, "unused", case)
    served = POLICIES[scoreboard.parse_setting("default@0.5/inside").served_policy]
    assert (default.policy, default.span, default.knobs) == (served.name, served.default_span, ())
    assert served.default_span > 1
    press = scoreboard.served_setting(scoreboard.parse_setting("snapkv@0.5/inside"), 50, "unused", case)
    assert (press.span, press.knobs) == (1, scoreboard.REFERENCE_KNOBS["snapkv"])
    tuned = scoreboard.parse_setting("snapkv:kernel_size=31@0.5/inside/span16")
    assert tuned.reference == "snapkv@0.5/inside"
    served_tuned = scoreboard.served_setting(tuned, 50, "unused", case)
    assert (served_tuned.span, served_tuned.knobs) == (16, (("kernel_size", "31"),))
    assert served_tuned.headers()["x-kv-kernel-size"] == "31"
    knobs_only = scoreboard.served_setting(scoreboard.parse_setting("snapkv:kernel_size=31@0.5/inside"), 50, "", case)
    assert knobs_only.span == served.default_span


@pytest.mark.parametrize(
    "text",
    [
        "h2o@0.5/outside",
        "snapkv@1.5/inside",
        "snapkv@0.5",
        "kvzip@0.5/beside",
        "kvzap@t-6/outside",
        "snapkv:no_such_knob=3@0.5/inside",
        "snapkv@0.5/inside/span0",
    ],
)
def test_a_setting_without_a_press_or_a_ratio_is_refused(text):
    with pytest.raises(ValueError, match="setting|press|ratio|knob|span"):
        scoreboard.parse_setting(text)


def test_every_setting_the_scoreboard_parses_is_one_the_server_accepts():
    """The scoreboard refuses up front (parse_setting) what the server's kv_document refuses
    (kvserve/document_settings.py): a threshold's counts with the question outside. Checked against the settings the
    server parses, so the two cannot drift apart: what parses here is served, what the server refuses does not parse."""
    from kvserve.config import parse_kv_config

    for text in (
        "duoattention@0.75/outside",
        "tova@0.75/outside",
        "kvzip@0.75/outside",
        "kvzap@0.75/outside",
        "duoattention@0.75/inside",
        "kvzap@t-6/inside",
    ):
        setting = scoreboard.parse_setting(text)
        request = {"kv_policy": setting.served_policy, "kv_budget": 256}
        if setting.threshold is not None:
            request["kv_threshold"] = setting.threshold
        if setting.compresses_document:
            request["kv_document"] = 1024
        parse_kv_config(request)
    with pytest.raises(ValueError, match="kvzap@tTHRESHOLD/inside"):
        scoreboard.parse_setting("kvzap@t-6/outside")
    from kvserve.errors import InvalidSetting

    with pytest.raises(InvalidSetting, match="kv_document"):
        parse_kv_config({"kv_policy": "kvzap", "kv_budget": 256, "kv_threshold": -6.0, "kv_document": 1024})


def _row(side: str, label: str, task: str, index: int, right: bool) -> dict:
    return {
        "side": side,
        "label": label,
        "key": [task, index],
        "answer": "4430567" if right else "no",
        "references": ["4430567"],
    }


def test_the_figure_and_table_are_drawn_from_a_small_result_file(tmp_path):
    from kvserve.tools.report import scoreboard as page

    rows = []
    for index in range(4):
        for task in ("niah_single_1", "vt"):
            rows.append(_row("kvpress", "full", task, index, True))
            rows.append(_row("kvserve", "full", task, index, True))
            rows.append(_row("kvpress", "kvzip@0.5/outside", task, index, True))
            rows.append(_row("kvserve", "kvzip@0.5/outside/global", task, index, index < 3))
            rows.append(_row("kvpress", "kvzip@0.75/outside", task, index, index < 2))
            rows.append(_row("kvserve", "kvzip@0.75/outside/global", task, index, index < 2))
    lines = page.curves(rows)
    assert set(lines) == {("kvpress", "kvzip/outside"), ("kvserve", "kvzip/outside/global")}
    assert [point[:2] for point in lines[("kvserve", "kvzip/outside/global")]] == [(0.5, 75.0), (0.75, 50.0)]
    png = tmp_path / "board.png"
    page.plot(rows, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = scoreboard.board_table(rows)
    assert "| kvzip@0.5/outside/global | 100.0 " in text and "| -25.0 [" in text and "] (n=8) |" in text
    board = {"kvzip": {"model": "Big-8B", "ratio": 0.7, "score": 47.5, "full": 95.0}}
    line = page.leaderboard_line(board, rows, "Small")
    assert "KVzip at 0.7 keeps 50% of full on Big-8B (47.5 of 95.0)" in line
    assert "Small, question outside, 0.75: 50% on kvserve (50.0, n=8), 50% on kvpress 0.5.5 (50.0, n=8)." in line


def test_the_readme_shows_every_models_rows_and_the_first_models_figure(tmp_path, monkeypatch):
    from kvserve.tools.report import scoreboard as page
    from kvserve.tools.report.sources import DataDir

    run = json.dumps({"date": "2026-12-07", "command": "kvserve eval scoreboard ...", "machine": {"cpu": "test"}})
    models = []
    for size, right in (("0.5B", 4), ("7B", 1)):
        rows = [_row("kvserve", "full", task, index, index < right) for task in ("vt", "cwe") for index in range(4)]
        (tmp_path / f"{size}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / f"{size}.runs.jsonl").write_text(run + "\n")
        models.append((f"Model-{size}-Chat", f"{size}.jsonl", f"{size}.png"))
    monkeypatch.setattr(page, "MODELS", tuple(models))
    text = page.readme_part(DataDir(tmp_path), "plots")
    assert text.count("![") == 1 and "(plots/0.5B.png)" in text
    assert "| setting | 0.5B kvpress | 0.5B kvserve | 7B kvpress | 7B kvserve |" in text
    assert "| `full` | pending | 100.0 (n=8) | pending | 25.0 (n=8) |" in text
    assert "| `kvzip@0.75/outside/global` | pending | pending | pending | pending |" in text


def test_the_goals_name_kvserves_best_setting_with_enough_answers_and_the_settings_that_trail(monkeypatch):
    from kvserve.tools.report import scoreboard as page

    monkeypatch.setattr(page, "GOAL_ANSWERS", 8)
    rows = []
    for index in range(4):
        for task in ("niah_single_1", "vt"):
            rows.append(_row("kvserve", "full", task, index, True))
            rows.append(_row("kvpress", "kvzap@0.75/outside", task, index, True))
            rows.append(_row("kvserve", "kvzip@0.75/outside/global", task, index, index < 3))  # 75%
            rows.append(_row("kvserve", "kvzap@0.75/outside", task, index, index < 1))  # 25%, kvpress's 100%
            rows.append(_row("kvserve", "kvzip@0.875/outside/global", task, index, True))  # 100%
            if index < 3:  # too few answers to decide: never the best, however well it scores
                rows.append(_row("kvserve", "kvzap@0.75/outside/global", task, index, True))
    text = page.goal_table(rows)

    def share(label: str) -> str:
        ours = [row for row in scoreboard.scored(rows) if row["label"] == label]
        full = [row for row in scoreboard.scored(rows) if row["side"] == "kvserve" and row["label"] == "full"]
        difference, low, high, n = ruler4k.paired_difference(ours, full)
        assert n == 8 and ruler4k.mean_over_tasks(full)[0] == 1  # a share of 1 + d: full's score is 1 here
        return f"{1 + difference:.0%} [{1 + low:.0%}, {1 + high:.0%}]"

    # a goal is decided by the whole interval, not by the point: 75% on 8 answers spans 95%
    assert share("kvzip@0.75/outside/global").startswith("75% [")
    assert (
        f"| question outside, 0.75: best >= 95% of full | `kvzip@0.75/outside/global` (n=8) | "
        f"{share('kvzip@0.75/outside/global')} | not decided: the interval spans it |"
    ) in text
    assert "| question inside, 0.75: default >= 95% of full | no setting with 8 answers |  | not decided |" in text
    # decided both ways once the interval clears the goal: 40 answers a task
    halves = (("full", 1), ("kvzip@0.875/outside/global", 1), ("kvzip@0.75/outside/global", 0))
    many = [
        _row("kvserve", label, task, index, right or index % 2)
        for index in range(40)
        for task in ("niah_single_1", "vt")
        for label, right in halves
    ]
    decided = page.goal_table(many)
    assert "| `kvzip@0.875/outside/global` (n=80) | 100% [" in decided and "| met |" in decided
    assert "| `kvzip@0.75/outside/global` (n=80) | 50% [" in decided and "| not met |" in decided
    mean, low, high, n = ruler4k.paired_difference(
        [row for row in scoreboard.scored(rows) if row["label"] == "kvzap@0.75/outside"],
        [row for row in scoreboard.scored(rows) if row["side"] == "kvpress"],
    )
    assert high < 0
    line = f"`kvzap@0.75/outside` {100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] (n=8)"
    assert text.endswith(f"of 2 compared: {line}."), text


def test_the_table_keeps_kvserves_own_settings_at_every_ratio_and_leaves_thresholds_out():
    """A kvserve setting whose press kvpress has not run yet is a row with an empty kvpress cell (a best setting at a
    ratio kvpress has not reached must still be on the page); a threshold has no ratio and stays out."""
    from kvserve.tools.report import scoreboard as page

    rows = []
    for index in range(3):
        rows.append(_row("kvpress", "full", "vt", index, True))
        rows.append(_row("kvserve", "full", "vt", index, True))
        rows.append(_row("kvserve", "snapkv:kernel_size=31@0.875/inside", "vt", index, index < 2))
        rows.append(_row("kvserve", "kvzap@t-6/inside", "vt", index, True))
    kept = {row["label"] for row in page.compared(rows)}
    assert kept == {"full", "snapkv:kernel_size=31@0.875/inside"}
    text = scoreboard.board_table(page.compared(rows))
    assert "| snapkv:kernel_size=31@0.875/inside |  | 66.7 " in text, text


def test_kvserves_side_asks_a_real_server_each_way_and_the_kept_counts_are_the_settings(server, tokenizer, tmp_path):
    """kvserve's side of each setting kind against the real server, on short cases (the server's 2,048-token
    context): full, a compressed document (kvzip through the compress route), another policy's document
    (`kv_document`) and the question compressed with the context; every answer a row, the evicted count the one
    its B gives, and a rerun resumes without asking again."""
    from kvserve.tools.eval.client import Server
    from kvserve.tools.eval.haystack import haystack

    cases = []
    for index in range(2):
        context = ruler4k.RulerCase(
            "niah_single_1",
            index,
            tokenizer.decode(haystack(tokenizer, 400, seed=index))
            + " The special magic number for lake is: 4430567.\n",
            "What is the special magic number for lake mentioned in the provided text?",
            "The special magic number for lake mentioned in the provided text is",
            ("4430567",),
            8,
        )
        outside = ruler4k.pipeline_ids(tokenizer, context.context, context.question, context.answer_prefix)
        inside = ruler4k.pipeline_ids(tokenizer, context.context + context.question, "", context.answer_prefix)
        cases.append(scoreboard.BoardCase(context.key, outside, inside, context.references, 8))
    settings = [
        scoreboard.parse_setting(text)
        for text in (
            "full",
            "kvzip@0.5/outside",
            "snapkv@0.5/outside",
            "snapkv@0.5/inside",
            "default@0.5/inside",
            "kvzap@0.5/outside",
            "kvzap@t-6/inside",
        )
    ]
    out = str(tmp_path / "board.jsonl")
    client = Server(server)
    block_size = scoreboard.server_block_size(client)
    assert block_size == 32  # the test server's
    scoreboard.run_kvserve(client, "unused", cases, settings, out, block_size)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == len(settings) * len(cases)
    for row in rows:
        setting = scoreboard.parse_setting(row["label"])
        case = next(c for c in cases if list(c.key) == row["key"])
        compressed = len(case.form(setting.question)[0])
        if setting.policy == "full":
            assert row["kv_tokens_evicted"] == 0 and row["budget"] is None
            continue
        assert row["budget"] == scoreboard.budget_of(setting, case, block_size)
        if setting.threshold is not None:  # the threshold decides each list's count; the budget caps nothing
            assert row["budget"] == compressed and 0 < row["kv_tokens_evicted"] < compressed, row
            continue
        evicted = compressed - row["budget"]
        if setting.question == "inside":  # the whole prompt compacted where it ends
            evicted = compressed + len(case.inside[1]) - row["budget"]
        assert row["kv_tokens_evicted"] == evicted, row["label"]
    scoreboard.run_kvserve(client, "unused", cases, settings, out, block_size)  # resumes: nothing asked again
    assert len(open(out).read().splitlines()) == len(rows)


def test_kvzaps_threshold_is_placed_against_its_fixed_budgets_on_the_same_cases():
    """A threshold scoring what B = 50% of the prompt scores, while keeping 40% of it: 0.80 of that budget. The
    tail after the compressed prompt (2 tokens here) is read off a fixed budget's row of the same case."""
    from kvserve.tools.report.kvzap import share_scoring, threshold_table

    assert share_scoring([(0.25, 0.2), (0.5, 0.6), (1.0, 1.0)], 0.4) == pytest.approx(0.375)
    assert share_scoring([(0.25, 0.2), (0.5, 0.6)], 0.9) is None
    rows = []
    for index in range(4):
        for label, right, evicted, budget in (
            ("full", True, 0, None),
            ("kvzap@0.5/inside", index < 2, 502, 500),
            ("kvzap@0.75/inside", index < 1, 752, 250),
            ("kvzap@t-5/inside", index < 2, 602, 1000),
        ):
            row = _row("kvserve", label, "niah_single_1", index, right)
            rows.append({**row, "context_tokens": 1000, "budget": budget, "kv_tokens_evicted": evicted})
    text = threshold_table(rows)
    assert "| kv_threshold -5 | 400 | 40% | 50.0 " in text and "| 50% | 0.80 |" in text
