"""A step's decoding requests handled together, one operation per layer instead of one per request: their queries
recorded in their policies' windows (`record_decode_windows`) and their statistics measured in one product over all
their lists (`measure_decode_rows`). Work per request and layer is what a second tensor-parallel rank does not
divide; the per-request eviction step (`kvserve/worker/eviction.py`) is left with prefill chunks and compactions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kvserve.policies.base import PassStatistics
from kvserve.worker.layouts import CachePages
from kvserve.worker.step import StepContext

logger = logging.getLogger(__name__)


def pseudo_queries(queries: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[q, H*G, D] -> [H*q, G, D]: one pseudo row of q queries per KV head, in head order."""
    count, num_q_heads, dim = queries.shape
    return (
        queries.view(count, num_heads, num_q_heads // num_heads, dim)
        .transpose(0, 1)
        .reshape(num_heads * count, num_q_heads // num_heads, dim)
    )


def record_decode_windows(step: StepContext, layer_idx: int, query: torch.Tensor) -> set[str]:
    """The decode query of every request of the step whose policy keeps a window, recorded in one copy (a copy per
    request and layer was per-layer work that a second tensor-parallel rank does not divide). Returns their ids;
    prefill chunks, gated requests and question probes record theirs in the per-request eviction step. A request
    whose recording raises fails with the reason (never the engine)."""
    candidates = step.memo(  # the same for every layer of the step: found once
        "decode_windows",
        lambda: [
            plan
            for plan in step.rows
            if plan.query_end - plan.query_start == 1
            and plan.state.gate is None
            and not plan.state.config.question_probe
            and plan.state.policy.window_size()
        ],
    )
    plans = [plan for plan in candidates if plan.failure is None]
    if not plans:
        return set()
    start = time.perf_counter()
    rows, recorded = [], []
    for plan in plans:
        try:
            window = plan.state.layer(layer_idx).query_window(plan.state.policy.window_size())
            rows.append(window.next_row(query, plan.logical_len - 1))
        except Exception as error:  # this request fails, as when its policy raises
            plan.failure = f"{type(error).__name__}: {error}"
            logger.exception("kvserve: request %s: recording its query window failed", plan.req_id)
            continue
        recorded.append(plan)
    try:
        torch._foreach_copy_(rows, [query[plan.query_start] for plan in recorded])
    except Exception as error:
        for plan in recorded:
            plan.failure = f"{type(error).__name__}: {error}"
        logger.exception("kvserve: recording the step's decode queries failed")
        return set()
    share = (time.perf_counter() - start) / len(plans)
    for plan in plans:
        plan.eviction_seconds += share
    return {plan.req_id for plan in recorded}


def measure_decode_rows(
    step: StepContext,
    layer_idx: int,
    query: torch.Tensor,
    cache: CachePages,
    tables: Mapping[str, torch.Tensor],
    scale: float,
) -> dict[str, PassStatistics]:
    """Column sums and first logits for every decoding request of the step that wants them, in one product over
    all their lists: per request, what `measure_pass` would measure, without a Python pass per request."""
    candidates = step.memo(  # the same for every layer of the step: found once
        "decode_measuring",
        lambda: [
            plan
            for plan in step.rows
            if plan.state.gate is None
            and plan.query_end - plan.query_start == 1
            and {"column_sums", "first_logits"} & set(plan.state.policy.pass_statistics)
        ],
    )
    plans = [plan for plan in candidates if plan.failure is None and plan.req_id in tables]
    if not plans:
        return {}
    num_heads = tables[plans[0].req_id].shape[0]
    width = max(tables[plan.req_id].shape[1] for plan in plans)
    all_tables = torch.cat(
        [F.pad(tables[plan.req_id].long(), (0, width - tables[plan.req_id].shape[1])) for plan in plans]
    )
    lengths = [plan.lengths(layer_idx) for plan in plans]
    rows = torch.cat([pseudo_queries(query[plan.query_start : plan.query_end], num_heads) for plan in plans])
    want_first = any("first_logits" in plan.state.policy.pass_statistics for plan in plans)
    if any("column_sums" in plan.state.policy.pass_statistics for plan in plans):
        sums, first = cache.query_sums(rows[:, None], all_tables, torch.cat(lengths), scale, first_logits=want_first)
    else:  # first logits alone (MAT): entry 0's key, not the whole list
        sums, first = None, cache.first_logits(rows, all_tables, scale)
    measured = {}
    for index, (plan, plan_lengths) in enumerate(zip(plans, lengths, strict=True)):
        heads = slice(index * num_heads, (index + 1) * num_heads)
        wanted = plan.state.policy.pass_statistics
        measured[plan.req_id] = PassStatistics(
            column_sums=sums[heads, : int(plan_lengths.max())] if "column_sums" in wanted else None,
            first_logits=first[heads].reshape(1, -1) if "first_logits" in wanted else None,
        )
    return measured
