"""Worker-side eviction state: per request, the offset between logical tokens and cache entries, and per layer the
statistics a policy needs between steps. Also the step context the attention backend reads during a forward.

Memory is bounded by the budget: per layer we keep the positions of the entries kept at the last compaction
([H, B]) and the last `window` queries; entries appended since then have implicit positions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvserve import kernel_dispatch
from kvserve.config import KVConfig
from kvserve.engine.cache_layout import PagedKV, compact_entries, read_entries, write_entries
from kvserve.engine.gated import gated_layer_step
from kvserve.engine.plan import Compaction
from kvserve.gates.module import GatePast
from kvserve.metrics import metrics
from kvserve.policies import LayerObservation, Policy
from kvserve.policies.base import PassStatistics

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

    def cache_rows(self) -> dict[int, int]:
        """Batch rows whose step reads or rewrites their cache entries (statistics, a compaction, a gate), with their
        cache lengths; the other evicting rows only record window queries."""
        return {plan.row: plan.cache_len for plan in self.rows
                if plan.failure is None and (plan.compaction is not None or plan.state.policy.stat_names
                                             or plan.state.gate is not None)}

    def compacts(self) -> bool:
        return any(plan.compaction is not None and plan.failure is None for plan in self.rows)

    def pass_rows(self, statistic: str) -> dict[int, int]:
        """Batch rows whose policy wants `statistic` (a `PassStatistics` field) from this step's attention, with
        their cache lengths: a backend that computes attention itself produces it in the same pass."""
        return {plan.row: plan.cache_len for plan in self.rows
                if plan.failure is None and plan.state.gate is None and statistic in plan.state.policy.pass_statistics}

    def after_attention(self, layer_idx: int, query: torch.Tensor, cache: PagedKV | None, block_table: torch.Tensor,
                        scale: float, output: torch.Tensor, measured: dict[int, PassStatistics] | None = None) -> None:
        """Called by the attention backend after a layer's attention over `cache` (this step's entries written):
        record window queries, measure the statistics the policy asks for (those in `measured`, by batch row, came
        from the backend's own pass), compact if planned; for gated requests, recompute their output rows
        [q, Hq, D] with the per-head keep mask. `cache` may be None when no row is in `cache_rows()`."""
        for plan in self.rows:
            if plan.failure is not None:
                continue
            start = time.perf_counter()
            try:
                if plan.state.gate is not None:
                    gated_layer_step(plan, plan.state.layer(layer_idx), layer_idx,
                                     query[plan.query_start : plan.query_end], _query_positions(plan), output,
                                     cache, block_table[plan.row], scale)
                else:
                    self._evict(plan, layer_idx, query, cache, block_table[plan.row], scale,
                                (measured or {}).get(plan.row))
            except Exception as error:  # a policy's bug fails its request, never the engine (the scheduler ends it)
                plan.failure = f"kv_policy {plan.state.config.policy!r} failed: {type(error).__name__}: {error}"
                logger.exception("kvserve: request %s: %s", plan.req_id, plan.failure)
            plan.eviction_seconds += time.perf_counter() - start

    def _evict(self, plan: RowPlan, layer_idx: int, query: torch.Tensor, cache: PagedKV, block_ids: torch.Tensor,
               scale: float, given: PassStatistics | None) -> None:
        layer = plan.state.layer(layer_idx)
        policy = plan.state.policy
        queries = query[plan.query_start : plan.query_end]
        window = policy.window_size()
        if window:
            _record_window(layer, queries, plan, window)
        if not policy.stat_names and plan.compaction is None:
            return
        obs = _observe(plan, layer, layer_idx, cache, scale)
        obs.measured = measure_pass(policy, obs, queries, cache, block_ids, compacting=plan.compaction is not None,
                                    given=given)
        if plan.compaction is not None or _reads_entries(policy, obs.measured):
            obs.keys, obs.values = read_entries(cache, block_ids, plan.cache_len)
        if policy.stat_names:
            layer.stats = obs.stats = policy.update_stats(obs, queries, _query_positions(plan))
        if plan.compaction is not None:
            _compact(plan, layer, obs, cache, block_ids)

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


def _observe(plan: RowPlan, layer: LayerState, layer_idx: int, cache: PagedKV, scale: float) -> LayerObservation:
    """The layer's observation without its entries: keys and values are shape-only (meta) tensors until the caller
    reads them from the cache. A step that only accumulates measured statistics never copies the cache, and a policy
    that touched them without asking would fail loudly instead of scoring garbage."""
    n = plan.cache_len
    keys = values = torch.empty(cache.num_heads, n, cache.keys.shape[-1], device="meta")
    stats = {}
    for name in plan.state.policy.stat_names:  # entries appended since the last step start at zero
        old = layer.stats.get(name)
        stats[name] = (torch.zeros(cache.num_heads, n, device=cache.keys.device) if old is None
                       else F.pad(old, (0, n - old.shape[1])))
    return LayerObservation(layer_idx=layer_idx, keys=keys, values=values,
                            positions=layer.positions(keys.shape[0], n, plan.state.offset), scale=scale,
                            window_queries=layer.window_queries, window_positions=layer.window_positions,
                            stats=stats, budget=plan.compaction.keep_tokens if plan.compaction else 0)


def _compact(plan: RowPlan, layer: LayerState, obs: LayerObservation, cache: PagedKV,
             block_ids: torch.Tensor) -> None:
    selection = plan.state.policy.select(obs, plan.compaction.keep_tokens)
    keep = selection.keep_indices
    budget = keep.shape[1]
    if selection.keys is None:  # the statistics move with their entries, in the same operation
        stats = {name: stat.float().contiguous() for name, stat in obs.stats.items()}
        compact_entries(cache, block_ids, keep, stats=list(stats.values()))
        layer.stats = {name: stat[:, :budget].clone() for name, stat in stats.items()}
    else:  # a merging policy rewrote the kept entries and their statistics
        write_entries(cache, block_ids, selection.keys, selection.values)
        layer.stats = selection.stats or {name: stat.gather(1, keep) for name, stat in obs.stats.items()}
    layer.kept_positions = obs.positions.gather(1, keep)
    layer.last_keep = keep


def _reads_entries(policy: Policy, measured: PassStatistics) -> bool:
    """Outside a compaction, the entries are needed only by a statistic the pass did not measure (or by a policy that
    keeps statistics without declaring them as pass statistics)."""
    if policy.stat_names and not policy.pass_statistics:
        return True
    return any(getattr(measured, name) is None for name in policy.pass_statistics if name != "window_sums")


def measure_pass(policy: Policy, obs: LayerObservation, queries: torch.Tensor, cache: PagedKV,
                 block_ids: torch.Tensor, compacting: bool, given: PassStatistics | None = None) -> PassStatistics:
    """The statistics of this step's queries [q, Hq, D] that `policy.pass_statistics` names, from the attention
    operations of `kernel_dispatch` (Triton on CUDA: the fused kernels; PyTorch on CPU, after vLLM's own kernel).

    Window sums are measured only at a compaction whose window lies inside this step (a prefill chunk of at least
    `window` queries, or a one-query window in decode without a logit scale); an older window is not in this pass,
    and the policy computes it from the stored window queries. Prefill first-logits are left to the policy (one
    [q, Hq] product; the prefill kernel does not produce them). What `given` holds (the backend's own pass measured
    it) is not measured again.
    """
    given = given or PassStatistics()
    wanted = [name for name in policy.pass_statistics if getattr(given, name) is None]
    measured = replace(given)
    num_queries, n = queries.shape[0], obs.num_tokens
    window = policy.window_size() if compacting and "window_sums" in wanted else 0
    gain = policy.window_logit_scale(obs) if 0 < window <= num_queries else None
    device = cache.keys.device
    table = block_ids[None].to(device=device, dtype=torch.int32)
    seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
    queries = queries.to(device)
    if num_queries == 1:  # decode: one launch gives the column sums (= a one-query window's sums) and the logits
        window_here = window == 1 and gain is None
        sums = (torch.zeros(1, obs.num_heads, n, device=device)
                if "column_sums" in wanted or window_here else None)
        first = torch.empty(1, queries.shape[1], device=device) if "first_logits" in wanted else None
        if sums is None and first is None:
            return measured
        kernel_dispatch.decode_attention_with_scores(queries, cache.keys, cache.values, table, seq_lens, obs.scale,
                                                     scores=sums, first_logit=first, max_seq_len=n,
                                                     need_output=False)
        if "column_sums" in wanted:
            measured.column_sums = sums[0]
        if window_here:
            measured.window_sums = sums[0]
        if first is not None:
            measured.first_logits = first
        return measured
    starts = torch.tensor([0, num_queries], dtype=torch.int32, device=device)

    def prefill_sums(rows: int, logit_scale: torch.Tensor | None) -> torch.Tensor:
        _, sums, _ = kernel_dispatch.prefill_attention_with_window_sums(
            queries, cache.keys, cache.values, table, seq_lens, starts, obs.scale, rows,
            score_logit_scale=logit_scale, max_slots=n, max_seq_len=n, max_query_len=num_queries, need_output=False)
        return sums[0]

    if "column_sums" in wanted:
        measured.column_sums = prefill_sums(num_queries, None)
    if 0 < window <= num_queries:
        row_scale = None
        if gain is not None:  # the gain applies to the window rows; the others do not vote
            row_scale = torch.ones(obs.num_heads, num_queries, device=device)
            row_scale[:, -window:] = gain.to(device)
        measured.window_sums = prefill_sums(window, row_scale)
    return measured


_current: StepContext | None = None


def set_step(context: StepContext | None) -> None:
    global _current
    _current = context


def current_step() -> StepContext | None:
    return _current
