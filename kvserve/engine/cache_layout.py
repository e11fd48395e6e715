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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve import kernel_dispatch


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


def read_entries(cache: PagedKV, block_ids: torch.Tensor, num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_entries` cache entries of a request: keys and values, each [H, num_entries, D]."""
    from kvserve_kernels.reference import gather_entries

    return gather_entries(cache.keys, cache.values, block_ids, num_entries)


def write_entries(cache: PagedKV, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write [H, m, D] keys/values as the request's first m entries (its blocks' slots 0..m-1)."""
    slots = torch.arange(keys.shape[1], device=cache.keys.device)
    blocks = block_ids.to(cache.keys.device).long()[slots // cache.block_size]
    offsets = slots % cache.block_size
    cache.keys[blocks, offsets] = keys.transpose(0, 1).to(cache.keys.dtype)
    cache.values[blocks, offsets] = values.transpose(0, 1).to(cache.values.dtype)


def compact_entries(cache: PagedKV, block_ids: torch.Tensor, keep_indices: torch.Tensor,
                    stats: Sequence[torch.Tensor] = ()) -> None:
    """In place: each head's kept entries (keep_indices [H, B], ascending) move to the front of the request's blocks,
    and each [H, n] statistic's entries with them (its first B columns are then the kept entries')."""
    kernel_dispatch.compact(cache.keys, cache.values, block_ids[None], keep_indices[None],
                            stats=[stat[None] for stat in stats])
