"""kvserve's reads and writes of vLLM's CPU cache layout, checked against vLLM's own cache-write op."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from kvserve.engine.cache_layout import amx_decode, amx_encode, compact_entries, cpu_views, read_entries

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


# --------------------------------------------------------------------------------------------------------------------
# vLLM's AMX block format (bf16 on a CPU with AMX tiles): decoded and encoded against vLLM's own write op, and a
# compaction through staged blocks against vLLM writing the kept entries afresh.
# --------------------------------------------------------------------------------------------------------------------

AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles: vLLM never picks the AMX layout here")


def amx_cache_with(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int], num_blocks: int,
                   block_size: int) -> torch.Tensor:
    heads, dim = keys.shape[1], keys.shape[2]
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, dim).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(keys.shape[0])])
    ops.cpu_attn_reshape_and_cache(keys.to(torch.bfloat16), values.to(torch.bfloat16), key_cache, value_cache, slots,
                                   "amx", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv_cache


@needs_amx
@pytest.mark.parametrize("block_size,dim", [(32, 64), (128, 64), (64, 128)])
def test_amx_decode_and_encode_match_vllms_writer(block_size, dim):
    n, block_ids = 2 * block_size + 7, [3, 0, 1]
    keys, values = torch.randn(n, HEADS, dim).bfloat16(), torch.randn(n, HEADS, dim).bfloat16()
    kv_cache = amx_cache_with(keys, values, block_ids, 4, block_size)
    decoded_k, decoded_v = amx_decode(kv_cache)
    slots = torch.arange(n)
    blocks = torch.tensor(block_ids)[slots // block_size]
    assert torch.equal(decoded_k[blocks, slots % block_size], keys)
    assert torch.equal(decoded_v[blocks, slots % block_size], values)
    assert torch.equal(amx_encode(decoded_k, decoded_v), kv_cache)


@needs_amx
def test_amx_staged_compaction_is_what_vllm_writes_and_reads():
    from kvserve.engine.cache_layout import compact_entries, stage_blocks

    n, block_ids = 90, [2, 5, 0]
    keys, values = torch.randn(n, HEADS, DIM).bfloat16(), torch.randn(n, HEADS, DIM).bfloat16()
    kv_cache = amx_cache_with(keys, values, block_ids, NUM_BLOCKS, BLOCK)
    other = torch.randn_like(kv_cache[4])
    kv_cache[4] = other  # a block of another request: staging one request must not touch it
    keep = torch.stack([torch.sort(torch.randperm(n)[:40]).values for _ in range(HEADS)])
    table = torch.tensor([[9, 9, 9], block_ids], dtype=torch.int32)  # the request is batch row 1
    staged = stage_blocks(kv_cache, table, {1: n})
    compact_entries(staged.cache, staged.block_table[1], keep)
    staged.write_back(kv_cache)
    assert torch.equal(kv_cache[4], other)
    kept_k = torch.stack([keys[keep[h], h] for h in range(HEADS)], 1)
    kept_v = torch.stack([values[keep[h], h] for h in range(HEADS)], 1)
    fresh = amx_cache_with(kept_k, kept_v, block_ids, NUM_BLOCKS, BLOCK)
    assert torch.equal(kv_cache[block_ids[0]], fresh[block_ids[0]])  # the full kept block, bit for bit
    # and vLLM's AMX attention reads the compacted cache as the freshly written one (tile registers need the
    # kernel's permission first, which vLLM's CPU worker asks for at start)
    assert torch._C._cpu._init_amx()
    query = torch.randn(1, 2 * HEADS, DIM).bfloat16()
    outputs = []
    for cache in (kv_cache, fresh):
        key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
        seq_lens, starts = torch.tensor([40], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=2 * HEADS, num_kv_heads=HEADS, head_dim=DIM, seq_lens=seq_lens, dtype=torch.bfloat16,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa="amx", enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype="auto")
        out = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens,
            scale=DIM**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=torch.tensor([block_ids], dtype=torch.int32), softcap=0.0, scheduler_metadata=meta,
            s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
