"""The worker's one record per evicting request (`WorkerRequest`): its settings and policy, its page lists
(`kvserve/worker/pages.py`), and per layer what the policy needs (the positions of the entries it kept, the last
window of queries, running statistics). `kvserve/worker/requests.py` holds them and handles their life events.

Memory is bounded by the budget: per layer we keep the positions of the entries kept at the last compaction
([H, m], one count per head) and the last `window` queries; entries appended since have implicit positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.config import KVConfig
from kvserve.gates.module import GatePast
from kvserve.policies import Policy
from kvserve.policies.rotary import Rotary
from kvserve.worker.pages import HeadPages

POSITION_HEADROOM = 256  # decode steps whose positions are computed ahead


class QueryWindow:
    """The last `size` queries of one layer ([size, Hq, D]) and their logical positions, as a ring: a decode step's
    query is one row copy, not a new tensor per (request, layer, step). Read oldest first. The positions are a numpy
    ring: one per (request, layer, decode step), a numpy element write costs a fraction of a tensor's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._queries: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, ...] = ()  # the ring's rows as views, made once
        self._positions = np.zeros(size, dtype=np.int64)
        self._next = 0  # the row the next query goes to
        self._filled = 0

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._queries = torch.empty(self.size, *shape, dtype=dtype, device=device)
        self._rows = self._queries.unbind(0)

    def record(self, queries: torch.Tensor, first_position: int) -> None:
        """Append queries [q, Hq, D] at positions first_position .. first_position + q - 1."""
        count = queries.shape[0]
        if count == 1:
            self.next_row(queries, first_position).copy_(queries[0])
            return
        if self._queries is None:
            self._allocate(queries.shape[1:], queries.dtype, queries.device)
        if count >= self.size:
            self._queries.copy_(queries[-self.size :])
            self._positions[:] = np.arange(first_position + count - self.size, first_position + count)
            self._next, self._filled = 0, self.size
            return
        rows = (self._next + np.arange(count)) % self.size
        self._queries.index_copy_(0, torch.from_numpy(rows), queries)
        self._positions[rows] = np.arange(first_position, first_position + count)
        self._next = (self._next + count) % self.size
        self._filled = min(self.size, self._filled + count)

    def next_row(self, like: torch.Tensor, position: int) -> torch.Tensor:
        """Record one query at `position`: the ring row [Hq, D] it goes to, which the caller fills (a step's decoding
        requests fill theirs in one copy, `kvserve/worker/eviction.py`). `like` [*, Hq, D]: the queries' shape."""
        if self._queries is None:
            self._allocate(like.shape[1:], like.dtype, like.device)
        row = self._rows[self._next]
        self._positions[self._next] = position
        self._next = (self._next + 1) % self.size
        self._filled = min(self.size, self._filled + 1)
        return row

    def queries(self) -> torch.Tensor:
        """[w, Hq, D] oldest first (w = queries seen, at most size); a copy."""
        return self._queries[torch.from_numpy(self._oldest_first())]

    def positions(self) -> torch.Tensor:
        return torch.from_numpy(self._positions[self._oldest_first()])

    def _oldest_first(self) -> np.ndarray:
        """The ring's filled rows, oldest first (rows 0 .. filled-1 until it wraps)."""
        if self._filled < self.size:
            return np.arange(self._filled)
        return (self._next + np.arange(self.size)) % self.size


@dataclass
class LayerState:
    kept_positions: torch.Tensor | None = None  # [H, m] positions of list entries 0..m-1 after the last compaction
    kept_counts: torch.Tensor | None = None  # [H] entries each head kept (ragged), None: all m; padding is -1
    window: QueryWindow | None = None  # the most recent queries, for policies that read a window
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # per-entry running statistics, [H, m] each
    share: torch.Tensor | None = None  # [H] entries each head returns to at a decode compaction (kv_allocation)
    # Attention-Gate: validity of each head's first entries within the prompt (later ones valid), the gate's past
    valid: torch.Tensor | None = None  # [H, v] bool
    gate_past: GatePast | None = None
    # speculative decoding: the queries [1 + drafts, Hq, D] of a step that verified drafts, until the next step
    # knows which were accepted
    pending: torch.Tensor | None = None
    # positions() for entries past the lists' current lengths too, valid until the next compaction
    _positions: torch.Tensor | None = field(default=None, repr=False)
    _positions_key: tuple = field(default=(None, None, None), repr=False)

    @property
    def window_queries(self) -> torch.Tensor | None:
        return self.window.queries() if self.window is not None else None

    @property
    def window_positions(self) -> torch.Tensor | None:
        return self.window.positions() if self.window is not None else None

    def query_window(self, size: int) -> QueryWindow:
        """The layer's window of the last `size` queries (a new one when the policy's size differs)."""
        if self.window is None or self.window.size != size:
            self.window = QueryWindow(size)
        return self.window

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
        if (
            self._positions is None
            or self._positions.shape[1] < width
            or key[0] != since
            or key[1] is not self.kept_positions
            or key[2] is not self.kept_counts
        ):
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
            positions[:, : head_kept.shape[1]] = torch.where(from_kept, head_kept, positions[:, : head_kept.shape[1]])
        return positions


@dataclass
class GateRuntime:
    """What a ragged (gated) request needs besides its policy: the model's gates (RoPE comes from `rotary`)."""

    gates: Any  # kvserve.gates.gateset.GateSet
    prompt_len: int


@dataclass
class WorkerRequest:
    config: KVConfig  # its settings, as the engine core admitted it with them
    policy: Policy
    pages: HeadPages
    since: int = 0  # logical tokens at the last compaction (0: never compacted)
    compactions: int = 0
    layers: dict[int, LayerState] = field(default_factory=dict)
    gate: GateRuntime | None = None
    rotary: Mapping[int, Rotary] = field(default_factory=dict)  # each paged layer's RoPE, by page-view index
    model: str = ""  # the served model's name, for policies trained per model
    released: list[int] = field(default_factory=list)  # vLLM blocks it gave back last step, to drop from vLLM's view
    # kv_lookahead (`kvserve/worker/questions.py`): the question's queries this request records (a probe) or reads
    question: dict[int, torch.Tensor] | None = None
    # a document reconstructed piece by piece (`kvserve/worker/pieces.py`): the pieces' document scores per layer
    pieces: dict[int, torch.Tensor] | None = None
    drafted: tuple[int, int] | None = None  # its last step verified drafts: (first position, tokens appended)

    def layer(self, idx: int) -> LayerState:
        state = self.layers.get(idx)
        if state is None:  # not setdefault: that would build a LayerState on every call (per layer and step)
            state = self.layers[idx] = LayerState()
        return state

    def reset(self) -> None:
        """After preemption the request recomputes from scratch into fresh blocks."""
        self.since = 0
        self.drafted = None
        self.layers.clear()
        self.pages = HeadPages(self.pages.layout)
