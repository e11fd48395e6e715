"""kvserve's reads and writes of head-page lists in vLLM's CPU cache layout, checked against vLLM's own cache-write
op. A list's pages are drawn from anywhere in a one-head page view, as an evicting request's lists are."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from kvserve.engine.cache_layout import amx_decode, amx_encode, compact_lists, cpu_views, read_lists

NUM_PAGES, HEADS, BLOCK, DIM = 18, 3, 32, 64


def vllm_pages_with(
    keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, isa: str = "vec", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A page view [P, 1, bs, 2D] where vLLM's writer put keys/values [n, H, D] as each head's list (tables [H, W])."""
    pages = torch.zeros(NUM_PAGES, 1, BLOCK, 2 * DIM, dtype=dtype)
    key_cache, value_cache = pages.view(NUM_PAGES, 1, 2 * BLOCK, DIM).chunk(2, dim=2)
    entries = torch.arange(keys.shape[0])
    slots = (tables[:, entries // BLOCK] * BLOCK + entries % BLOCK).T.reshape(-1)  # (token, head) order
    ops.cpu_attn_reshape_and_cache(
        keys.to(dtype).reshape(-1, 1, DIM),
        values.to(dtype).reshape(-1, 1, DIM),
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    return pages


TABLES = torch.tensor([[4, 13, 9], [1, 16, 2], [7, 0, 11]])  # each head's pages, anywhere in the view


def test_read_lists_returns_what_vllm_wrote_and_pads_shorter_heads():
    n = 75
    keys, values = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
    pages = vllm_pages_with(keys, values, TABLES)
    got_k, got_v = read_lists(cpu_views(pages), TABLES, torch.tensor([n] * HEADS))
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    lengths = torch.tensor([75, 40, 3])
    got_k, _ = read_lists(cpu_views(pages), TABLES, lengths)
    for h, length in enumerate(lengths.tolist()):
        assert torch.equal(got_k[h, :length], keys[:length, h]) and not got_k[h, length:].any()


def test_compaction_moves_each_heads_kept_entries_to_the_front_of_its_list():
    n = 90
    keys, values = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
    pages = vllm_pages_with(keys, values, TABLES)
    counts = torch.tensor([40, 25, 61])  # ragged: each head keeps its own count
    keep = torch.stack([torch.sort(torch.randperm(n)[:61]).values for _ in range(HEADS)])
    for h, count in enumerate(counts.tolist()):
        keep[h, :count] = torch.sort(keep[h, :count]).values
    compact_lists(cpu_views(pages), TABLES, keep, counts)
    new_k, new_v = read_lists(cpu_views(pages), TABLES, counts)
    for h, count in enumerate(counts.tolist()):
        assert torch.equal(new_k[h, :count], keys[keep[h, :count], h])
        assert torch.equal(new_v[h, :count], values[keep[h, :count], h])
    # what vLLM's writer produces for head 0's compacted list is bit-identical in its first, full page
    kept_k = torch.stack([keys[keep[h, :40], h] for h in range(HEADS)], 1)
    kept_v = torch.stack([values[keep[h, :40], h] for h in range(HEADS)], 1)
    fresh = vllm_pages_with(kept_k, kept_v, TABLES)
    assert torch.equal(pages[TABLES[0, 0]], fresh[TABLES[0, 0]])


# --------------------------------------------------------------------------------------------------------------------
# vLLM's AMX block format (bf16 on a CPU with AMX tiles): decoded and encoded against vLLM's own write op, and a
# compaction through staged blocks against vLLM writing the kept entries afresh.
# --------------------------------------------------------------------------------------------------------------------

AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles: vLLM never picks the AMX layout here")


def amx_cache_with(
    keys: torch.Tensor, values: torch.Tensor, block_ids: list[int], num_blocks: int, block_size: int
) -> torch.Tensor:
    heads, dim = keys.shape[1], keys.shape[2]
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, dim).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(keys.shape[0])])
    ops.cpu_attn_reshape_and_cache(
        keys.to(torch.bfloat16),
        values.to(torch.bfloat16),
        key_cache,
        value_cache,
        slots,
        "amx",
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
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
    from kvserve.engine.cache_layout import stage_pages

    n = 90
    keys, values = torch.randn(n, HEADS, DIM).bfloat16(), torch.randn(n, HEADS, DIM).bfloat16()
    pages = vllm_pages_with(keys, values, TABLES, "amx", torch.bfloat16)
    other = torch.randn_like(pages[5])
    pages[5] = other  # a page of another list: staging this one must not touch it
    counts = torch.tensor([40, 40, 40])
    keep = torch.stack([torch.sort(torch.randperm(n)[:40]).values for _ in range(HEADS)])
    staged = stage_pages(pages, {"r": TABLES}, {"r": torch.tensor([n] * HEADS)})
    compact_lists(staged.cache, staged.tables["r"], keep, counts)
    staged.write_back(pages)
    assert torch.equal(pages[5], other)
    kept_k = torch.stack([keys[keep[h], h] for h in range(HEADS)], 1)
    kept_v = torch.stack([values[keep[h], h] for h in range(HEADS)], 1)
    fresh = vllm_pages_with(kept_k, kept_v, TABLES, "amx", torch.bfloat16)
    assert torch.equal(pages[TABLES[:, 0]], fresh[TABLES[:, 0]])  # each head's full first page, bit for bit
