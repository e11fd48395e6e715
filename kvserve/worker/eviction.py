"""The eviction step of one layer, run by the attention backend right after the layer's attention: record window
queries, measure the statistics the policy asks for, and, when the scheduler planned a compaction, let the policy
choose each head's entries and move them to the front of the head's page list. Pages past a head's new count go back
to the request (`HeadPages.shrink`); whole blocks go back to vLLM at the end of the step
(`WorkerRequests.end_step`).

A layer's lists are read as pseudo rows: row h of `table` [H, W] is head h's page list in the page view, and every
read, statistic and rewrite goes through the cache's layout (`kvserve/worker/layouts/`), which runs on many rows at
once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvserve import phases
from kvserve.metrics import metrics
from kvserve.policies import LayerObservation, Policy, Selection
from kvserve.policies.base import PassStatistics, written_newest
from kvserve.worker import allocated
from kvserve.worker.decoding import measure_decode_rows, pseudo_queries, record_decode_windows
from kvserve.worker.drafts import settle_drafts
from kvserve.worker.gated import gated_layer_step
from kvserve.worker.layouts import CachePages
from kvserve.worker.pages import cdiv
from kvserve.worker.pieces import meet_pieces
from kvserve.worker.questions import keep_question, question_window
from kvserve.worker.request import LayerState
from kvserve.worker.step import RowPlan, StepContext

logger = logging.getLogger(__name__)


def after_attention(
    step: StepContext,
    layer_idx: int,
    query: torch.Tensor,
    cache: CachePages,
    tables: Mapping[str, torch.Tensor],
    scale: float,
    output: torch.Tensor | None,
    measured: dict[str, PassStatistics] | None = None,
) -> None:
    """For each evicting request of the step: its eviction work on layer `layer_idx` (this step's entries are
    written). `tables[req_id]` ([H, W]) addresses its lists in `cache`; `measured[req_id]` holds what the backend's
    own pass measured. Gated requests get their output rows [q, Hq, D] recomputed with the per-head keep mask.
    Speculative decoding: the accepted queries of each request's last step go first (`settle_drafts`); a step's
    queries that verify drafts are held back until the next step."""

    def replay(rows: StepContext, queries: torch.Tensor) -> None:  # (its one-token rows have nothing to settle)
        after_attention(rows, layer_idx, queries, cache, rows.tables(layer_idx), scale, output=None)

    settle_drafts(step, layer_idx, replay)
    layer_start, compaction_before = time.perf_counter(), phases.seconds("compaction")
    if cache is not None and measured is None:  # every decoding request's statistics in one product
        start = time.perf_counter()
        try:
            measured = measure_decode_rows(step, layer_idx, query, cache, tables, scale)
        except Exception:  # never the engine: each request then measures alone, and only a failing one fails
            logger.exception("kvserve: batched decode statistics failed; measuring each request alone")
            measured = {}
        if measured:
            share = (time.perf_counter() - start) / len(measured)
            for plan in step.rows:
                if plan.req_id in measured:
                    plan.eviction_seconds += share
    recorded = record_decode_windows(step, layer_idx, query)
    scored = _token_scores_together(step, layer_idx, query)
    for plan in step.rows:
        if plan.failure is not None:
            continue
        if plan.drafts:  # until the next step knows which of its drafts were accepted
            plan.state.layer(layer_idx).pending = query[plan.query_start : plan.query_end].clone()
            continue
        if plan.req_id in recorded and not plan.state.policy.stat_names and plan.compaction is None:
            continue  # a decode step of a window policy (SnapKV): its query is recorded, nothing else to do
        start = time.perf_counter()
        try:
            if plan.state.gate is not None:
                gated_layer_step(
                    plan,
                    plan.state.layer(layer_idx),
                    layer_idx,
                    query[plan.query_start : plan.query_end],
                    output,
                    cache,
                    tables[plan.req_id],
                    scale,
                )
            else:
                _evict(
                    plan,
                    layer_idx,
                    query,
                    cache,
                    tables.get(plan.req_id),
                    scale,
                    (measured or {}).get(plan.req_id),
                    window_recorded=plan.req_id in recorded,
                    scored=scored.get(plan.req_id),
                )
        except Exception as error:  # a policy's bug fails its request, never the engine (the scheduler ends it)
            # the reason alone: the scheduler's log and the HTTP front end's 500 name the policy once
            plan.failure = f"{type(error).__name__}: {error}"
            logger.exception("kvserve: request %s: kv_policy %r failed", plan.req_id, plan.state.config.policy)
        plan.eviction_seconds += time.perf_counter() - start
    compacting = phases.seconds("compaction") - compaction_before  # timed inside _compact
    phases.add("statistics", time.perf_counter() - layer_start - compacting)


def relocate_protected(step: StepContext, layer_idx: int, cache: CachePages) -> None:
    """Before layer `layer_idx`'s eviction step (the backend calls this before it reads the lists): the pages a
    compaction will write that lie in protected blocks (prefix-cache blocks, blocks another request reads) are
    copied into the request's own free pages and the lists point there, so compacting in place never changes what
    vLLM's prefix cache or another request holds. A whole page is one slab, so the copy is right in every format."""
    for plan in step.rows:
        if plan.failure is not None or plan.compaction is None or not plan.compaction.protected_blocks:
            continue
        try:
            keep_pages = cdiv(allocated.planned_counts(plan, layer_idx), plan.state.pages.layout.block_size)
            cache.copy_pages(plan.state.pages.relocate(layer_idx, keep_pages))
        except Exception as error:  # fails this request only (its blocks are freed, the protected ones untouched)
            plan.failure = f"kvserve could not copy request {plan.req_id}'s pages out of shared blocks: {error}"
            logger.exception("kvserve: %s", plan.failure)


def record_times(step: StepContext) -> None:
    """After the forward: one histogram sample per request that compacted in this step."""
    for plan in step.rows:
        if plan.compaction is not None and plan.failure is None:
            metrics().compaction_seconds.labels(policy=plan.state.config.policy).observe(plan.eviction_seconds)


def _evict(
    plan: RowPlan,
    layer_idx: int,
    query: torch.Tensor,
    cache: CachePages,
    table: torch.Tensor | None,
    scale: float,
    given: PassStatistics | None,
    window_recorded: bool = False,
    scored: dict[str, torch.Tensor] | None = None,
) -> None:
    layer = plan.state.layer(layer_idx)
    policy = plan.state.policy
    queries = query[plan.query_start : plan.query_end]
    window = policy.window_size()
    if window:
        if not window_recorded:
            _record_window(layer, queries, plan, window)
        if plan.state.config.question_probe:
            keep_question(plan, layer, layer_idx, window)
    if not policy.stat_names and plan.compaction is None:
        return
    if plan.compaction is None and given is not None:  # a decode step of H2O, EMS or MAT: one operation
        folded = fold_pass_statistics(policy, layer.stats, given, int(plan.lengths(layer_idx).max()))
        if folded is not None:
            layer.stats = folded
            return
    lengths = plan.lengths(layer_idx)
    if plan.compaction is None and policy.token_statistics:  # the new entries' own scores: nothing else to read
        new = scored if scored is not None else _token_scores([plan], layer_idx, queries)[plan.req_id]
        width = int(lengths.max())
        layer.stats = {name: written_newest(layer.stats.get(name), new[name], lengths, width) for name in new}
        return
    obs = _observe(plan, layer, layer_idx, cache, lengths, scale)
    question = question_window(plan, layer_idx, obs)
    if question is not None:  # a prefill chunk's compaction, voted on by the question's queries (kv_lookahead)
        obs.window_queries, obs.window_positions = question
    own_window = plan.compaction is not None and question is None
    obs.measured = measure_pass(policy, obs, queries, cache, table, lengths, compacting=own_window, given=given)
    if plan.compaction is not None or _reads_entries(policy, obs.measured):
        obs.keys, obs.values = cache.read_lists(table, lengths)
    if policy.stat_names:
        query_positions = plan.query_positions().to(queries.device)
        layer.stats = obs.stats = policy.update_stats(obs, queries, query_positions)
        merged = meet_pieces(plan, layer, layer_idx)
        if merged is not None:  # the last piece of a document's reconstruction: every piece's scores
            layer.stats = obs.stats = merged
    if plan.compaction is not None:
        _compact(plan, layer, layer_idx, obs, cache, table)


def _token_scores_together(step: StepContext, layer_idx: int, query: torch.Tensor) -> dict[str, dict]:
    """The new entries' own scores (`token_statistics`) of every decoding request of the step that only scores
    them, one call per group of requests with the same policy and model: per request and layer, the fixed cost of
    a call made most of KVzap's decode overhead."""
    groups: dict[tuple, list[RowPlan]] = {}
    for plan in step.rows:
        state = plan.state
        if plan.failure is None and not plan.drafts and plan.compaction is None and state.gate is None \
                and state.policy.token_statistics:  # fmt: skip
            layout = state.pages.layout
            key = (state.policy, state.model, id(state.rotary.get(layer_idx)), layout.first_layer, layout.first_head)
            groups.setdefault(key, []).append(plan)
    scored: dict[str, dict] = {}
    for plans in groups.values():
        if len(plans) > 1:
            queries = torch.cat([query[plan.query_start : plan.query_end] for plan in plans])
            try:
                scored.update(_token_scores(plans, layer_idx, queries))
            except Exception:  # never the engine: each request then scores alone, and only a failing one fails
                logger.exception("kvserve: scoring the step's new entries together failed; scoring each alone")
    return scored


def _token_scores(plans: list[RowPlan], layer_idx: int, queries: torch.Tensor) -> dict[str, dict]:
    """Per request of `plans` (one policy, model and layout), its new entries' scores {name: [H, q]} from `queries`,
    the requests' step queries in order."""
    first = plans[0].state
    layout = first.pages.layout
    positions = torch.cat([plan.query_positions() for plan in plans]).to(queries.device)
    new = first.policy.token_scores(
        layer_idx + layout.first_layer, queries, positions, first.rotary.get(layer_idx), first.model,
        slice(layout.first_head, layout.first_head + layout.num_heads),
    )  # fmt: skip
    scored, start = {}, 0
    for plan in plans:
        end = start + plan.query_end - plan.query_start
        scored[plan.req_id] = {name: scores[:, start:end] for name, scores in new.items()}
        start = end
    return scored


def _record_window(layer: LayerState, queries: torch.Tensor, plan: RowPlan, window: int) -> None:
    layer.query_window(window).record(queries, plan.logical_len - queries.shape[0])


def _observe(
    plan: RowPlan, layer: LayerState, layer_idx: int, cache: CachePages, lengths: torch.Tensor, scale: float
) -> LayerObservation:
    """The layer's observation without its entries: keys and values are shape-only (meta) tensors until the caller
    reads them from the cache. A step that only accumulates measured statistics never copies the cache, and a policy
    that touched them without asking would fail loudly instead of scoring garbage."""
    n = int(lengths.max())
    num_heads = lengths.shape[0]
    keys = values = torch.empty(num_heads, n, cache.head_size, device="meta")
    stats = {}
    for name in plan.state.policy.stat_names:  # entries appended since the last step start at zero
        old = layer.stats.get(name)
        stats[name] = (
            torch.zeros(num_heads, n, device=cache.device) if old is None else F.pad(old, (0, n - old.shape[1]))
        )
    ragged = bool((lengths != n).any())
    device = cache.device  # the observation lives with the cache; page bookkeeping stays on the host
    window_positions = layer.window_positions
    return LayerObservation(
        layer_idx=layer_idx + plan.state.pages.layout.first_layer,
        keys=keys,
        values=values,
        positions=layer.positions(lengths, plan.state.since).to(device),
        scale=scale,
        window_queries=layer.window_queries,
        window_positions=None if window_positions is None else window_positions.to(device),
        stats=stats,
        budget=plan.compaction.keep_tokens if plan.compaction else 0,
        lengths=lengths.to(device).long() if ragged else None,
        rotary=plan.state.rotary.get(layer_idx),
        model=plan.state.model,
        first_head=plan.state.pages.layout.first_head,
        model_heads=plan.state.pages.layout.model_heads,
    )


def _compact(
    plan: RowPlan, layer: LayerState, layer_idx: int, obs: LayerObservation, cache: CachePages, table: torch.Tensor
) -> None:
    with phases.timed("compaction"):
        config = plan.state.config
        # a document's own counts (DuoAttention's) are rounded to whole pages with the step's other layers
        whole_counts = config.compresses_document and config.own_counts
        if config.allocation == "uniform" and config.span == 1 and not whole_counts:
            _move(plan, layer, layer_idx, obs, cache, table, plan.state.policy.select(obs, plan.compaction.keep_tokens))
            return
        selection = allocated.select(plan, layer, layer_idx, obs, cache, table)
        if selection is not None:
            _move(plan, layer, layer_idx, obs, cache, table, selection)
        if plan.deferred and layer_idx == plan.state.pages.layout.num_layers - 1:  # every layer is scored
            for item, chosen in allocated.finish_deferred(plan):
                _move(plan, item.layer, item.layer_idx, item.obs, item.cache, item.table, chosen)


def _move(
    plan: RowPlan,
    layer: LayerState,
    layer_idx: int,
    obs: LayerObservation,
    cache: CachePages,
    table: torch.Tensor,
    selection: Selection,
) -> None:
    """Move each head's kept entries (and their statistics) to the front of its list and give back the rest."""
    keep = selection.keep_indices
    width = keep.shape[1]
    counts = selection.keep_counts
    if counts is None:
        counts = torch.full((keep.shape[0],), width, dtype=torch.long, device=keep.device)
    if selection.keys is None:  # the statistics move with their entries, in the same operation
        stats = {name: stat.float().contiguous() for name, stat in obs.stats.items()}
        cache.compact(table, keep, counts, stats=list(stats.values()), entries=(obs.keys, obs.values))
        layer.stats = {name: stat[:, :width].clone() for name, stat in stats.items()}
    else:  # a merging policy rewrote the kept entries and their statistics
        cache.write_lists(table, selection.keys, selection.values)
        layer.stats = selection.stats or {name: stat.gather(1, keep) for name, stat in obs.stats.items()}
    model_layer = str(plan.state.pages.layout.model_layer(layer_idx))
    metrics().kept_entries.labels(layer=model_layer, allocation=plan.state.config.allocation).inc(int(counts.sum()))
    kept_here = torch.arange(width, device=counts.device)[None, :] < counts[:, None]
    # what was kept, on the host with the page lists (a no-op on CPU)
    layer.kept_positions = obs.positions.gather(1, keep).masked_fill(~kept_here, -1).cpu()
    counts = counts.long().cpu()
    layer.kept_counts = None if bool((counts == width).all()) else counts
    plan.state.pages.shrink(layer_idx, counts.numpy())


def fold_pass_statistics(
    policy: Policy, stats: dict[str, torch.Tensor], given: PassStatistics, width: int
) -> dict[str, torch.Tensor] | None:
    """`update_stats` without an observation (`Policy.fold_step`), for a policy whose statistics are all ones the
    attention pass's numbers update directly (`running_sum`, `first_logit_mean`), its earlier statistics padded to
    the lists' longest length `width`. None when the policy's statistics need the observation."""
    folded = {policy.running_sum: given.column_sums, policy.first_logit_mean: given.first_logits}
    if not policy.stat_names or any(folded.get(name) is None or name not in stats for name in policy.stat_names):
        return None
    padded = {name: F.pad(stats[name], (0, width - stats[name].shape[1])) for name in policy.stat_names}
    num_heads = stats[policy.stat_names[0]].shape[0]
    return policy.fold_step(padded, given.column_sums, given.first_logits, num_heads)


def _reads_entries(policy: Policy, measured: PassStatistics) -> bool:
    """Outside a compaction, the entries are needed only by a statistic the pass did not measure (or by a policy that
    keeps statistics without declaring them as pass statistics)."""
    if policy.stat_names and not policy.pass_statistics:
        return not policy.token_statistics
    return any(getattr(measured, name) is None for name in policy.pass_statistics if name != "window_sums")


def measure_pass(
    policy: Policy,
    obs: LayerObservation,
    queries: torch.Tensor,
    cache: CachePages,
    table: torch.Tensor,
    lengths: torch.Tensor,
    compacting: bool,
    given: PassStatistics | None = None,
) -> PassStatistics:
    """The statistics of this step's queries [q, Hq, D] that `policy.pass_statistics` names, measured on the layer's
    lists as pseudo rows (one per KV head, `table` [H, W]) by the cache's layout (`kvserve/worker/layouts/`: page
    by page on CPU, the fused Triton kernels on CUDA).

    Window sums are measured only at a compaction whose window lies inside this step (a prefill chunk of at least
    `window` queries, or a one-query window in decode without a logit scale); an older window is not in this pass,
    and the policy computes it from the stored window queries. Prefill first-logits are left to the policy (one
    [q, Hq] product; the prefill kernel does not produce them). What `given` holds (the backend's own pass, or
    `measure_decode_rows` for the whole batch, measured it) is not measured again.
    """
    given = given or PassStatistics()
    wanted = [name for name in policy.pass_statistics if getattr(given, name) is None]
    measured = replace(given)
    num_queries, num_heads = queries.shape[0], obs.num_heads
    window = policy.window_size() if compacting and "window_sums" in wanted else 0
    gain = policy.window_logit_scale(obs) if 0 < window <= num_queries else None
    if not wanted:
        return measured
    rows = pseudo_queries(queries, num_heads).view(num_heads, num_queries, -1, queries.shape[-1])
    if num_queries == 1:  # decode: one product gives the column sums (= a one-query window's sums) and the logits
        window_here = window == 1 and gain is None
        if window_here and measured.column_sums is not None:
            measured.window_sums = measured.column_sums
            return measured
        want_first = "first_logits" in wanted
        if "column_sums" not in wanted and not window_here:
            if want_first:  # entry 0's key alone, not the whole list
                measured.first_logits = cache.first_logits(rows[:, 0], table, obs.scale).reshape(1, -1)
            return measured
        sums, first = cache.query_sums(rows, table, lengths, obs.scale, first_logits=want_first)
        if "column_sums" in wanted:
            measured.column_sums = sums
        if window_here:
            measured.window_sums = sums
        if first is not None:
            measured.first_logits = first.reshape(1, -1)
        return measured
    if "column_sums" in wanted:
        measured.column_sums, _ = cache.query_sums(rows, table, lengths, obs.scale)
    if 0 < window <= num_queries:  # the gain applies to the window rows
        measured.window_sums, _ = cache.query_sums(rows[:, -window:], table, lengths, obs.scale, logit_scale=gain)
    return measured
