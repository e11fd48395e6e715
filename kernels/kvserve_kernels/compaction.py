"""In-place compaction of one layer's paged cache and the per-entry statistics (reference: `reference.py`).

For request r and KV head h, entry keep[r, h, j] moves to slot j of the request's blocks, j < count[r]; slots at or
past the count are not written (the engine frees or overwrites them).

Aliasing argument. keep[r, h] is strictly ascending with non-negative entries, so keep[j] >= j for every j.
- Different (request, head, head-dim chunk) programs touch disjoint memory (a request's blocks are its own; heads and
  head-dim chunks are different addresses; K and V are separate tensors), so programs never race.
- Inside a program, j runs in tiles of BLOCK_J in ascending order. Tile t writes slots [tJ, (t+1)J) and reads slots
  keep[j] >= j >= tJ. A later tile reads keep[j'] >= j' >= (t+1)J: never a slot an earlier tile wrote, so every read
  sees the original value. A slot tile t writes may be read by tile t itself (keep[j''] = j for some j'' < j in the
  tile) or by an earlier tile: the program loads the whole tile, then `tl.debug_barrier()` (all threads of the
  program have performed their loads), then stores; earlier tiles finished their loads before the previous
  barrier. So a slot is overwritten only after every read of its old value.
- Statistics rows use the same ordered, barriered tile loop.
The tests use keep sets whose sources overlap their destinations (keep[j] = j + small shift, dense runs, identity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import pow2
from .layout import check_cache


@triton.jit
def _compact_cache_kernel(
    CACHE,
    BLOCK_TABLE,
    KEEP,
    COUNTS,
    width,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btr,
    stride_kr,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    count = width
    if HAS_COUNTS:
        count = tl.minimum(tl.load(COUNTS + req).to(tl.int32), width)
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_btr
    keep_row = KEEP + req.to(tl.int64) * stride_kr + head * stride_kh
    base = CACHE + head * stride_ch + offs_d[None, :]
    for j0 in range(0, count, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_mask = offs_j < count
        src = tl.load(keep_row + offs_j, mask=j_mask, other=0).to(tl.int32)
        src_block = tl.load(bt_row + src // PAGE, mask=j_mask, other=0).to(tl.int64)
        dst_block = tl.load(bt_row + offs_j // PAGE, mask=j_mask, other=0).to(tl.int64)
        moved = j_mask & (src != offs_j)  # kept entries already in place are not rewritten
        mask = moved[:, None] & d_mask[None, :]
        vals = tl.load(base + src_block[:, None] * stride_cb + (src % PAGE)[:, None] * stride_cs, mask=mask)
        tl.debug_barrier()
        tl.store(base + dst_block[:, None] * stride_cb + (offs_j % PAGE)[:, None] * stride_cs, vals, mask=mask)


@triton.jit
def _compact_rows_kernel(
    STAT,
    KEEP,
    COUNTS,
    width,
    stride_sr,
    stride_sh,
    stride_kr,
    stride_kh,
    BLOCK_J: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    count = width
    if HAS_COUNTS:
        count = tl.minimum(tl.load(COUNTS + req).to(tl.int32), width)
    keep_row = KEEP + req.to(tl.int64) * stride_kr + head * stride_kh
    row = STAT + req.to(tl.int64) * stride_sr + head * stride_sh
    for j0 in range(0, count, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_mask = offs_j < count
        src = tl.load(keep_row + offs_j, mask=j_mask, other=0)
        vals = tl.load(row + src, mask=j_mask)
        tl.debug_barrier()
        tl.store(row + offs_j, vals, mask=j_mask)


def compact(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    keep_indices: torch.Tensor,
    *,
    keep_counts: torch.Tensor | None = None,
    stats: Sequence[torch.Tensor] = (),
    block_j: int = 32,
) -> None:
    """Move each (request, KV head)'s kept entries to the front of the request's blocks, in place.

    Args:
        key_cache, value_cache: one layer's [num_blocks, block_size, Hkv, D] views (`layout.split_kv_cache`).
        block_table: [R, max_blocks] int32, one row per request compacted (rows must not share blocks).
        keep_indices: [R, Hkv, B] (int32 or int64), per row STRICTLY ASCENDING cache indices below the request's
            entry count (not checked: a GPU check would need a device sync).
        keep_counts: optional [R]; request r keeps keep_indices[r, :, :keep_counts[r]] (default B for all).
        stats: [R, Hkv, slots] buffers (any dtype, contiguous last dim) moved the same way.
        block_j: entries per tile (power of two).
    """
    block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    if keep_indices.dim() != 3 or keep_indices.shape[1] != num_kv_heads or keep_indices.shape[0] > block_table.shape[0]:
        raise ValueError(
            f"keep_indices must be [R, {num_kv_heads}, B] with R <= block_table rows, got {tuple(keep_indices.shape)}"
        )
    for name, tensor in (("block_table", block_table), ("keep_indices", keep_indices), ("keep_counts", keep_counts)):
        if tensor is not None and tensor.device != key_cache.device:
            raise ValueError(f"{name}: on {tensor.device}, expected the cache's device {key_cache.device}")
    num_reqs, _, width = keep_indices.shape
    if num_reqs == 0 or width == 0:
        return
    if keep_indices.stride(-1) != 1:
        keep_indices = keep_indices.contiguous()
    counts = keep_counts if keep_counts is not None else keep_indices  # placeholder pointer when unused
    block_d = min(pow2(head_dim, 16), 64)
    for cache in (key_cache, value_cache):
        _compact_cache_kernel[(num_reqs, num_kv_heads, triton.cdiv(head_dim, block_d))](
            cache,
            block_table,
            keep_indices,
            counts,
            width,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            block_table.stride(0),
            keep_indices.stride(0),
            keep_indices.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PAGE=block_size,
            BLOCK_J=block_j,
            HAS_COUNTS=keep_counts is not None,
        )
    for stat in stats:
        if stat.dim() != 3 or tuple(stat.shape[:2]) != (num_reqs, num_kv_heads) or stat.stride(-1) != 1:
            raise ValueError(
                f"stats must be [{num_reqs}, {num_kv_heads}, slots] with a contiguous last dim, got {tuple(stat.shape)}"
            )
        _compact_rows_kernel[(num_reqs, num_kv_heads)](
            stat,
            keep_indices,
            counts,
            width,
            stat.stride(0),
            stat.stride(1),
            keep_indices.stride(0),
            keep_indices.stride(1),
            BLOCK_J=block_j,
            HAS_COUNTS=keep_counts is not None,
        )
