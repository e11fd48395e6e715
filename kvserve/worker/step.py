"""One engine step as the attention backend sees it: where every (request, layer, KV head) list lives in the page
view (`StepPages`), and which evicting requests score, compact or gate in this step (`StepContext`).

The runner hook builds both after vLLM has prepared the step's inputs (`kvserve/vllm/worker.py`); the backend reads
them through `current_step()` in each layer's forward; the runner clears them after the forward.

Pseudo-sequences: vLLM's CPU attention op is called with one row per (KV head, request), rows ordered
`h * R + r`, one KV head and G = Hq / Hkv query heads, over the page view. A request that does not evict gets
derived rows: page `(l * NB + b) * H + h` for its vLLM block b, length = vLLM's `seq_len`, so it reads exactly the
slots vLLM wrote (prefix caching included). An evicting request's rows come from its own page lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.messages import Compaction
from kvserve.worker.pages import PageLayout
from kvserve.worker.request import WorkerRequest


@dataclass
class StepPages:
    layout: PageLayout
    pages: torch.Tensor  # the whole KV buffer as [L * NB * H, 1, block_size, 2 * D] pages
    num_reqs: int
    num_tokens: int
    tables: torch.Tensor  # [L, H * R, W] int32 page ids per pseudo row (h * R + r)
    seq_lens: torch.Tensor  # [L, H * R] int32 entries per pseudo row after this step's writes
    query_start_loc: torch.Tensor  # [H * R + 1] int32 (the same for every layer)
    slots: torch.Tensor  # [L, T * H] int64 page-view slot of each (token, head) this step writes, -1: none
    same_lens: bool  # every layer has the same seq_lens: one scheduler metadata serves all layers
    _metadata: dict[tuple[str, int], object] = field(default_factory=dict)
    key_value_pages: tuple[torch.Tensor, torch.Tensor] | None = None  # the page view's key and value halves

    def metadata(self, layer_idx: int, part: str, seq_lens: torch.Tensor, build) -> object:
        """vLLM's attention work partition for the `part` of this layer's pseudo rows whose lengths are `seq_lens`
        (it embeds the lengths, so layers whose lists differ need their own); `build(seq_lens)` makes one."""
        key = (part, 0 if self.same_lens else layer_idx)
        if key not in self._metadata:
            self._metadata[key] = build(seq_lens)
        return self._metadata[key]


@dataclass
class RowPlan:
    """One evicting request's slice of the current batch."""

    req_id: str
    state: WorkerRequest
    row: int
    query_start: int
    query_end: int
    logical_len: int  # tokens the request has computed after this step (drives RoPE positions)
    compaction: Compaction | None
    eviction_seconds: float = 0.0  # scoring + compaction time over this step's layers
    failure: str | None = None  # the policy raised: the request fails, the rest of the batch goes on
    # kv_allocation=global: this step's layers waiting for the last one, which ranks them all together
    deferred: list = field(default_factory=list)
    # attention_gate: layers whose prompt chunk the attention pass already gated and attended with the mask
    gated_layers: set[int] = field(default_factory=set)
    drafts: int = 0  # speculative decoding: its last `drafts` queries verify draft tokens (their work is held back)
    # the last step's drafts, verified: (first position, accepted queries) to settle before this step's own work
    settle: tuple[int, int] | None = None
    later: int = 0  # a settled query's row: entries written after its own (lengths() leaves them out)

    def lengths(self, layer_idx: int) -> torch.Tensor:
        """[H] entries of each of the layer's lists after this step's writes (before `later` of them)."""
        lens = self.state.pages.lens[layer_idx]
        return torch.from_numpy(lens - self.later if self.later else lens)

    def table(self, layer_idx: int) -> torch.Tensor:
        """[H, W] the layer's page lists (page ids into the page view)."""
        return torch.from_numpy(self.state.pages.table[layer_idx])

    def query_positions(self) -> torch.Tensor:
        count = self.query_end - self.query_start
        return torch.arange(self.logical_len - count, self.logical_len)


class LayerTables(Mapping[str, torch.Tensor]):
    """Each evicting request's [H, W] page lists of one layer (`RowPlan.table`) by request id, each made on its first
    read: a decode step in which nothing is measured or compacted reads none, and making every request's table for
    every layer of every step was per-layer work that does not shrink with the ranks (it showed in a Qwen
    tensor-parallel rank's profile)."""

    def __init__(self, rows: dict[str, RowPlan], layer_idx: int) -> None:
        self._rows = rows  # by request id, shared by the step's layers
        self._layer_idx = layer_idx
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, req_id: str) -> torch.Tensor:
        table = self._made.get(req_id)
        if table is None:
            table = self._made[req_id] = self._rows[req_id].table(self._layer_idx)
        return table

    def __contains__(self, req_id: object) -> bool:  # Mapping's would make the table to find out
        return req_id in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class StepContext:
    pages: StepPages
    rows: list[RowPlan]
    _memo: dict[str, object] = field(default_factory=dict)

    def memo(self, key: str, make):
        """What `make()` returns, computed once per step (the first layer that asks) and shared by all layers."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def tables(self, layer_idx: int) -> LayerTables:
        return LayerTables(self.memo("rows_by_id", lambda: {plan.req_id: plan for plan in self.rows}), layer_idx)

    def compacts(self) -> bool:
        return any(plan.compaction is not None and plan.failure is None for plan in self.rows)

    def pass_rows(self, statistic: str) -> list[RowPlan]:
        """Plans whose policy wants `statistic` (a `PassStatistics` field) from this step's attention: a backend
        that computes attention itself produces it in the same pass."""
        return [
            plan
            for plan in self.rows
            if plan.failure is None and plan.state.gate is None and statistic in plan.state.policy.pass_statistics
        ]

    def failures(self) -> dict[str, str]:
        return {plan.req_id: plan.failure for plan in self.rows if plan.failure is not None}


_current: StepContext | None = None


def set_step(context: StepContext | None) -> None:
    global _current
    _current = context


def current_step() -> StepContext | None:
    return _current


def build_step_pages(
    layout: PageLayout,
    pages: torch.Tensor,
    rows: list[RowPlan],
    appended: dict[int, np.ndarray],
    vllm_blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> StepPages:
    """Every (layer, head, request)'s page list as pseudo rows `h * R + r`: derived from vLLM's block table for
    requests that do not evict, from their own lists for those that do (`rows`, whose new entries' slots are
    `appended[row]`). vLLM's view of the step: `vllm_blocks` [R, W] its block table, `seq_lens` [R] the lengths after
    the step, `slot_mapping` [T] the slot of each token (-1: padding), `query_start_loc` [R + 1]."""
    # built in numpy and handed to torch without a copy: a few small array operations per evicting request cost
    # a fraction of torch's (this ran once per step and per request, which a second tensor-parallel rank does not
    # divide: it showed in a tiny Llama step's profile as torch indexing)
    num_layers, num_heads, bs = layout.num_layers, layout.num_heads, layout.block_size
    num_reqs, vllm_width = vllm_blocks.shape
    num_tokens = slot_mapping.shape[0]
    width = max([vllm_width] + [plan.state.pages.table.shape[2] for plan in rows])
    heads = np.arange(num_heads)
    layer_base = np.arange(num_layers) * layout.num_blocks * num_heads
    tables = np.zeros((num_layers, num_heads, num_reqs, width), dtype=np.int32)
    tables[..., :vllm_width] = (
        vllm_blocks.numpy()[None, None] * num_heads + heads[None, :, None, None] + layer_base[:, None, None, None]
    )
    lengths = np.repeat(seq_lens.numpy().astype(np.int32)[None, None], num_layers * num_heads, axis=0).reshape(
        num_layers, num_heads, num_reqs
    )
    token_slots = slot_mapping.numpy()
    page_slots = ((token_slots // bs)[:, None] * num_heads + heads[None, :]) * bs + (token_slots % bs)[:, None]
    slots = page_slots[None] + layer_base[:, None, None] * bs  # [L, T, H]
    slots[:, token_slots < 0] = -1
    for plan in rows:
        lists = plan.state.pages
        tables[:, :, plan.row] = 0
        tables[:, :, plan.row, : lists.table.shape[2]] = lists.table
        lengths[:, :, plan.row] = lists.lens
        slots[:, plan.query_start : plan.query_end] = appended[plan.row].transpose(0, 2, 1)
    starts = (query_start_loc.numpy()[:-1][None, :] + heads[:, None] * num_tokens).reshape(-1)
    pseudo_starts = np.append(starts, num_heads * num_tokens).astype(np.int32)
    lengths = lengths.reshape(num_layers, -1)
    return StepPages(
        layout=layout,
        pages=pages,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        tables=torch.from_numpy(tables.reshape(num_layers, num_heads * num_reqs, width)),
        seq_lens=torch.from_numpy(lengths),
        query_start_loc=torch.from_numpy(pseudo_starts),
        slots=torch.from_numpy(slots.reshape(num_layers, -1).astype(np.int64, copy=False)),
        same_lens=not rows or bool((lengths == lengths[0]).all()),
    )
