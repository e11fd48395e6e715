"""vLLM's CPU layout with ISA "amx" (bf16 on a CPU with AMX tiles, vLLM 0.32 `cpu_attn_reshape_and_cache`).

Within a block and head, keys are stored as `[block_size / 16, head_size / 2, 16, 2]` (16-token tiles, pairs of
dimensions side by side per token) and values as `[head_size / 16, block_size / 2, 16, 2]` (16-dimension tiles,
pairs of tokens side by side). No strided view addresses an entry, but a page is self-contained: the operations
decode exactly the pages they read (only keys for the statistics), re-encode the pages they rewrite, and move pages
without decoding them. Nothing is staged per step, and every operation sees the whole page view, so a `global`
allocation ranks all layers as on "vec". `tests/test_layouts.py` checks the format against vLLM's own writer and
every operation against the "vec" layout on the same entries.
"""

from __future__ import annotations

import torch

from kvserve.worker.layouts.base import CachePages

TILE = 16  # tokens (keys) or dimensions (values) per AMX tile row block
# query rows up to which a product over the stored tiles beats decoding the keys first (`kvserve bench layouts`)
TILE_PRODUCT_MAX_QUERIES = 16


class AmxPages(CachePages):
    name = "amx"
    kernel_format = "amx"

    def __init__(self, pages: torch.Tensor) -> None:
        super().__init__(pages)
        if self.block_size % TILE or self.head_size % TILE:
            raise ValueError(f"AMX pages need block and head sizes divisible by {TILE}, got {tuple(pages.shape)}")
        half = self.block_size * self.head_size
        flat = pages.view(pages.shape[0], 2 * half)
        self._keys, self._values = flat[:, :half], flat[:, half:]  # [P, bs * D] each, in the tile order

    def key_pages(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device).long()
        bs, dim = self.block_size, self.head_size
        tiles = self._keys.index_select(0, ids.reshape(-1)).view(-1, bs // TILE, dim // 2, TILE, 2)
        # [tile, dim pair, token in tile, pair member] -> [dim pair, pair member, tile, token in tile] = [D, bs]
        return tiles.permute(0, 2, 4, 1, 3).reshape(*ids.shape, dim, bs)

    def value_pages(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device).long()
        bs, dim = self.block_size, self.head_size
        tiles = self._values.index_select(0, ids.reshape(-1)).view(-1, dim // TILE, bs // 2, TILE, 2)
        # [dim tile, token pair, dim in tile, pair member] -> [token pair, pair member, dim tile, dim in tile]
        return tiles.permute(0, 2, 4, 1, 3).reshape(*ids.shape, bs, dim)

    def key_operand(self, ids: torch.Tensor, num_queries: int) -> torch.Tensor:
        """For a few query rows (a decode step), the key tiles as stored, [R, C * bs / 16, D / 2, 32] (token in tile
        and pair member interleaved), which `page_logits` multiplies without reordering a key; for many (a prefill
        window), where the doubled multiplies would cost more than the reorder, the decoded keys [R, C, D, bs]."""
        if num_queries > TILE_PRODUCT_MAX_QUERIES:
            return super().key_operand(ids, num_queries)
        ids = ids.to(self.device).long()
        rows, count = ids.shape
        tiles = self._keys.index_select(0, ids.reshape(-1)).float()
        return tiles.view(rows, count * self.block_size // TILE, self.head_size // 2, 2 * TILE)

    def page_logits(self, queries: torch.Tensor, keys: torch.Tensor, visible: int) -> torch.Tensor:
        """q . k over the tile format: each query's even and odd dimensions times every (token, pair member) column
        of a tile, keeping the products whose pair members match. Twice the multiplies of a plain product, but no
        key is moved, which is what a memory-bound decode step pays for (`kvserve bench layouts`)."""
        if keys.shape[-2] == self.head_size:  # decoded keys [R, C, D, bs], not tiles [R, T, D / 2, 32]
            return super().page_logits(queries, keys, visible)
        rows, num_queries, dim = queries.shape
        tiles = visible * self.block_size // TILE
        by_member = queries.view(rows, num_queries, dim // 2, 2).permute(0, 3, 1, 2).reshape(rows, 1, -1, dim // 2)
        products = torch.matmul(by_member, keys[:, :tiles]).view(rows, tiles, 2, num_queries, TILE, 2)
        logits = products[:, :, 0, :, :, 0] + products[:, :, 1, :, :, 1]  # [R, tiles, M, 16]
        per_page = logits.view(rows, visible, self.block_size // TILE, num_queries, TILE)
        return per_page.transpose(2, 3).reshape(rows, visible, num_queries, self.block_size)

    def store_pages(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        ids = ids.to(self.device).long()
        bs, dim = self.block_size, self.head_size
        key_tiles = keys.to(self.dtype).reshape(-1, dim // 2, 2, bs // TILE, TILE).permute(0, 3, 1, 4, 2)
        value_tiles = values.to(self.dtype).reshape(-1, bs // 2, 2, dim // TILE, TILE).permute(0, 3, 1, 4, 2)
        self._keys.index_copy_(0, ids, key_tiles.reshape(ids.shape[0], -1))
        self._values.index_copy_(0, ids, value_tiles.reshape(ids.shape[0], -1))
