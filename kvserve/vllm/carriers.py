"""kvserve's step messages (`kvserve/messages.py`) on vLLM's own step objects: the engine core's `StepPlan` on the
`SchedulerOutput` that reaches every worker, the workers' `StepReport` on the `ModelRunnerOutput` that comes back.
One attribute each (both are plain dataclasses, pickled with their attributes between processes)."""

from __future__ import annotations

import copy

from kvserve.messages import StepPlan, StepReport

PLAN_ATTR = "kvserve_plan"  # on vLLM's SchedulerOutput
REPORT_ATTR = "kvserve_report"  # on vLLM's ModelRunnerOutput

_NO_PLAN = StepPlan()
_NO_REPORT = StepReport()


def attach_plan(scheduler_output, plan: StepPlan) -> None:
    setattr(scheduler_output, PLAN_ATTR, plan)


def plan_of(scheduler_output) -> StepPlan:
    """The step's plan (an empty one for a step the engine core did not plan, such as a dummy run)."""
    return getattr(scheduler_output, PLAN_ATTR, None) or _NO_PLAN


def with_report(model_runner_output, report: StepReport):
    """The step's output with the workers' report on it: a copy, so that no shared constant (vLLM's
    `EMPTY_MODEL_RUNNER_OUTPUT`) is ever marked."""
    if model_runner_output is None or (not report.failures and not report.pages):
        return model_runner_output
    marked = copy.copy(model_runner_output)
    setattr(marked, REPORT_ATTR, report)
    return marked


def report_of(model_runner_output) -> StepReport:
    return getattr(model_runner_output, REPORT_ATTR, None) or _NO_REPORT
