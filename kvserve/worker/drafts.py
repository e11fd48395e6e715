"""Speculative decoding on the worker: a step that verifies draft tokens holds its queries back (`LayerState.pending`,
set by the eviction step), since which drafts are accepted is known only after sampling; the next step, once vLLM has
rolled its computed count back past the rejected ones (their entries already gone: `HeadPages.truncate`), settles
the accepted ones here before its own work. Together with the engine core's rule that a step with drafts never
compacts (`kvserve.core.compaction.drafts_allowed`), every compaction then reads what it would have read without
speculation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvserve.worker.step import RowPlan, StepContext


def settle_drafts(step: StepContext, layer_idx: int, replay: Callable[[StepContext, torch.Tensor], None]) -> None:
    """The queries of the tokens each request's last step accepted, each doing now, in order, what a one-token step
    of its own would have done: recorded in the policy's window, its statistics measured over the lists as they were
    then (the entries up to its own) and folded. `replay(rows, queries)` runs the layer's eviction step on such
    one-token rows. The rejected drafts' queries are dropped, so statistics count accepted tokens only."""
    # the same for every layer of the step: found once (most steps have none)
    settling = step.memo("settling", lambda: [plan for plan in step.rows if plan.settle is not None])
    plans = {plan.req_id: plan for plan in settling if plan.failure is None}
    for req_id, plan in list(plans.items()):
        if not plan.state.policy.stat_names:  # a window alone: one ring write (a gated request gets no drafts)
            _settle_window(plan, layer_idx)
            del plans[req_id]
    if not plans:
        return
    for index in range(max(plan.settle[1] for plan in plans.values())):
        rows, queries = [], []
        for plan in plans.values():
            first, accepted = plan.settle
            pending = plan.state.layer(layer_idx).pending
            if index >= accepted or pending is None or plan.failure is not None:
                continue
            rows.append(_one_token_row(plan, len(rows), first + index + 1))
            queries.append(pending[index : index + 1])
        if not rows:
            break
        replay(StepContext(pages=step.pages, rows=rows), torch.cat(queries))
        for row in rows:
            plan = plans[row.req_id]
            plan.eviction_seconds += row.eviction_seconds
            plan.failure = plan.failure or row.failure
    for plan in plans.values():
        plan.state.layer(layer_idx).pending = None


def _one_token_row(plan: RowPlan, query: int, end: int) -> RowPlan:
    """`plan`'s request as a one-token step ending at `end` tokens would have seen it: its query is row `query` of
    the replayed queries, and the entries written after its own are left out of its lists' lengths."""
    return replace(
        plan,
        query_start=query,
        query_end=query + 1,
        logical_len=end,
        compaction=None,
        drafts=0,
        settle=None,
        later=plan.logical_len - end,
        deferred=[],
        eviction_seconds=0.0,
    )


def _settle_window(plan: RowPlan, layer_idx: int) -> None:
    """`settle_drafts` for a policy without statistics: its accepted queries go into its window in order, as the
    one-token steps would have recorded them one by one."""
    layer = plan.state.layer(layer_idx)
    window = plan.state.policy.window_size()
    first, accepted = plan.settle
    if window and layer.pending is not None:
        layer.query_window(window).record(layer.pending[:accepted], first)
    layer.pending = None
