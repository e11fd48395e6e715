"""kvserve's reads and writes of vLLM's CPU cache layout, checked against vLLM's own cache-write op."""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops

from kvserve.engine.cache_layout import compact_entries, cpu_views, read_entries

NUM_BLOCKS, HEADS, BLOCK, DIM = 6, 3, 32, 64


def vllm_cache_with(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    kv_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    key_cache, value_cache = kv_cache.view(NUM_BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(keys.shape[0])])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    return kv_cache


def test_read_entries_returns_what_vllm_wrote():
    n, block_ids = 75, [4, 1, 3]
    keys, values = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
    kv_cache = vllm_cache_with(keys, values, block_ids)
    got_k, got_v = read_entries(cpu_views(kv_cache), torch.tensor(block_ids), n)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))


def test_compaction_moves_each_heads_kept_entries_to_the_front():
    n, block_ids = 90, [2, 5, 0]
    keys, values = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
    kv_cache = vllm_cache_with(keys, values, block_ids)
    keep = torch.stack([torch.sort(torch.randperm(n)[:40]).values for _ in range(HEADS)])
    compact_entries(cpu_views(kv_cache), torch.tensor(block_ids), keep)
    new_k, new_v = read_entries(cpu_views(kv_cache), torch.tensor(block_ids), 40)
    for h in range(HEADS):
        assert torch.equal(new_k[h], keys[keep[h], h]) and torch.equal(new_v[h], values[keep[h], h])
    # what vLLM's writer produces for the compacted sequence is bit-identical in the kept blocks
    expected = torch.stack([vllm_cache_with(keys[keep[h]], values[keep[h]], block_ids)[:, h] for h in range(HEADS)], 1)
    assert torch.equal(kv_cache[block_ids[0]], expected[block_ids[0]])
