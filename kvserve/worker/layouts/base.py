"""The cache operations kvserve's eviction needs, over one page view, written once in terms of three page codecs.

A page view is the KV buffer of the layers kvserve pages, as `[P, 1, block_size, 2 * head_size]` pages: page p holds
`block_size` entries of one (layer, KV head) list. A "row" is one page list (a (request, KV head) of one layer):
`tables` [R, W] holds each row's page ids in list order and `lengths` [R] its entries. The engine reads rows as pseudo
rows of one KV head (`kvserve/worker/eviction.py`), so every operation here takes many lists at once.

What differs between layouts is only how a page stores its entries. A subclass says that in three methods:
`key_pages` (a page's keys as `[D, bs]`), `value_pages` (`[bs, D]`) and `store_pages` (the inverse). Everything else
moves whole pages: one indexed copy per page instead of one per entry, one matmul per (row, page) instead of a Python
loop per row. A layout with faster operations (the Triton kernels) overrides them. The PyTorch references in
`kvserve_kernels.reference` define the numbers; `tests/test_layouts.py` holds every layout to them and to each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from kvserve_kernels import cpu as cpu_kernel

from kvserve.worker.pages import copy_pages

QUERY_CHUNK = 128  # queries per matmul in a long prefill: bounds the [R, pages, chunk * G, bs] logits


class CachePages(ABC):
    """One page view and the operations on its page lists. Construction is cheap (views only)."""

    name: str  # the layout, as logs and tests call it
    kernel_format: str | None = None  # how kvserve's CPU kernel names this page format (None: it does not read it)

    def __init__(self, pages: torch.Tensor) -> None:
        self.pages = pages  # [P, 1, bs, 2 * D] in this layout's format
        self.block_size = pages.shape[2]
        self.head_size = pages.shape[3] // 2
        self._kernel: bool | None = None

    def uses_kernel(self) -> bool:
        """Whether kvserve's CPU kernel (`kvserve_kernels.cpu`) reads these pages: attention and statistics in one
        C++ pass instead of the page-wise PyTorch below. Decided once per view (it builds the kernel if needed)."""
        if self._kernel is None:
            self._kernel = self.kernel_format is not None and cpu_kernel.supports(self.pages, self.kernel_format)
        return self._kernel

    def pytorch_only(self) -> CachePages:
        """These pages read by the page-wise PyTorch path alone (what the kernel replaced: benchmarks compare them)."""
        self._kernel = False
        return self

    @property
    def device(self) -> torch.device:
        return self.pages.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pages.dtype

    # ---- the codec: what a subclass defines ------------------------------------------------------------------------

    @abstractmethod
    def key_pages(self, ids: torch.Tensor) -> torch.Tensor:
        """Keys of pages `ids` [...]: [..., D, bs] (a copy; key-major, as matmuls against queries want them)."""

    @abstractmethod
    def value_pages(self, ids: torch.Tensor) -> torch.Tensor:
        """Values of pages `ids` [...]: [..., bs, D] (a copy)."""

    @abstractmethod
    def store_pages(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite pages `ids` [N] with keys [N, D, bs] and values [N, bs, D]."""

    # ---- the operations -----------------------------------------------------------------------------------------

    def page_ids(self, tables: torch.Tensor, width: int) -> torch.Tensor:
        """[R, C] page ids holding entries 0 .. width-1 of each row (C = ceil(width / bs)), on the cache's device."""
        return tables[:, : -(-width // self.block_size)].to(self.device).long()

    def page_entries(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of pages `ids` [R, C] in list order: keys and values [R, C * bs, D] (copies)."""
        rows, count = ids.shape
        keys = self.key_pages(ids).transpose(-1, -2).reshape(rows, count * self.block_size, -1)
        return keys, self.value_pages(ids).reshape(rows, count * self.block_size, -1)

    def read_rows(self, tables: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries 0 .. width-1 of each row: keys and values [R, width, D] (whole pages, then trimmed)."""
        keys, values = self.page_entries(self.page_ids(tables, width))
        return keys[:, :width], values[:, :width]

    def read_lists(self, tables: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's entries: keys and values [R, max(lengths), D], zero past a row's length."""
        keys, values = self.read_rows(tables, int(lengths.max()))
        padding = torch.arange(keys.shape[1], device=keys.device)[None, :] >= lengths.to(keys.device)[:, None]
        if bool(padding.any()):
            keys, values = keys.masked_fill(padding[..., None], 0), values.masked_fill(padding[..., None], 0)
        return keys, values

    def query_sums(
        self,
        queries: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        *,
        logit_scale: torch.Tensor | None = None,
        first_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each entry's causal attention probability summed over the queries and their group: [R, max(lengths)].

        `queries` [R, Q, G, D] are the newest Q entries' queries of each row, oldest first (query i of row r sits at
        list index lengths[r] - Q + i and sees entries up to it). `logit_scale` [R, Q] multiplies a query's logits
        (AhaKV's step gain). With `first_logits`, also each query's logit to entry 0: [R, Q * G] (query-major).
        """
        if self.uses_kernel():
            float_queries = queries.to(self.device).float()  # the statistics read fp32 queries, as below
            _, sums, firsts = cpu_kernel.paged_attention(
                float_queries,
                self.pages,
                self.kernel_format,
                tables,
                lengths,
                scale,
                gain=logit_scale,
                output=False,
                first_logits=first_logits,
            )
            return sums, firsts
        num_rows, num_queries, group, dim = queries.shape
        width = int(lengths.max())
        ids = self.page_ids(tables, width)
        keys = self.key_operand(ids, min(num_queries, QUERY_CHUNK) * group)
        count, block_size, device = ids.shape[1], self.block_size, self.device
        slots = torch.arange(count * block_size, device=device)
        own = (lengths.to(device).long() - num_queries)[:, None] + torch.arange(num_queries, device=device)  # [R, Q]
        total = torch.zeros(num_rows, count * block_size, device=device)
        firsts = []
        for start in range(0, num_queries, QUERY_CHUNK):
            part = queries[:, start : start + QUERY_CHUNK].to(device).float()
            chunk = part.shape[1]
            sees = own[:, start : start + chunk]  # [R, c]
            visible = -(-(int(sees.max()) + 1) // block_size)  # pages any query of the chunk sees (causal)
            logits = self.page_logits(part.reshape(num_rows, chunk * group, dim), keys, visible)  # [R, V, cG, bs]
            logits = logits.transpose(1, 2).reshape(num_rows, chunk * group, visible * block_size).mul_(scale)
            if first_logits:
                firsts.append(logits[:, :, 0].clone())
            if logit_scale is not None:
                gain = logit_scale[:, start : start + chunk].to(device).float()
                logits.mul_(gain.repeat_interleave(group, dim=1)[..., None])
            sees = sees.repeat_interleave(group, dim=1)[..., None]  # [R, cG, 1]
            logits.masked_fill_(slots[: visible * block_size] > sees, float("-inf"))
            total[:, : visible * block_size] += torch.softmax(logits, dim=-1).sum(dim=1)
        return total[:, :width], (torch.cat(firsts, dim=1) if first_logits else None)

    def key_operand(self, ids: torch.Tensor, num_queries: int) -> torch.Tensor:
        """The keys of pages `ids` [R, C] in float32, in the form `page_logits` multiplies by `num_queries` query
        rows at a time: here [R, C, D, bs]."""
        return self.key_pages(ids).float()

    def page_logits(self, queries: torch.Tensor, keys: torch.Tensor, visible: int) -> torch.Tensor:
        """Queries [R, M, D] (float32) times the keys of each row's first `visible` pages (`key_operand`):
        [R, V, M, bs]."""
        return torch.matmul(queries[:, None], keys[:, :visible])  # [R, V, D, bs] keys

    def first_logits(self, queries: torch.Tensor, tables: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per row [R, G, D]: its logits to the row's entry 0, [R, G]."""
        first_keys = self.key_pages(self.page_ids(tables, 1))[:, 0, :, 0]  # [R, D]
        return torch.einsum("rgd,rd->rg", queries.to(self.device).float(), first_keys.float()) * scale

    def compact(
        self,
        tables: torch.Tensor,
        keep_indices: torch.Tensor,
        keep_counts: torch.Tensor,
        stats: Sequence[torch.Tensor] = (),
        entries: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """In place: row r's entries keep_indices[r, :keep_counts[r]] (ascending) move to its slots 0 .. count-1,
        and each [R, n] statistic's entries with them; slots at or past a row's count keep what they held (the
        contract of `kvserve_kernels.reference.compact_reference`). The destination pages are stored whole; only
        those a kept entry does not fill are read first. `entries`: the rows' keys and values
        [R, >= max kept index + 1, D] if the caller has them."""
        num_rows, width = keep_indices.shape
        if width == 0:
            return
        keep = keep_indices.to(self.device).long()
        counts = keep_counts.to(self.device).long()
        moving = torch.arange(width, device=self.device)[None, :] < counts[:, None]
        source_keys, source_values = entries if entries is not None else self.read_rows(tables, int(keep.max()) + 1)
        ids = self.page_ids(tables, width)
        keys, values = self._destination_entries(ids, counts)
        index = keep[..., None].expand(-1, -1, keys.shape[-1])
        mask = moving[..., None]
        keys[:, :width] = torch.where(mask, source_keys.to(keys.dtype).gather(1, index), keys[:, :width])
        values[:, :width] = torch.where(mask, source_values.to(values.dtype).gather(1, index), values[:, :width])
        self._store_entries(ids, keys, values)
        for stat in stats:
            stat[:, :width] = torch.where(moving.to(stat.device), stat.gather(1, keep.to(stat.device)), stat[:, :width])

    def write_lists(self, tables: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [R, m, D] keys/values as entries 0..m-1 of each row (the rest of their pages unchanged)."""
        width = keys.shape[1]
        ids = self.page_ids(tables, width)
        page_keys, page_values = self.page_entries(ids)
        page_keys[:, :width] = keys.to(page_keys.dtype)
        page_values[:, :width] = values.to(page_values.dtype)
        self._store_entries(ids, page_keys, page_values)

    def write_slots(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [m, D] keys/values at page-view slots [m] (page * block_size + offset, vLLM's slot mapping)."""
        slots = slots.to(self.device).long()
        ids, where = torch.unique(slots // self.block_size, return_inverse=True)
        page_keys, page_values = self.key_pages(ids).transpose(1, 2), self.value_pages(ids)  # [N, bs, D] each
        offsets = slots % self.block_size
        page_keys[where, offsets] = keys.to(page_keys.dtype)
        page_values[where, offsets] = values.to(page_values.dtype)
        self.store_pages(ids, page_keys.transpose(1, 2), page_values)

    def copy_pages(self, moves: list[tuple[int, int]]) -> None:
        """Copy whole pages (source, destination): a page is one self-contained slab in every layout, so a move never
        decodes it (the block manager moves pages between steps the same way)."""
        copy_pages(self.pages, moves)

    def _destination_entries(self, ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers [R, C * bs, D] for the pages `ids` [R, C] a compaction rewrites, holding the pages' present entries
        only where some slot is at or past the row's count (the slots a compaction leaves as they were): a page the
        kept entries fill entirely is never read."""
        rows, count = ids.shape
        block_size, dim = self.block_size, self.head_size
        keys = torch.zeros(rows, count, block_size, dim, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        partial = (torch.arange(1, count + 1, device=self.device) * block_size)[None, :] > counts[:, None]  # [R, C]
        if bool(partial.any()):
            partial_ids = ids[partial]
            keys[partial] = self.key_pages(partial_ids).transpose(1, 2)
            values[partial] = self.value_pages(partial_ids)
        return keys.view(rows, count * block_size, dim), values.view(rows, count * block_size, dim)

    def _store_entries(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store pages `ids` [R, C] from their entries [R, C * bs, D] in list order."""
        rows, count = ids.shape
        keys = keys.view(rows * count, self.block_size, -1).transpose(1, 2)
        self.store_pages(ids.reshape(-1), keys, values.view(rows * count, self.block_size, -1))
