"""Worker-side eviction state: per request, the offset between logical tokens and cache entries, and per layer the
statistics a policy needs between steps. Also the step context the attention backend reads during a forward.

Memory is bounded by the budget: per layer we keep the positions of the entries kept at the last compaction
([H, B]) and the last `window` queries; entries appended since then have implicit positions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.config import KVConfig
from kvserve.engine.cache_layout import compact_entries, read_entries, write_entries
from kvserve.engine.gated import gated_layer_step
from kvserve.engine.plan import Compaction
from kvserve.gates.module import GatePast
from kvserve.metrics import metrics
from kvserve.policies import LayerObservation, Policy

logger = logging.getLogger(__name__)


@dataclass
class LayerState:
    kept_positions: torch.Tensor | None = None  # [H, m] positions of cache slots 0..m-1 after the last compaction
    window_queries: torch.Tensor | None = None  # [w, num_q_heads, D]
    window_positions: torch.Tensor | None = None  # [w]
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # per-entry running statistics, [H, m] each
    last_keep: torch.Tensor | None = None  # [H, B] cache indices chosen at the last compaction (introspection)
    # ragged policies (Attention-Gate): per-head validity of the first entries (later ones are valid), the gate's past
    valid: torch.Tensor | None = None  # [H, v] bool
    gate_past: GatePast | None = None

    def positions(self, num_heads: int, num_entries: int, offset: int) -> torch.Tensor:
        """Logical positions of cache entries 0..num_entries-1 per head: [H, num_entries]."""
        kept = 0 if self.kept_positions is None else self.kept_positions.shape[1]
        appended = torch.arange(kept, num_entries) + offset
        if self.kept_positions is None:
            return appended.expand(num_heads, -1)
        return torch.cat([self.kept_positions, appended.expand(num_heads, -1)], dim=1)


@dataclass
class GateRuntime:
    """What a ragged (gated) request needs besides its policy: the model's gates and how to undo its RoPE."""

    gates: Any  # kvserve.gates.gateset.GateSet
    rope_theta: float
    prompt_len: int


@dataclass
class RequestState:
    config: KVConfig
    policy: Policy
    offset: int = 0  # logical tokens minus cache entries
    compactions: int = 0
    layers: dict[int, LayerState] = field(default_factory=dict)
    gate: GateRuntime | None = None

    def layer(self, idx: int) -> LayerState:
        return self.layers.setdefault(idx, LayerState())

    def reset(self) -> None:
        """After preemption the request recomputes from scratch into fresh blocks."""
        self.offset = 0
        self.layers.clear()


@dataclass
class RowPlan:
    """One evicting request's slice of the current batch."""

    req_id: str
    state: RequestState
    row: int
    query_start: int
    query_end: int
    cache_len: int  # entries in the cache after this step's writes (physical seq_len)
    compaction: Compaction | None
    eviction_seconds: float = 0.0  # scoring + compaction time over this step's layers
    kept_tokens: int | None = None  # a ragged compaction: the largest count kept by any layer and head
    failure: str | None = None  # the policy raised: the request fails, the rest of the batch goes on


@dataclass
class StepContext:
    rows: list[RowPlan]

    def after_attention(self, layer_idx: int, query: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, scale: float, output: torch.Tensor) -> None:
        """Called by the attention backend after a layer's attention: record window queries, compact if planned;
        for gated requests, recompute their output rows [q, Hq, D] with the per-head keep mask."""
        for plan in self.rows:
            if plan.failure is not None:
                continue
            start = time.perf_counter()
            try:
                if plan.state.gate is not None:
                    gated_layer_step(plan, plan.state.layer(layer_idx), layer_idx,
                                     query[plan.query_start : plan.query_end], _query_positions(plan), output,
                                     kv_cache, block_table[plan.row], scale)
                else:
                    self._evict(plan, layer_idx, query, kv_cache, block_table, scale)
            except Exception as error:  # a policy's bug fails its request, never the engine (the scheduler ends it)
                plan.failure = f"kv_policy {plan.state.config.policy!r} failed: {type(error).__name__}: {error}"
                logger.exception("kvserve: request %s: %s", plan.req_id, plan.failure)
            plan.eviction_seconds += time.perf_counter() - start

    def _evict(self, plan: RowPlan, layer_idx: int, query: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, scale: float) -> None:
        layer = plan.state.layer(layer_idx)
        policy = plan.state.policy
        queries = query[plan.query_start : plan.query_end]
        window = policy.window_size()
        if window:
            _record_window(layer, queries, plan, window)
        if not policy.stat_names and plan.compaction is None:
            return
        obs = _observe(plan, layer, layer_idx, kv_cache, block_table[plan.row], scale)
        if policy.stat_names:
            layer.stats = obs.stats = policy.update_stats(obs, queries, _query_positions(plan))
        if plan.compaction is not None:
            _compact(plan, layer, obs, kv_cache, block_table[plan.row])

    def failures(self) -> dict[str, str]:
        return {plan.req_id: plan.failure for plan in self.rows if plan.failure is not None}

    def record_times(self) -> None:
        """After the forward: one histogram sample per request that compacted in this step."""
        for plan in self.rows:
            if plan.compaction is not None and plan.failure is None:
                metrics().compaction_seconds.labels(policy=plan.state.config.policy).observe(plan.eviction_seconds)


def _query_positions(plan: RowPlan) -> torch.Tensor:
    first = plan.cache_len - (plan.query_end - plan.query_start) + plan.state.offset
    return torch.arange(plan.query_end - plan.query_start) + first


def _record_window(layer: LayerState, queries: torch.Tensor, plan: RowPlan, window: int) -> None:
    queries = queries[-window:].detach().clone()
    positions = _query_positions(plan)[-window:]
    if layer.window_queries is not None and queries.shape[0] < window:
        queries = torch.cat([layer.window_queries, queries])[-window:]
        positions = torch.cat([layer.window_positions, positions])[-window:]
    layer.window_queries, layer.window_positions = queries, positions


def _observe(plan: RowPlan, layer: LayerState, layer_idx: int, kv_cache: torch.Tensor, block_ids: torch.Tensor,
             scale: float) -> LayerObservation:
    n = plan.cache_len
    keys, values = read_entries(kv_cache, block_ids, n)
    stats = {}
    for name in plan.state.policy.stat_names:  # entries appended since the last step start at zero
        old = layer.stats.get(name)
        stats[name] = torch.zeros(keys.shape[0], n) if old is None else F.pad(old, (0, n - old.shape[1]))
    return LayerObservation(layer_idx=layer_idx, keys=keys, values=values,
                            positions=layer.positions(keys.shape[0], n, plan.state.offset), scale=scale,
                            window_queries=layer.window_queries, window_positions=layer.window_positions,
                            stats=stats, budget=plan.compaction.keep_tokens if plan.compaction else 0)


def _compact(plan: RowPlan, layer: LayerState, obs: LayerObservation, kv_cache: torch.Tensor,
             block_ids: torch.Tensor) -> None:
    selection = plan.state.policy.select(obs, plan.compaction.keep_tokens)
    keep = selection.keep_indices
    if selection.keys is None:
        compact_entries(kv_cache, block_ids, obs.keys, obs.values, keep)
    else:  # a merging policy rewrote the kept entries
        write_entries(kv_cache, block_ids, selection.keys, selection.values)
    layer.kept_positions = obs.positions.gather(1, keep)
    layer.stats = selection.stats or {name: stat.gather(1, keep) for name, stat in obs.stats.items()}
    layer.last_keep = keep


_current: StepContext | None = None


def set_step(context: StepContext | None) -> None:
    global _current
    _current = context


def current_step() -> StepContext | None:
    return _current
