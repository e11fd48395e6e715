"""Layouts where a strided view addresses every entry: vLLM's CPU "vec" layout, and the FlashAttention layout the
Triton kernels read. Both are `PagedKV` views `[pages, block_size, 1, head_size]` over the same page view, so pages
are read and stored with one indexed copy each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.worker.layouts.base import CachePages


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
    """vLLM's CPU cache (ISA "vec", vLLM 0.32 `CPUAttentionBackendImpl.forward` / `cpu_attn_reshape_and_cache`)
    `[num_blocks, num_kv_heads, block_size, 2 * head_size]` as `PagedKV` views; writes through them write the cache.

    Read as `[num_blocks, H, 2, block_size * head_size]`: part 0 holds the block's keys TRANSPOSED
    (`[head_size, block_size]`), part 1 its values (`[block_size, head_size]`), so the key view is strided in its
    head dimension. `tests/test_layouts.py` checks this against vLLM's own write op."""
    num_blocks, num_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    parts = kv_cache.view(num_blocks, num_heads, 2, block_size * dim)
    keys = parts[:, :, 0].view(num_blocks, num_heads, dim, block_size).permute(0, 3, 1, 2)
    values = parts[:, :, 1].view(num_blocks, num_heads, block_size, dim).permute(0, 2, 1, 3)
    return PagedKV(keys, values)


class ViewPages(CachePages):
    """Pages read and stored through `PagedKV` views of one head each."""

    def __init__(self, pages: torch.Tensor, views: PagedKV) -> None:
        super().__init__(pages)
        self.views = views
        self._keys = views.keys[:, :, 0, :].transpose(1, 2)  # [P, D, bs]
        self._values = views.values[:, :, 0, :]  # [P, bs, D]

    # index_select / index_copy_ rather than advanced indexing: one contiguous copy per page, much faster on CPU
    def key_pages(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device).long()
        return self._keys.index_select(0, ids.reshape(-1)).view(*ids.shape, *self._keys.shape[1:])

    def value_pages(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device).long()
        return self._values.index_select(0, ids.reshape(-1)).view(*ids.shape, *self._values.shape[1:])

    def store_pages(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        ids = ids.to(self.device).long()
        self._keys.index_copy_(0, ids, keys.to(self.device, self.dtype))
        self._values.index_copy_(0, ids, values.to(self.device, self.dtype))

    def write_slots(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        slots = slots.to(self.device).long()
        pages, offsets = slots // self.block_size, slots % self.block_size
        self.views.keys[pages, offsets, 0] = keys.to(self.device, self.dtype)  # the pages may live on a GPU
        self.views.values[pages, offsets, 0] = values.to(self.device, self.dtype)


class VecPages(ViewPages):
    """vLLM's CPU layout with ISA "vec" (every CPU dtype except bf16 on a CPU with AMX tiles)."""

    name = "vec"
    kernel_format = "vec"

    def __init__(self, pages: torch.Tensor) -> None:
        super().__init__(pages, cpu_views(pages))
