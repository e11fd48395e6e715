"""Reading and rewriting one request's entries in vLLM's CPU paged KV cache.

Layout (vLLM 0.32 `CPUAttentionBackendImpl.forward` / `cpu_attn_reshape_and_cache`, ISA "vec"): a layer's cache is
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, read as `[num_blocks, H, 2, block_size * head_size]` where
part 0 holds the block's keys TRANSPOSED (`[head_size, block_size]`) and part 1 its values (`[block_size, head_size]`).
`tests/test_cache_layout.py` checks this against vLLM's own write op.
"""

from __future__ import annotations

import torch


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, num_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    parts = kv_cache.view(num_blocks, num_heads, 2, block_size * dim)
    keys_t = parts[:, :, 0].view(num_blocks, num_heads, dim, block_size)
    values = parts[:, :, 1].view(num_blocks, num_heads, block_size, dim)
    return keys_t, values


def read_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                 num_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_entries` cache entries of a request: keys and values, each [H, num_entries, D]."""
    keys_t, values = _split(kv_cache)
    block_size = kv_cache.shape[2]
    blocks = block_ids[: (num_entries + block_size - 1) // block_size].long()
    keys = keys_t[blocks].permute(1, 0, 3, 2).reshape(kv_cache.shape[1], -1, keys_t.shape[2])
    vals = values[blocks].permute(1, 0, 2, 3).reshape(kv_cache.shape[1], -1, values.shape[3])
    return keys[:, :num_entries], vals[:, :num_entries]


def write_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write [H, m, D] keys/values as the request's first m entries (its blocks' slots 0..m-1)."""
    keys_t, vals = _split(kv_cache)
    num_heads, m, dim = keys.shape
    block_size = kv_cache.shape[2]
    num_blocks = (m + block_size - 1) // block_size
    blocks = block_ids[:num_blocks].long()
    pad = num_blocks * block_size - m
    if pad:
        # The tail of the last block lies past the request's length; keep what is there rather than zeroing it.
        old_k, old_v = read_entries(kv_cache, block_ids, num_blocks * block_size)
        keys = torch.cat([keys, old_k[:, m:]], dim=1)
        values = torch.cat([values, old_v[:, m:]], dim=1)
    keys_t[blocks] = keys.to(kv_cache.dtype).reshape(num_heads, num_blocks, block_size, dim).permute(1, 0, 3, 2)
    vals[blocks] = values.to(kv_cache.dtype).reshape(num_heads, num_blocks, block_size, dim).permute(1, 0, 2, 3)


def compact_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    keep_indices: torch.Tensor) -> None:
    """Move each head's kept entries (keep_indices [H, B], ascending) to the front of the request's blocks."""
    index = keep_indices[:, :, None].expand(-1, -1, keys.shape[-1])
    write_entries(kv_cache, block_ids, keys.gather(1, index), values.gather(1, index))
