"""What the worker remembers about one evicting request between steps: its policy, its page lists
(`kvserve/engine/pages.py`), and per layer what the policy needs (the positions of the entries it kept, the last
window of queries, running statistics).

Memory is bounded by the budget: per layer we keep the positions of the entries kept at the last compaction
([H, m], one count per head) and the last `window` queries; entries appended since have implicit positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import KVConfig
from kvserve.engine.pages import HeadPages
from kvserve.gates.module import GatePast
from kvserve.policies import Policy

POSITION_HEADROOM = 256  # decode steps whose positions are computed ahead


@dataclass
class LayerState:
    kept_positions: torch.Tensor | None = None  # [H, m] positions of list entries 0..m-1 after the last compaction
    kept_counts: torch.Tensor | None = None  # [H] entries each head kept (ragged), None: all m; padding is -1
    window_queries: torch.Tensor | None = None  # [w, num_q_heads, D]
    window_positions: torch.Tensor | None = None  # [w]
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # per-entry running statistics, [H, m] each
    last_keep: torch.Tensor | None = None  # [H, B] list indices chosen at the last compaction (introspection)
    # Attention-Gate: validity of each head's first entries within the prompt (later ones valid), the gate's past
    valid: torch.Tensor | None = None  # [H, v] bool
    gate_past: GatePast | None = None
    # positions() for entries past the lists' current lengths too, valid until the next compaction
    _positions: torch.Tensor | None = field(default=None, repr=False)
    _positions_key: tuple = field(default=(None, None, None), repr=False)

    def counts(self, num_heads: int) -> torch.Tensor:
        """[H] entries of each head that the last compaction kept (0 before any)."""
        if self.kept_positions is None:
            return torch.zeros(num_heads, dtype=torch.long)
        if self.kept_counts is None:
            return torch.full((num_heads,), self.kept_positions.shape[1], dtype=torch.long)
        return self.kept_counts

    def positions(self, lengths: torch.Tensor, since: int) -> torch.Tensor:
        """Logical positions of each head's list entries, [H, max(lengths)], -1 past a head's length. `since`: the
        request's logical tokens at the last compaction (entries appended after it follow in order)."""
        num_heads, width = lengths.shape[0], int(lengths.max())
        key = self._positions_key
        if (self._positions is None or self._positions.shape[1] < width or key[0] != since
                or key[1] is not self.kept_positions or key[2] is not self.kept_counts):
            # changes only at a compaction: computed once for the next POSITION_HEADROOM decode steps as well
            self._positions = self._unmasked_positions(num_heads, width + POSITION_HEADROOM, since)
            self._positions_key = (since, self.kept_positions, self.kept_counts)
        positions = self._positions[:, :width].clone()
        if bool((lengths != width).any()):
            positions.masked_fill_(torch.arange(width)[None, :] >= lengths[:, None], -1)
        return positions

    def _unmasked_positions(self, num_heads: int, width: int, since: int) -> torch.Tensor:
        kept = self.counts(num_heads)
        slots = torch.arange(width)[None, :].expand(num_heads, -1)
        positions = since + slots - kept[:, None]
        if self.kept_positions is not None:
            head_kept = self.kept_positions[:, :width]
            from_kept = slots[:, : head_kept.shape[1]] < kept[:, None]
            positions[:, : head_kept.shape[1]] = torch.where(from_kept, head_kept,
                                                             positions[:, : head_kept.shape[1]])
        return positions


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
    pages: HeadPages
    since: int = 0  # logical tokens at the last compaction (0: never compacted)
    compactions: int = 0
    layers: dict[int, LayerState] = field(default_factory=dict)
    gate: GateRuntime | None = None

    def layer(self, idx: int) -> LayerState:
        return self.layers.setdefault(idx, LayerState())

    def reset(self) -> None:
        """After preemption the request recomputes from scratch into fresh blocks."""
        self.since = 0
        self.layers.clear()
        self.pages = HeadPages(self.pages.layout)
