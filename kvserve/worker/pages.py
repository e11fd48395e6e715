"""Head-granular pages: the unit kvserve stores, evicts and frees.

vLLM 0.32's CPU backend allocates every layer's cache as a view of ONE buffer, layer-outermost (layout LBHNC): layer
l's block b holds, per KV head h, a self-contained slab of `block_size` keys then `block_size` values. So the whole
buffer views, without a copy, as `[L * NB * H, 1, block_size, 2 * head_size]` pages, page `(l * NB + b) * H + h`
being `caches[l][b, h]`, and vLLM's own CPU ops read and write it when called on pseudo-sequences (one row per
(request, KV head), one KV head; `kvserve/worker/step.py`).

A request that evicts gets a `HeadPages`: one list of pages per (layer, KV head), each with its own length. Its pages
come from the vLLM blocks the scheduler gave it (each block is L * H pages, usable by ANY list of the request), so a
head that keeps fewer entries holds fewer pages, and once every page of a block is free the block goes back to
vLLM's pool. vLLM keeps counting in blocks; the scheduler charges a request `cdiv(pages + next step's need, L * H)`
blocks (`kvserve/vllm/kv_cache_manager.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.messages import StagePages, cdiv


@dataclass(frozen=True)
class PageLayout:
    num_layers: int
    num_blocks: int
    num_heads: int  # KV heads per layer
    block_size: int
    # Paged layers are counted over the model's paged layers only (all layers, or a hybrid model's full-attention
    # layers): this worker's first one is paged layer `first_layer` (> 0 on a later pipeline stage).
    first_layer: int = 0
    model_layers: int = 0  # paged layers of the whole model, on every stage (0: this worker's are all of them)
    # the model layer index of each of this worker's paged layers (empty: first_layer, first_layer + 1, ...)
    model_layer_ids: tuple[int, ...] = ()
    # tensor parallelism: this worker's KV heads are the model's first_head .. first_head + num_heads - 1
    first_head: int = 0
    model_heads: int = 0  # KV heads of the whole model (0: num_heads, one worker holds them all)

    @property
    def total_layers(self) -> int:
        return self.model_layers or self.first_layer + self.num_layers

    def local_index(self, model_layer: int) -> int:
        """This worker's cache position of a model layer (which must be paged)."""
        if not self.model_layer_ids:
            return model_layer - self.first_layer
        return self.model_layer_ids.index(model_layer)

    def model_layer(self, local: int) -> int:
        """The model layer index of this worker's cache position `local`."""
        return self.model_layer_ids[local] if self.model_layer_ids else self.first_layer + local

    @property
    def pages_per_block(self) -> int:
        return self.num_layers * self.num_heads

    def page_id(self, layer: np.ndarray | int, block: np.ndarray | int, head: np.ndarray | int):
        return (layer * self.num_blocks + block) * self.num_heads + head

    def block_of(self, page: np.ndarray | int):
        return (page // self.num_heads) % self.num_blocks


def check_cache_contract(kv_caches: list[torch.Tensor]) -> PageLayout:
    """The layout the page view relies on, checked on the worker's real KV-cache tensors of the paged layers (in
    layer order), or a RuntimeError that says which part of the contract this engine breaks."""
    if not kv_caches:
        raise RuntimeError("kvserve head pages: the engine has no KV cache")
    first = kv_caches[0]
    problems = []
    if first.dim() != 4:
        problems.append(f"a layer's cache has shape {tuple(first.shape)}, not [blocks, kv_heads, block_size, 2*D]")
    else:
        num_blocks, num_heads, block_size, two_dim = first.shape
        layer_bytes = first.numel() * first.element_size()
        storage = first.untyped_storage().data_ptr()
        if first.data_ptr() != storage:
            problems.append("layer 0 does not start the KV buffer (offset != 0)")
        for index, cache in enumerate(kv_caches):
            if cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous():
                problems.append(
                    f"layer {index} has shape {tuple(cache.shape)} {cache.dtype}, contiguous="
                    f"{cache.is_contiguous()}, unlike layer 0"
                )
            elif cache.untyped_storage().data_ptr() != storage:
                problems.append(f"layer {index} lives in another buffer than layer 0")
            elif cache.data_ptr() - storage != index * layer_bytes:
                problems.append(
                    f"layer {index} starts {cache.data_ptr() - storage} bytes into the buffer, not "
                    f"{index * layer_bytes} (layer-outermost layout)"
                )
    if problems:
        raise RuntimeError(
            "kvserve head pages need vLLM's CPU cache as one layer-outermost buffer (LBHNC); this "
            "engine's cache is not: " + "; ".join(problems[:3])
        )
    return PageLayout(len(kv_caches), num_blocks, num_heads, block_size)


def page_view(kv_caches: list[torch.Tensor], layout: PageLayout) -> torch.Tensor:
    """The whole KV buffer as `[L * NB * H, 1, block_size, 2 * D]` pages (a view: writes go to the cache)."""
    first = kv_caches[0]
    page_elems = layout.block_size * first.shape[-1]
    return first.as_strided(
        (layout.num_layers * layout.num_blocks * layout.num_heads, 1, layout.block_size, first.shape[-1]),
        (page_elems, page_elems, first.shape[-1], 1),
        0,
    )


@functools.lru_cache(maxsize=8)
def _list_index(num_layers: int, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays [L, 1, 1] and [1, H, 1] that pick each list's row of a table [L, H, W] (with a third index)."""
    return np.arange(num_layers)[:, None, None], np.arange(num_heads)[None, :, None]


class HeadPages:
    """One request's page lists, per (layer, KV head), over the pages of the vLLM blocks it holds.

    `table[l, h, i]` is the page holding entries `i * bs .. (i + 1) * bs - 1` of list (l, h); `lens[l, h]` its
    entries. `used[j, l, h]` tells whether page (l, blocks[j], h) is in some list. A new page for list (l, h) comes
    from its own column (l, h) of the earliest block that has it free, so a request whose lists all keep the same
    count uses exactly vLLM's own slots ("derived" pages) and frees whole tail blocks without moving anything.
    """

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self.blocks: list[int] = []
        self.used = np.zeros((0, layout.num_layers, layout.num_heads), dtype=bool)
        # per block: its contents must not change (a prefix-cache block, or one another request holds); no page of
        # it is ever taken, and it goes back to vLLM after the step that compacts
        self.protected = np.zeros(0, dtype=bool)
        self.table = np.zeros((layout.num_layers, layout.num_heads, 0), dtype=np.int64)
        self.lens = np.zeros((layout.num_layers, layout.num_heads), dtype=np.int64)

    @property
    def pages_in_use(self) -> int:
        return int(self.used.sum())

    def page_counts(self) -> np.ndarray:
        return cdiv(self.lens, self.layout.block_size)

    def add_blocks(self, block_ids: list[int]) -> None:
        self.blocks.extend(block_ids)
        fresh = np.zeros((len(block_ids), *self.used.shape[1:]), dtype=bool)
        self.used = np.concatenate([self.used, fresh])
        self.protected = np.concatenate([self.protected, np.zeros(len(block_ids), dtype=bool)])

    def adopt_prefix(self, block_ids: list[int], tokens: int) -> None:
        """A prefix-cache hit: the request starts with `tokens` entries that vLLM's cached blocks `block_ids[:tokens
        / bs]` hold in its own layout (page j of list (l, h) is page (l, h) of block j), as a request that computed
        them itself would hold them before any compaction."""
        bs = self.layout.block_size
        if self.blocks or tokens % bs:
            raise RuntimeError(f"kvserve: a prefix hit of {tokens} tokens must be whole blocks of a fresh request")
        full = tokens // bs
        self.add_blocks(block_ids[:full])
        self.used[:] = True
        layers, heads = np.meshgrid(np.arange(self.layout.num_layers), np.arange(self.layout.num_heads), indexing="ij")
        blocks = np.asarray(self.blocks, dtype=np.int64)
        self.table = self.layout.page_id(layers[..., None], blocks[None, None, :], heads[..., None]).astype(np.int64)
        self.lens[:] = tokens

    def protect(self, block_ids: tuple[int, ...]) -> None:
        """Mark blocks whose contents must stay as they are (`protected`)."""
        wanted = set(block_ids)
        self.protected = np.array([block in wanted for block in self.blocks], dtype=bool)
        if int(self.protected.sum()) != len(wanted):
            raise RuntimeError("kvserve: asked to protect blocks the request's page lists do not hold")

    def relocate(self, layer: int, keep_pages: np.ndarray) -> list[tuple[int, int]]:
        """Before layer `layer` compacts in place: each head's first `keep_pages[h]` pages, the ones the compaction
        writes, move out of protected blocks into free pages of the request's other blocks. Returns the page
        copies (src, dst) the caller must make before the compaction reads the lists."""
        moves = []
        for head, count in enumerate(keep_pages):
            for index in range(int(count)):
                page = int(self.table[layer, head, index])
                position = self._position(page)
                if not self.protected[position[0]]:
                    continue
                destination = self._take(layer, head)
                self.used[position] = False  # never taken again: its block is protected
                self.table[layer, head, index] = destination
                moves.append((page, destination))
        return moves

    def append(self, tokens: int) -> np.ndarray:
        """Append `tokens` entries to every list; returns their cache slots `[L, H, tokens]` (page * bs + offset)."""
        bs = self.layout.block_size
        have = self.page_counts()
        new_lens = self.lens + tokens
        need = cdiv(new_lens, bs)
        growing = need > have
        if growing.any():  # at most once per block of tokens: a decode step mostly appends inside its last pages
            width = int(need.max())
            if width > self.table.shape[2]:
                self.table = np.pad(self.table, ((0, 0), (0, 0), (0, width - self.table.shape[2])))
            for layer, head in np.argwhere(growing):
                for index in range(have[layer, head], need[layer, head]):
                    self.table[layer, head, index] = self._take(layer, head)
        positions = self.lens[:, :, None] + np.arange(tokens)
        layers, heads = _list_index(*self.lens.shape)
        pages = self.table[layers, heads, positions // bs]
        self.lens = new_lens
        return pages * bs + positions % bs

    def _unavailable(self) -> np.ndarray:
        """[blocks, L, H]: pages no list may take (in use, or in a protected block)."""
        return self.used | self.protected[:, None, None]

    def _take(self, layer: int, head: int) -> int:
        taken = self._unavailable()
        free = np.flatnonzero(~taken[:, layer, head])
        if free.size:
            index = (int(free[0]), layer, head)
        else:  # this column is full: any free page of the request's blocks serves
            anywhere = np.flatnonzero(~taken.reshape(-1))
            if not anywhere.size:
                raise RuntimeError(
                    f"kvserve: no free page in the request's {len(self.blocks)} blocks (the "
                    "scheduler granted fewer blocks than the page lists need)"
                )
            index = tuple(int(i) for i in np.unravel_index(int(anywhere[0]), taken.shape))
        self.used[index] = True
        block, page_layer, page_head = index
        return int(self.layout.page_id(page_layer, self.blocks[block], page_head))

    def _position(self, page: int) -> tuple[int, int, int]:
        """(block index j, layer, head) of a page of this request."""
        layout = self.layout
        head = page % layout.num_heads
        block = (page // layout.num_heads) % layout.num_blocks
        layer = page // (layout.num_heads * layout.num_blocks)
        return self.blocks.index(block), layer, head

    def shrink(self, layer: int, counts: np.ndarray) -> None:
        """Layer `layer`'s lists now hold `counts[h]` entries (a compaction kept them at the front): pages past them
        return to the request's free pages."""
        keep_pages = cdiv(counts, self.layout.block_size)
        for head, kept in enumerate(keep_pages):
            for index in range(int(kept), int(cdiv(self.lens[layer, head], self.layout.block_size))):
                self.used[self._position(int(self.table[layer, head, index]))] = False
                self.table[layer, head, index] = 0
        self.lens[layer] = counts

    def truncate(self, tokens: int) -> None:
        """Drop the last `tokens` entries of every list (a step's rejected draft tokens); the next append reuses
        their slots."""
        if tokens:
            for layer in range(self.layout.num_layers):
                self.shrink(layer, self.lens[layer] - tokens)

    def live_pages(self) -> np.ndarray:
        """Pages in use per block (in `blocks` order)."""
        return self.used.sum(axis=(1, 2))

    def stage_pages(self) -> StagePages:
        """These lists as one stage's part of the request's page report."""
        return StagePages(
            pages=self.pages_in_use,
            free_slots=self.free_slot_counts(),
            pages_per_block=self.layout.pages_per_block,
            longest=int(self.lens.max(initial=0)),
            entries=int(self.lens.sum()),
        )

    def release_blocks(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Give back every block the lists can do without (one worker holds every layer): see `blocks_to_release`.
        Returns (page moves (src, dst), the released vLLM block ids)."""
        released = blocks_to_release(
            self.blocks,
            [(self.pages_in_use, self.layout.pages_per_block, self.live_pages())],
            self.protected_ids(),
        )
        return self.release(released), released

    def protected_ids(self) -> list[int]:
        return [block for block, protected in zip(self.blocks, self.protected, strict=True) if protected]

    def release(self, released_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
        """Give back the vLLM blocks `released_ids`: move the live pages they hold into free pages of the others.
        Returns the page moves (src, dst); the caller copies the pages before anything reads them."""
        if not released_ids:
            return []
        gone = set(released_ids)
        kept = [index for index, block in enumerate(self.blocks) if block not in gone]
        released = [index for index, block in enumerate(self.blocks) if block in gone]
        if len(released) != len(gone):
            raise RuntimeError("kvserve: asked to give back blocks the request's page lists do not hold")
        moves = []
        valid = np.arange(self.table.shape[2]) < self.page_counts()[:, :, None]
        for block in released:
            for page_layer, page_head in np.argwhere(self.used[block]):
                source = int(self.layout.page_id(page_layer, self.blocks[block], page_head))
                self.used[block, page_layer, page_head] = False
                destination = self._take_in(kept, page_layer, page_head)
                layer, head, index = np.argwhere((self.table == source) & valid)[0]
                self.table[layer, head, index] = destination
                moves.append((source, destination))
        self.blocks = [self.blocks[block] for block in kept]
        self.used = self.used[kept]
        self.protected = self.protected[kept]
        return moves

    def _take_in(self, blocks: list[int], layer: int, head: int) -> int:
        """A free page among `blocks` (indices), its own column first."""
        candidates = self._unavailable()[blocks]
        free = np.flatnonzero(~candidates[:, layer, head])
        if free.size:
            index = (blocks[int(free[0])], layer, head)
        else:
            block, page_layer, page_head = np.unravel_index(
                int(np.flatnonzero(~candidates.reshape(-1))[0]), candidates.shape
            )
            index = (blocks[int(block)], int(page_layer), int(page_head))
        self.used[index] = True
        return int(self.layout.page_id(index[1], self.blocks[index[0]], index[2]))

    def free_slot_counts(self) -> tuple[int, ...]:
        """How many lists have f free slots in their last page, for f = 0 .. bs-1 (an empty list counts as 0): the
        scheduler's exact page demand for any number of new tokens (`pages_needed`)."""
        bs = self.layout.block_size
        free = (-self.lens) % bs
        return tuple(int(c) for c in np.bincount(free.reshape(-1), minlength=bs))


def blocks_to_release(
    block_ids: list[int], stages: list[tuple[int, int, np.ndarray]], protected: list[int] | tuple[int, ...] = ()
) -> list[int]:
    """The blocks a request can give back, from each stage's (pages in use, pages per block, live pages per block):
    it keeps the most blocks any stage needs, `max cdiv(pages, pages per block)`, choosing those with the most live
    pages over all stages (earlier blocks on ties), so the fewest pages move; every stage then moves its live pages
    out of the others. One worker without pipeline parallelism is a single stage. `protected` blocks (prefix-cache
    blocks the compaction did not write) always go back, so nothing is ever written into them."""
    target = max(cdiv(pages, per_block) for pages, per_block, _ in stages)
    shut = set(protected)
    candidates = [index for index, block in enumerate(block_ids) if block not in shut]
    if target > len(candidates):
        raise RuntimeError(f"kvserve: {target} blocks needed, only {len(candidates)} may be written")
    if len(block_ids) <= target:
        return []
    live = sum(np.asarray(per_block_live) for _, _, per_block_live in stages)
    order = sorted(candidates, key=lambda index: -int(live[index]))  # fullest first, earlier blocks on ties
    kept = set(order[:target])
    return [block for index, block in enumerate(block_ids) if index not in kept]


def copy_pages(pages: torch.Tensor, moves: list[tuple[int, int]]) -> None:
    """Copy whole pages (src, dst) of the page view: a page is one self-contained slab, so this is right in every
    cache format (vec, AMX)."""
    if moves:
        sources, destinations = (torch.tensor(ids) for ids in zip(*moves, strict=True))
        pages.index_copy_(0, destinations, pages.index_select(0, sources))
