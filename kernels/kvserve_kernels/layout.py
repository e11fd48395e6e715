"""The GPU paged KV-cache layout the kernels target (vLLM 0.32, FlashAttention backend).

`FlashAttentionImpl.forward` (vllm/v1/attention/backends/flash_attn.py) documents a layer's cache as
``kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]`` (keys in the first half of the last dimension,
values in the second) and splits it with ``key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, -1)``
into two views of shape ``[num_blocks, block_size, num_kv_heads, head_size]``, which are what FlashAttention reads.
The memory order is a `KVCacheLayout` (vllm/v1/kv_cache_layout.py); FlashAttention declares none, so vLLM takes the
first of `_DEFAULT_LAYOUT_PREFERENCE` (vllm/v1/attention/backends/utils.py), LBNHC: per layer, memory order
[block, slot, head, K|V]. The views are therefore strided (a slot's key and value sit side by side).

Every kernel here takes those two views, reads their strides (only the last dimension must be contiguous), and so
works for every `KVCacheLayout`. Metadata follows `FlashAttentionMetadata`: ``block_table [num_reqs, max_blocks]``
(int32), ``seq_lens [num_reqs]`` (int32, entries in the cache including this step's tokens, which vLLM writes
before attention), ``query_start_loc [num_reqs + 1]`` (int32, cumulative query counts). Entry i of request r lives
in block ``block_table[r, i // block_size]`` at offset ``i % block_size`` (`BlockTable.compute_slot_mapping`,
vllm/v1/worker/block_table.py). Query head q belongs to KV head ``q // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` -> (keys, values) views.

    Each view is ``[num_blocks, block_size, num_kv_heads, head_size]``, exactly as `FlashAttentionImpl.forward`
    splits it; writing through the views writes the cache.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"expected [num_blocks, num_kv_heads, block_size, {2 * head_size}], got {tuple(kv_cache.shape)}"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def new_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    physical: str = "LBNHC",
) -> torch.Tensor:
    """An uninitialised per-layer cache in vLLM's logical shape with a `KVCacheLayout`'s memory order.

    ``physical="LBNHC"`` (vLLM's default: memory [block, slot, head, K|V]) or ``"LBHNC"`` (memory [block, head, slot,
    K|V], the logical order itself). For tests and benchmarks.
    """
    if physical == "LBNHC":
        raw = torch.empty(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype, device=device)
        return raw.transpose(1, 2)
    if physical == "LBHNC":
        return torch.empty(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype, device=device)
    raise ValueError(f"unknown layout {physical!r}")


def check_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, contiguous_head: bool = True
) -> tuple[int, int, int]:
    """Validate the two views; return (block_size, num_kv_heads, head_size).

    The Triton kernels need a contiguous head dimension; the PyTorch references (`contiguous_head=False`) read any
    strides, which is how kvserve's CPU path passes vLLM's CPU cache (keys stored transposed per block)."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value caches must be [num_blocks, block_size, num_kv_heads, head_size] and equal, "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if contiguous_head and (key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1):
        raise ValueError("the head dimension of the key/value caches must be contiguous")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must have the same dtype")
    _, block_size, num_kv_heads, head_size = key_cache.shape
    return block_size, num_kv_heads, head_size
