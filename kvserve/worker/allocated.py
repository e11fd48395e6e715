"""A compaction under `kv_allocation` / `kv_span` (the rules: `kvserve/policies/allocation.py`): how many entries each
head of a layer keeps, then which.

- At a prompt compaction (the prompt's last chunk, or any chunk with `kv_evict_every_chunk`) the allocation decides
  each (layer, head)'s count, its share; `global` waits for the worker's last layer of the step and ranks all of them
  together (under pipeline parallelism: the stage's layers, so each stage still keeps its layers x H x B).
- At a decode compaction (once a block of new tokens arrived) each (layer, head) returns to its share: the shares stay
  those of the prompt, and only which entries fill them changes.
- A score-based policy keeps each head's best `count` entries by its scores (summed over spans with `kv_span`); a
  rule-based one (StreamingLLM, MAT, EMS) only takes `pyramid`, which gives all heads of a layer one budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.policies import LayerObservation, ScoredPolicy, Selection
from kvserve.policies.allocation import (
    head_floor,
    normalised,
    pyramid_budgets,
    ranked,
    shares,
    span_scores,
    top_counts,
    whole_pages,
)
from kvserve.worker.layouts import CachePages
from kvserve.worker.request import LayerState
from kvserve.worker.step import RowPlan


@dataclass
class Deferred:
    """A layer of a `global` prompt compaction, scored, waiting for the step's last layer."""

    layer_idx: int
    layer: LayerState
    obs: LayerObservation
    cache: CachePages
    table: torch.Tensor
    keys: torch.Tensor  # [H, n] ranking keys: normalised scores, protected first, padding last
    limits: torch.Tensor  # [H] entries each head holds
    counts: torch.Tensor | None = None  # [H] the policy's own counts, to round to whole pages (None: `global`)


def select(
    plan: RowPlan, layer: LayerState, layer_idx: int, obs: LayerObservation, cache: CachePages, table: torch.Tensor
) -> Selection | None:
    """The layer's selection, or None when it waits for the rest of a `global` compaction (`plan.deferred`)."""
    config, policy, budget = plan.state.config, plan.state.policy, plan.compaction.keep_tokens
    limits = (
        obs.lengths
        if obs.lengths is not None
        else torch.full((obs.num_heads,), obs.num_tokens, device=obs.positions.device)
    )
    counts = None
    if policy.decides_counts():  # per head by the policy (DuoAttention's roles, KVzap's threshold), prompt and decode
        counts = policy.head_counts(obs, budget)  # each already capped at what its head holds
    elif plan.compaction.decode and layer.share is not None:
        counts = torch.minimum(layer.share, limits)
    elif config.allocation == "pyramid":
        minimum = policy.protected_tokens() + 1  # every layer's budget must exceed what the policy protects
        layer_budget = pyramid_budgets(budget, plan.state.pages.layout.total_layers, minimum)[obs.layer_idx]
        counts = limits.clamp(max=layer_budget)
    elif config.allocation == "uniform":
        counts = limits.clamp(max=budget)
    if not isinstance(policy, ScoredPolicy):  # pyramid over a rule-based policy: one budget for the layer's heads
        layer.share = counts
        return policy.select(obs, int(counts.max()))
    padding = obs.padding()
    protected = policy.protected_mask(obs) if padding is None else policy.protected_mask(obs) & ~padding
    scores = span_scores(policy.score(obs), obs.positions, config.span)
    if counts is None and config.allocation == "global":
        comparable = scores if policy.comparable_scores else normalised(scores, protected, padding)
        keys = ranked(comparable, protected, padding)
        plan.deferred.append(Deferred(layer_idx, layer, obs, cache, table, keys, limits))
        return None
    keys = ranked(scores, protected, padding)
    if policy.decides_counts() and config.compresses_document:  # rounded to whole pages with the other layers
        plan.deferred.append(Deferred(layer_idx, layer, obs, cache, table, keys, limits, counts))
        return None
    if counts is None:  # heads: the layer's H*B over its heads by score, above the floor
        (counts,) = shares([keys], obs.num_heads * budget, head_floor(budget, policy.protected_tokens()), [limits])
    layer.share = counts
    return Selection(top_counts(keys, counts), keep_counts=counts)


def planned_counts(plan: RowPlan, layer_idx: int) -> np.ndarray:
    """[H] entries each of the layer's lists keeps at this step's compaction, known before it is scored: the budget
    (`uniform`) or the layer's PyramidKV budget (`pyramid`), or all a shorter list holds. Only these allocations share
    the prefix cache (`kvserve/vllm/kv_cache_manager.py`), so only they need it."""
    config, budget = plan.state.config, plan.compaction.keep_tokens
    if config.allocation == "pyramid":
        minimum = plan.state.policy.protected_tokens() + 1
        layout = plan.state.pages.layout
        budget = pyramid_budgets(budget, layout.total_layers, minimum)[layer_idx + layout.first_layer]
    elif config.allocation != "uniform":
        raise RuntimeError(f"kv_allocation={config.allocation} decides its counts while it compacts")
    return np.minimum(plan.state.pages.lens[layer_idx], budget)


def finish_deferred(plan: RowPlan) -> list[tuple[Deferred, Selection]]:
    """The step's deferred layers with their selections: L*H*B entries over all of them, ranked together (`global`;
    every layout's operations address the whole page view, so each deferred layer is still compacted where it lies),
    or a document's own counts rounded to whole pages together (`whole_page_counts`)."""
    deferred, plan.deferred = plan.deferred, []
    counts = whole_page_counts(plan, deferred) if deferred[0].counts is not None else global_counts(plan, deferred)
    selections = []
    for item, layer_counts in zip(deferred, counts, strict=True):
        item.layer.share = layer_counts
        selections.append((item, Selection(top_counts(item.keys, layer_counts), keep_counts=layer_counts)))
    return selections


def global_counts(plan: RowPlan, deferred: list[Deferred]) -> list[torch.Tensor]:
    """`global`: each deferred layer's [H] counts of L*H*B entries ranked together, in whole pages for a document."""
    budget, policy = plan.compaction.keep_tokens, plan.state.policy
    # comparable scores need no safeguard (KVzip ranks every entry together, keeping only its sinks regardless)
    floor = policy.protected_tokens() if policy.comparable_scores else head_floor(budget, policy.protected_tokens())
    total = sum(item.obs.num_heads for item in deferred) * budget
    limits = [item.limits for item in deferred]
    block_size = plan.state.pages.layout.block_size
    whole = plan.state.config.compresses_document  # it is published as whole blocks: whole pages per list
    if whole:  # a list holds at least one page, so it keeps that page's worth of its best entries
        floor = -(-max(floor, 1) // block_size) * block_size
    counts = shares([item.keys for item in deferred], total, floor, limits)
    if whole:
        counts = whole_pages(counts, total // block_size, block_size, floor // block_size, limits)
    return counts


def whole_page_counts(plan: RowPlan, deferred: list[Deferred]) -> list[torch.Tensor]:
    """A compressed document under a policy's own counts (DuoAttention's roles): the step's lists together keep
    L*H*B entries as whole pages, each list as near its count as pages allow and never below the pages that hold what
    the policy protects (a streaming head's sinks and newest entries, rounded up to pages), so that the document is
    published as whole blocks. A budget the counts leave unused (a retrieval head capped at what it holds) goes to the
    lists nearest a further page."""
    budget, block_size = plan.compaction.keep_tokens, plan.state.pages.layout.block_size
    total = sum(item.obs.num_heads for item in deferred) * budget
    floor_pages = -(-max(plan.state.policy.protected_tokens(), 1) // block_size)
    limits = [item.limits for item in deferred]
    return whole_pages([item.counts for item in deferred], total // block_size, block_size, floor_pages, limits)
