"""Worker-side eviction state: per request, the offset between logical tokens and cache entries, and per layer the
statistics a policy needs between steps. Also the step context the attention backend reads during a forward.

Memory is bounded by the budget: per layer we keep the positions of the entries kept at the last compaction
([H, B]) and the last `window` queries; entries appended since then have implicit positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.config import KVConfig
from kvserve.engine.cache_layout import compact_entries, read_entries
from kvserve.engine.plan import Compaction
from kvserve.policies import LayerObservation, Policy


@dataclass
class LayerState:
    kept_positions: torch.Tensor | None = None  # [H, m] positions of cache slots 0..m-1 after the last compaction
    window_queries: torch.Tensor | None = None  # [w, num_q_heads, D]
    window_positions: torch.Tensor | None = None  # [w]
    last_keep: torch.Tensor | None = None  # [H, B] cache indices chosen at the last compaction (introspection)

    def positions(self, num_heads: int, num_entries: int, offset: int) -> torch.Tensor:
        """Logical positions of cache entries 0..num_entries-1 per head: [H, num_entries]."""
        kept = 0 if self.kept_positions is None else self.kept_positions.shape[1]
        appended = torch.arange(kept, num_entries) + offset
        if self.kept_positions is None:
            return appended.expand(num_heads, -1)
        return torch.cat([self.kept_positions, appended.expand(num_heads, -1)], dim=1)


@dataclass
class RequestState:
    config: KVConfig
    policy: Policy
    offset: int = 0  # logical tokens minus cache entries
    compactions: int = 0
    layers: dict[int, LayerState] = field(default_factory=dict)

    def layer(self, idx: int) -> LayerState:
        return self.layers.setdefault(idx, LayerState())

    def reset(self) -> None:
        """After preemption the request recomputes from scratch into fresh blocks."""
        self.offset = 0
        self.layers.clear()


@dataclass
class RowPlan:
    """One evicting request's slice of the current batch."""

    state: RequestState
    row: int
    query_start: int
    query_end: int
    cache_len: int  # entries in the cache after this step's writes (physical seq_len)
    compaction: Compaction | None


@dataclass
class StepContext:
    rows: list[RowPlan]

    def after_attention(self, layer_idx: int, query: torch.Tensor, kv_cache: torch.Tensor,
                        block_table: torch.Tensor, scale: float) -> None:
        """Called by the attention backend after a layer's attention: record window queries, compact if planned."""
        for plan in self.rows:
            layer = plan.state.layer(layer_idx)
            window = plan.state.policy.window_size()
            if window:
                _record_window(layer, query[plan.query_start : plan.query_end], plan, window)
            if plan.compaction is not None:
                _compact(plan, layer, layer_idx, kv_cache, block_table[plan.row], scale)


def _record_window(layer: LayerState, queries: torch.Tensor, plan: RowPlan, window: int) -> None:
    queries = queries[-window:].detach().clone()
    first_pos = plan.cache_len - (plan.query_end - plan.query_start) + plan.state.offset
    positions = torch.arange(plan.query_end - plan.query_start)[-window:] + first_pos
    if layer.window_queries is not None and queries.shape[0] < window:
        queries = torch.cat([layer.window_queries, queries])[-window:]
        positions = torch.cat([layer.window_positions, positions])[-window:]
    layer.window_queries, layer.window_positions = queries, positions


def _compact(plan: RowPlan, layer: LayerState, layer_idx: int, kv_cache: torch.Tensor, block_ids: torch.Tensor,
             scale: float) -> None:
    n = plan.cache_len
    budget = plan.compaction.keep_tokens
    keys, values = read_entries(kv_cache, block_ids, n)
    positions = layer.positions(keys.shape[0], n, plan.state.offset)
    obs = LayerObservation(layer_idx=layer_idx, keys=keys, values=values, positions=positions, scale=scale,
                           window_queries=layer.window_queries, window_positions=layer.window_positions)
    keep = plan.state.policy.keep_indices(obs, budget)
    compact_entries(kv_cache, block_ids, keys, values, keep)
    layer.kept_positions = positions.gather(1, keep)
    layer.last_keep = keep


_current: StepContext | None = None


def set_step(context: StepContext | None) -> None:
    global _current
    _current = context


def current_step() -> StepContext | None:
    return _current
