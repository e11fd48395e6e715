"""`kvserve eval parity` (kvserve/tools/eval/parity.py): both sides must get the same tokens, in the form kvpress's
pipeline builds them, and its table must be each side's mean and interval. The runs themselves are opt-in (they need
kvpress's environment and minutes per case); their tables are on the benchmarks page."""

from __future__ import annotations

import pytest

from kvserve.tools.eval.parity import (
    ParityCase,
    parity_cases,
    parity_table,
    pipeline_form,
    question_inside,
    settings_of,
)
from kvserve.tools.eval.suite import wilson
from kvserve.tools.eval.tasks import make_case, score, split_question


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.mark.parametrize("task", ["passkey", "multikey_one"])
def test_the_context_and_question_are_the_chat_kvpress_renders(tokenizer, task):
    case = make_case(tokenizer, task, 1000, 0)
    context, question = pipeline_form(tokenizer, case.prompt)
    document, asked = split_question(case.prompt)
    asked, _, answer_start = asked.rpartition("?")
    # kvpress's pipeline: the document and the question in one user message, the reply started, then the answer's
    # first words; the context is exactly what precedes the question
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": document + asked + "?"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(context + question) == chat + answer_start.strip()
    assert tokenizer.decode(context).endswith(document)
    assert len(context) > 900 and len(question) < 60


def test_question_inside_compresses_all_but_the_last_token(tokenizer):
    (case,) = parity_cases(tokenizer, ["passkey"], [1000], 1, 0)
    inside = question_inside(case)
    assert inside.context_ids + inside.question_ids == case.context_ids + case.question_ids
    assert len(inside.question_ids) == 1


def test_the_table_is_each_sides_mean_with_its_interval():
    case = ParityCase(["passkey", 1000, 0, 0], [1], [2], ("12345",), 8)
    answers = {"kvpress": [" 12345.", " 12345", " 99"], "kvserve": [" 12345", " 1", " 2"]}
    rows = [
        {"side": side, "label": "kvzip@256", "key": case.key, "answer": answer, "references": ["12345"]}
        for side, side_answers in answers.items()
        for answer in side_answers
    ]
    text = parity_table(rows)
    for side_answers in answers.values():
        mean = sum(score(answer, ["12345"]) for answer in side_answers) / len(side_answers)
        low, high = wilson(mean, len(side_answers))
        assert f"{mean:.2f} [{low:.2f}, {high:.2f}] (n=3)" in text
    assert "| kvzip@256 | outside |" in text and "-0.33" in text


def test_a_policy_without_a_reference_is_refused():
    with pytest.raises(SystemExit, match="no kvpress reference for 'h2o'"):
        settings_of(["h2o"], [256])


def test_duoattention_keeps_b_on_average_with_the_same_heads_on_both_sides():
    """DuoAttention's plain form at B: as many retrieval heads R (keeping the whole context n) as make
    R x n + (L x H - R) x (sinks + recent) closest to L x H x B; kvpress's press gets kvserve's head order as its
    scores, so its lowest-scored heads, streamed, are exactly the heads kvserve's retrieval fraction leaves out."""
    import numpy as np
    import torch

    from kvserve.duo.roles import HeadRoles
    from kvserve.tools.eval.parity import duo_reference, duo_retrieval_heads

    gates = torch.tensor([[0.9, 1.0, 0.2], [1.0, 0.0, 0.5], [0.0, 1.0, 0.7], [0.3, 0.0, 1.0]])  # ties on purpose
    roles = HeadRoles("m", gates, sink_tokens=16, recent=64)
    heads, streaming = gates.numel(), 80
    for budget, context in ((256, 1000), (256, 4000), (512, 2000), (200, 210)):
        retrieval = duo_retrieval_heads(roles, budget, context)
        kept = [r * context + (heads - r) * streaming for r in range(1, heads + 1)]
        closest = min(range(heads), key=lambda r: abs(kept[r] - heads * budget))
        assert retrieval == closest + 1
        cases = [ParityCase(["passkey", context, 0, 0], [0] * context, [1], ("1",), 4)]
        spec = duo_reference(roles, budget, cases)
        assert spec["retrieval_heads"] == {'["passkey", ' + f"{context}, 0, 0]": retrieval}
        scores = np.array(spec["roles"]["gates"], dtype=float)
        streamed = np.zeros(heads, dtype=bool)
        streamed[np.argsort(scores, axis=None)[: heads - retrieval]] = True  # kvpress's choice
        assert (~streamed.reshape(gates.shape) == roles.retrieval(retrieval / heads).numpy()).all()


def test_terminating_an_evaluation_stops_kvpress_s_process(tmp_path):
    """SIGTERM to `kvserve eval parity/scoreboard` ends the kvpress process it started too (`terminated_as_exit`),
    which would otherwise go on appending rows to the result file."""
    import os
    import signal
    import subprocess
    import sys

    from waiting import wait_until

    child_pid = tmp_path / "child.pid"
    stand_in = tmp_path / "kvpress-python"  # stands in for kvpress's interpreter: records its pid, then runs on
    stand_in.write_text(f"#!/bin/sh\necho $$ > {child_pid}\nexec sleep 600\n")
    stand_in.chmod(0o755)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvserve.tools.eval.parity import run_kvpress_side as run; "
         "run(sys.argv[1], 'model', [], [], sys.argv[2])", str(stand_in), str(tmp_path / "rows.jsonl")]
    )  # fmt: skip
    pid = int(wait_until(lambda: child_pid.exists() and child_pid.read_text().strip(), 120, "kvpress's stand-in"))
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=120) == 128 + signal.SIGTERM

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # killed but not yet reaped by anyone would still answer: a zombie counts as gone
        return open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")

    wait_until(gone, 60, f"kvpress's process {pid} still running after its evaluation was terminated")
