"""Attention statistics and compaction over many page lists at once: the engine's CPU path, page by page.

A "row" is one page list (one (request, KV head) of one layer) in the one-head page view `PagedKV` [P, bs, 1, D];
`tables` [R, W] holds each row's pages in list order, `lengths` [R] its entries. Everything here moves whole pages:
vLLM's CPU layout stores a page's keys transposed (`[D, bs]`) and its values as `[bs, D]`, both contiguous, so one
indexed copy per page replaces a copy per entry, and one matmul per (row, page) replaces a Python loop per row.
The PyTorch references in `kvserve_kernels.reference` define the numbers; `tests/test_page_scores.py` holds these
to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # cache_layout calls into this module
    from kvserve.engine.cache_layout import PagedKV

QUERY_CHUNK = 128  # queries per matmul in a long prefill: bounds the [R, pages, chunk * G, bs] logits


def _pages(tables: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """[R, C] page ids holding entries 0 .. width-1 of each row (C = ceil(width / bs))."""
    return tables[:, : -(-width // block_size)].long()


def _key_view(cache: PagedKV) -> torch.Tensor:
    """[P, D, bs]: each page's keys as vLLM's CPU layout stores them (transposed, contiguous per page)."""
    return cache.keys[:, :, 0, :].transpose(1, 2)


def _value_view(cache: PagedKV) -> torch.Tensor:
    """[P, bs, D]: each page's values."""
    return cache.values[:, :, 0, :]


# index_select / index_copy_ rather than advanced indexing: one contiguous copy per page, ~6x faster on CPU.
def key_pages(cache: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """Keys of pages `ids` [R, C] as stored per page, transposed: [R, C, D, bs] (a copy)."""
    view = _key_view(cache)
    return view.index_select(0, ids.reshape(-1)).view(*ids.shape, *view.shape[1:])


def value_pages(cache: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """Values of pages `ids` [R, C]: [R, C, bs, D] (a copy)."""
    view = _value_view(cache)
    return view.index_select(0, ids.reshape(-1)).view(*ids.shape, *view.shape[1:])


def _page_entries(cache: PagedKV, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of pages `ids` [R, C] in list order: keys and values [R, C * bs, D] (copies)."""
    rows, count = ids.shape
    keys = key_pages(cache, ids).transpose(2, 3).reshape(rows, count * cache.block_size, -1)
    return keys, value_pages(cache, ids).reshape(rows, count * cache.block_size, -1)


def read_rows(cache: PagedKV, tables: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries 0 .. width-1 of each row: keys and values [R, width, D] (whole pages, then trimmed)."""
    keys, values = _page_entries(cache, _pages(tables, width, cache.block_size))
    return keys[:, :width], values[:, :width]


def query_sums(
    queries: torch.Tensor,
    cache: PagedKV,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    logit_scale: torch.Tensor | None = None,
    first_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each entry's causal attention probability summed over the queries and their group: [R, max(lengths)].

    `queries` [R, Q, G, D] are the newest Q entries' queries of each row, oldest first (query i of row r sits at list
    index lengths[r] - Q + i and sees entries up to it). `logit_scale` [R, Q] multiplies a query's logits (AhaKV's
    step gain). With `first_logits`, also each query's logit to entry 0: [R, Q * G] (query-major).
    """
    num_rows, num_queries, group, dim = queries.shape
    width = int(lengths.max())
    keys = key_pages(cache, _pages(tables, width, cache.block_size)).float()  # [R, C, D, bs]
    count, block_size = keys.shape[1], keys.shape[3]
    slots = torch.arange(count * block_size)
    own = (lengths.long() - num_queries)[:, None] + torch.arange(num_queries)  # [R, Q] list index of each query
    total = torch.zeros(num_rows, count * block_size)
    firsts = []
    for start in range(0, num_queries, QUERY_CHUNK):
        part = queries[:, start : start + QUERY_CHUNK].float()
        chunk = part.shape[1]
        sees = own[:, start : start + chunk]  # [R, c]
        visible = -(-(int(sees.max()) + 1) // block_size)  # pages any query of the chunk sees (causal)
        logits = torch.matmul(part.reshape(num_rows, 1, chunk * group, dim), keys[:, :visible])  # [R, V, cG, bs]
        logits = logits.transpose(1, 2).reshape(num_rows, chunk * group, visible * block_size).mul_(scale)
        if first_logits:
            firsts.append(logits[:, :, 0].clone())
        if logit_scale is not None:
            logits.mul_(logit_scale[:, start : start + chunk].float().repeat_interleave(group, dim=1)[..., None])
        sees = sees.repeat_interleave(group, dim=1)[..., None]  # [R, cG, 1]
        logits.masked_fill_(slots[: visible * block_size] > sees, float("-inf"))
        total[:, : visible * block_size] += torch.softmax(logits, dim=-1).sum(dim=1)
    return total[:, :width], (torch.cat(firsts, dim=1) if first_logits else None)


def first_logits(queries: torch.Tensor, cache: PagedKV, tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row [R, G, D]: its logits to the row's entry 0, [R, G]."""
    first_keys = key_pages(cache, tables[:, :1].long())[:, 0, :, 0]  # [R, D]
    return torch.einsum("rgd,rd->rg", queries.float(), first_keys.float()) * scale


def compact_rows(
    cache: PagedKV,
    tables: torch.Tensor,
    keep_indices: torch.Tensor,
    keep_counts: torch.Tensor,
    stats: Sequence[torch.Tensor] = (),
    entries: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place: row r's entries keep_indices[r, :keep_counts[r]] (ascending) move to its slots 0 .. count-1, and
    each [R, n] statistic's entries with them; slots at or past a row's count keep what they held (the contract of
    `kvserve_kernels.reference.compact_reference`). The destination pages are read, rewritten and written whole.
    `entries`: the rows' keys and values [R, >= max kept index + 1, D] when the caller has read them already."""
    num_rows, width = keep_indices.shape
    if width == 0:
        return
    keep = keep_indices.long()
    moving = torch.arange(width)[None, :] < keep_counts.long()[:, None]  # [R, B]
    source_keys, source_values = entries if entries is not None else read_rows(cache, tables, int(keep.max()) + 1)
    ids = _pages(tables, width, cache.block_size)
    count, block_size = ids.shape[1], cache.block_size
    keys, values = _page_entries(cache, ids)  # the destination pages as they are
    index = keep[..., None].expand(-1, -1, keys.shape[-1])
    mask = moving[..., None]
    keys[:, :width] = torch.where(mask, source_keys.gather(1, index), keys[:, :width])
    values[:, :width] = torch.where(mask, source_values.gather(1, index), values[:, :width])
    flat_ids = ids.reshape(-1)
    _key_view(cache).index_copy_(0, flat_ids, keys.view(num_rows * count, block_size, -1).transpose(1, 2))
    _value_view(cache).index_copy_(0, flat_ids, values.view(num_rows * count, block_size, -1))
    for stat in stats:
        stat[:, :width] = torch.where(moving, stat.gather(1, keep), stat[:, :width])
