"""One layer's paged KV cache as the two views the kernels read, and a request's entries read, written and compacted
through them.

Every backend hands kvserve's scoring the same form, `PagedKV`: keys and values as views
`[num_blocks, block_size, num_kv_heads, head_size]` over vLLM's own cache tensor, so the operations in
`kvserve.kernel_dispatch` (Triton on CUDA, PyTorch on CPU) and the policies never see a backend's memory order.

- CPU (`cpu_views`; vLLM 0.32 `CPUAttentionBackendImpl.forward` / `cpu_attn_reshape_and_cache`, ISA "vec"): a layer's
  cache is `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, read as `[num_blocks, H, 2, block_size * head_size]`
  where part 0 holds the block's keys TRANSPOSED (`[head_size, block_size]`) and part 1 its values
  (`[block_size, head_size]`). The key view is therefore strided in its head dimension, which the PyTorch path reads
  as it is. `tests/test_cache_layout.py` checks this against vLLM's own write op.
- GPU (`flash_views`; vLLM's FlashAttention cache): `kvserve_kernels.layout.split_kv_cache`.
- CPU with AMX tiles, bf16 (ISA "amx"): within a block and head, keys are stored as
  `[block_size / 16, head_size / 2, 16, 2]` (16-token tiles, pairs of dimensions side by side per token) and values as
  `[head_size / 16, block_size / 2, 16, 2]` (16-dimension tiles, pairs of tokens side by side). No strided view
  addresses an entry there, so the blocks an evicting request needs are copied out into views (`stage_pages`) and
  written back after a compaction.
  `tests/test_cache_layout.py` checks both directions against vLLM's own write op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve import kernel_dispatch
from kvserve.engine.page_scores import compact_rows, read_rows


@dataclass(frozen=True)
class PagedKV:
    keys: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size] view of the cache
    values: torch.Tensor

    @property
    def num_heads(self) -> int:
        return self.keys.shape[2]

    @property
    def block_size(self) -> int:
        return self.keys.shape[1]


def cpu_views(kv_cache: torch.Tensor) -> PagedKV:
    """vLLM's CPU cache of one layer (ISA "vec") as `PagedKV` views; writes through them write the cache."""
    num_blocks, num_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    parts = kv_cache.view(num_blocks, num_heads, 2, block_size * dim)
    keys = parts[:, :, 0].view(num_blocks, num_heads, dim, block_size).permute(0, 3, 1, 2)
    values = parts[:, :, 1].view(num_blocks, num_heads, block_size, dim).permute(0, 2, 1, 3)
    return PagedKV(keys, values)


def flash_views(kv_cache: torch.Tensor, head_size: int) -> PagedKV:
    """vLLM's FlashAttention cache of one layer as `PagedKV` views (the layout the Triton kernels target)."""
    return PagedKV(*kernel_dispatch.split_kv_cache(kv_cache, head_size))


def list_slots(cache: PagedKV, table: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, offsets), each [H, width]: where entries 0..width-1 of each head's page list (`table` [H, W]) live."""
    entries = torch.arange(width, device=cache.keys.device)
    pages = table.to(cache.keys.device).long()[:, entries // cache.block_size]
    return pages, (entries % cache.block_size).expand_as(pages)


def read_lists(cache: PagedKV, table: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of each head's page list (`table` [H, W] into a one-head page view, `lengths` [H]): keys and
    values [H, max(lengths), D], zero past a head's length. Read page by page (`kvserve/engine/page_scores.py`)."""
    keys, values = read_rows(cache, table.to(cache.keys.device), int(lengths.max()))
    padding = torch.arange(keys.shape[1], device=keys.device)[None, :] >= lengths.to(keys.device)[:, None]
    if bool(padding.any()):
        keys, values = keys.masked_fill(padding[..., None], 0), values.masked_fill(padding[..., None], 0)
    return keys, values


def write_lists(cache: PagedKV, table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write [H, m, D] keys/values as entries 0..m-1 of each head's page list."""
    pages, offsets = list_slots(cache, table, keys.shape[1])
    cache.keys[pages, offsets, 0] = keys.to(cache.keys.dtype)
    cache.values[pages, offsets, 0] = values.to(cache.values.dtype)


def write_slots(cache: PagedKV, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write [m, H, D] keys/values at cache slots [m] (page or block * block_size + offset, vLLM's slot mapping)."""
    slots = slots.to(cache.keys.device).long()
    blocks, offsets = slots // cache.block_size, slots % cache.block_size
    cache.keys[blocks, offsets] = keys.to(cache.keys.dtype)
    cache.values[blocks, offsets] = values.to(cache.values.dtype)


def compact_lists(
    cache: PagedKV,
    table: torch.Tensor,
    keep_indices: torch.Tensor,
    keep_counts: torch.Tensor,
    stats: Sequence[torch.Tensor] = (),
    entries: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place: head h's kept entries (keep_indices[h, :keep_counts[h]], ascending) move to the front of its page
    list, and each [H, n] statistic's entries with them (its first counts are then the kept entries'). One call for
    all heads: each head's list is a row of one KV head. The Triton kernel on CUDA, whole pages on CPU (`entries`:
    the lists' keys and values as `read_lists` gave them, if the caller holds them)."""
    if kernel_dispatch.use_triton(cache.keys.device):
        device = cache.keys.device
        kernel_dispatch.compact(
            cache.keys,
            cache.values,
            table.to(device),
            keep_indices.to(device)[:, None],
            keep_counts=keep_counts.to(device),
            stats=[stat[:, None] for stat in stats],
        )
        return
    compact_rows(cache, table, keep_indices, keep_counts, stats, entries)


def amx_decode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `[k, num_kv_heads, block_size, 2 * head_size]` in vLLM's AMX format -> keys, values
    `[k, block_size, num_kv_heads, head_size]` (copies)."""
    count, heads, block_size, two_dim = blocks.shape
    dim = two_dim // 2
    parts = blocks.reshape(count, heads, 2, block_size * dim)
    keys = parts[:, :, 0].reshape(count, heads, block_size // 16, dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    values = parts[:, :, 1].reshape(count, heads, dim // 16, block_size // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    return keys.reshape(count, block_size, heads, dim), values.reshape(count, block_size, heads, dim)


def amx_encode(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The inverse of `amx_decode`: keys, values `[k, block_size, H, D]` -> blocks `[k, H, block_size, 2 * D]`."""
    count, block_size, heads, dim = keys.shape
    key_part = keys.reshape(count, block_size // 16, 16, heads, dim // 2, 2).permute(0, 3, 1, 4, 2, 5)
    value_part = values.reshape(count, block_size // 2, 2, heads, dim // 16, 16).permute(0, 3, 4, 1, 5, 2)
    parts = torch.stack([key_part.reshape(count, heads, -1), value_part.reshape(count, heads, -1)], dim=2)
    return parts.reshape(count, heads, block_size, 2 * dim)


@dataclass(frozen=True)
class StagedPages:
    """Some page lists of an AMX-format page view, decoded into `cache` (views the kernels' operations read), with
    `tables` (per key, [H, W]) pointing into it; `source` holds each staged page's id in the real view."""

    cache: PagedKV
    tables: dict[str, torch.Tensor]
    source: torch.Tensor  # [staged pages] int64

    def write_back(self, pages: torch.Tensor) -> None:
        pages[self.source] = amx_encode(self.cache.keys, self.cache.values)


def stage_pages(pages: torch.Tensor, tables: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> StagedPages:
    """Copy out the pages holding each list's entries (`tables[key]` [H, W], `lengths[key]` [H]) of a one-head page
    view `[P, 1, block_size, 2 * D]` in vLLM's AMX format."""
    block_size = pages.shape[2]
    sources, staged, next_id = [], {}, 0
    for key, table in tables.items():
        counts = -(-lengths[key].long() // block_size)
        width = max(int(counts.max()), 1)
        used = torch.arange(width)[None, :] < counts[:, None]
        ids = torch.zeros(table.shape[0], width, dtype=torch.int32)
        ids[used] = torch.arange(next_id, next_id + int(used.sum()), dtype=torch.int32)
        sources.append(table[:, :width].long()[used])
        next_id += int(used.sum())
        staged[key] = ids
    source = torch.cat(sources)
    return StagedPages(PagedKV(*amx_decode(pages[source])), staged, source)
