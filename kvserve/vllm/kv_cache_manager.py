"""vLLM's full-attention KV-cache manager, charging a compacted request by its head pages
(`EvictingFullAttentionManager`, swapped in by `EvictingScheduler`; its overrides are points of
`kvserve/vllm/points.py`).

vLLM sizes allocations in blocks from logical token counts (`num_computed_tokens + new`). Once a request has
compacted, the manager replaces that token count by the token equivalent of the blocks its record says it needs
(`CoreRequest.blocks_held`), so admission, preemption and `vllm:kv_cache_usage_perc` follow what the request really
holds, up to one block of rounding.

Prefix caching. An evicting request reads and publishes prefix-cache blocks like any other (`PrefixSharing` says
which it may): its blocks enter the cache as vLLM fills them, until its first compaction. A compaction must then not
write into a block the cache or another request holds (vLLM's `is_block_writable` is false for it: "protected"),
so the step that compacts gets spare blocks beside its tokens' (`cdiv(B, bs)` at most, fewer when fewer blocks are
protected); the worker copies the pages it will write out of the protected blocks into them, compacts in place, and
gives every protected block back, where vLLM keeps it, hash and all, as a cached free block. When the pool has no
room for the spare blocks, the request stops publishing instead: blocks only it holds leave the cache and are
compacted in place (`kvserve:prefix_publish_fallbacks`); only blocks others hold still need copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

from kvserve.core.checkpoints import block_key
from kvserve.core.compaction import compaction_after
from kvserve.core.record import CoreRequest, Progress
from kvserve.core.requests import CoreRequests
from kvserve.messages import PageReport, cdiv
from kvserve.metrics import metrics
from kvserve.vllm.points import UNANNOUNCED


def progress_of(request: Request, computed: int | None = None) -> Progress:
    """What the core's rules read of a vLLM request (`computed`: in place of its num_computed_tokens)."""
    return Progress(
        tokens=request.all_token_ids,
        prompt_tokens=request.num_prompt_tokens,
        computed=request.num_computed_tokens if computed is None else computed,
        block_hashes=request.block_hashes,
    )


def keep_after(core: CoreRequests, record: CoreRequest, request: Request, num_tokens: int) -> int | None:
    """The entries the request compacts to after a step that ends at `num_tokens` logical tokens, asked while the
    step is allocated or its hit sized (before the scheduler advances the request), or None. Tokens past the
    request's sequence are draft tokens (speculative decoding): such a step never compacts."""
    num_new = num_tokens - request.num_computed_tokens
    drafts = max(num_tokens - request.num_tokens, 0)
    progress = progress_of(request)
    return compaction_after(record, progress, num_tokens, num_new, core.block_size, core.under_pressure, drafts)[1]


class EvictingFullAttentionManager(FullAttentionManager):
    def attach(self, core: CoreRequests, requests: dict[str, Request], max_blocks_per_request: int) -> None:
        """Called once by the scheduler, right after it swapped this class in."""
        self.core = core
        self.requests = requests  # the scheduler's vLLM requests, by id
        self.max_blocks_per_request = max_blocks_per_request  # the worker's block-table rows hold no more
        self.resuming_request = False  # the hit being allocated is a checkpoint's (`_has_partial_local_hit`)

    def protected_blocks(self, request_id: str) -> tuple[int, ...]:
        """The request's blocks a compaction must not write: in the prefix cache, or held by another request."""
        return tuple(
            block.block_id
            for block in self.req_to_blocks.get(request_id, ())
            if not self.block_pool.is_block_writable(block)
        )

    def blocks_of(self, block_ids: Sequence[int]) -> list:
        return [self.block_pool.blocks[block_id] for block_id in block_ids]

    def _spare_blocks(self, record: CoreRequest, num_tokens: int, new_computed_blocks: Sequence) -> int:
        """Blocks a step ending at `num_tokens` needs beside its tokens' for a compaction's copies out of protected
        blocks: one page per (layer, head) and kept page that lies in a protected block."""
        request = self.requests[record.request_id]
        # (a compacted request holds protected blocks only if it resumed from a checkpoint or published one)
        keep = keep_after(self.core, record, request, num_tokens)
        if keep is None:
            return 0
        held = self.req_to_blocks.get(record.request_id, ())
        protected = len(new_computed_blocks) + sum(not self.block_pool.is_block_writable(b) for b in held)
        if record.publishes:  # this step's allocation publishes every complete block up to num_tokens
            protected = max(protected, min(num_tokens, request.num_tokens) // self.block_size)
        return min(cdiv(keep, self.block_size) + record.sharing.spare_blocks, protected)

    def _stop_publishing(self, record: CoreRequest) -> None:
        """No room for a compaction's copy: the request's blocks that only it holds leave the prefix cache (they are
        compacted in place; a checkpoint among them is gone with them), and it publishes nothing more. Blocks others
        hold stay protected."""
        record.private = True
        metrics().prefix_publish_fallbacks.inc()
        blocks = self.req_to_blocks.get(record.request_id, [])
        for block in blocks:
            if block.ref_cnt == 1 and block.block_hash is not None:
                self.block_pool._maybe_evict_cached_block(block)
        # others hold a prefix of the cached blocks (they hit it), so what stays cached is a prefix too
        still_cached = 0
        while still_cached < len(blocks) and blocks[still_cached].block_hash is not None:
            still_cached += 1
        if record.request_id in self.num_cached_block:
            self.num_cached_block[record.request_id] = still_cached

    def _page_tokens(self, request_id: str, num_tokens: int) -> int:
        record = self.core.get(request_id)
        blocks = None if record is None else record.blocks_held(num_tokens)
        return num_tokens if blocks is None else blocks * self.block_size

    def _has_partial_local_hit(self, new_computed_blocks: Sequence, num_local_computed_tokens: int) -> bool:
        # A checkpoint's blocks hold compacted lists, not the first tokens of the hit: a hit that ends inside a block
        # (a turn checkpoint) has no partial block to copy.
        if self.resuming_request:
            return False
        return super()._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)

    @contextlib.contextmanager
    def _hit_of(self, request_id: str, new_computed_blocks: Sequence):
        """While vLLM sizes or adds a hit: whether it is a checkpoint's (a request is compacted before its first step
        only when it resumes from one)."""
        record = self.core.get(request_id)
        self.resuming_request = bool(new_computed_blocks) and record is not None and record.compacted
        try:
            yield
        finally:
            self.resuming_request = False

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence, *args, **kwargs) -> None:
        with self._hit_of(request_id, new_computed_blocks):
            super().add_local_computed_blocks(request_id, new_computed_blocks, *args, **kwargs)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        record = self.core.get(request_id)
        if apply_admission_cap and record is not None and record.admission_cap is not None and not record.compacted:
            # Admission reserves the whole prompt; a request that evicts after every chunk never holds more than
            # budget + one chunk, so that is what it must reserve.
            num_tokens = min(num_tokens, record.admission_cap)

        def blocks_for(tokens: int) -> int:
            with self._hit_of(request_id, new_computed_blocks):
                return super(EvictingFullAttentionManager, self).get_num_blocks_to_allocate(
                    request_id,
                    self._page_tokens(request_id, tokens),
                    new_computed_blocks,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    self._page_tokens(request_id, num_tokens_main_model),
                    apply_admission_cap=apply_admission_cap,
                    prefill_end=prefill_end,
                )

        needed = blocks_for(num_tokens)
        if apply_admission_cap or record is None:  # the whole-sequence admission check: the step adds the spares
            return needed
        # whether the step compacts is read off the target's tokens: `num_tokens` adds a draft model's lookahead slots
        # (vLLM's num_lookahead_tokens), which are no tokens of the sequence
        spare = self._spare_blocks(record, num_tokens_main_model, new_computed_blocks) if record.evicts else 0
        row_room = self.max_blocks_per_request - cdiv(num_tokens, self.block_size)
        room = min(self.block_pool.get_num_free_blocks() - needed, row_room)
        if 0 <= room < spare and not record.private:
            self._stop_publishing(record)
            spare = self._spare_blocks(record, num_tokens_main_model, new_computed_blocks)
        # beyond a row's width no spare fits: a compaction short of pages fails its request with the reason
        spare = min(spare, max(row_room, 0))
        record.spare_blocks = spare
        # the spares are whole blocks past the tokens' (allocate_new_blocks adds them the same way)
        return needed if not spare else blocks_for(num_tokens + spare * self.block_size)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        record = self.core.get(request_id)
        spare = 0
        if record is not None:
            spare = record.spare_taken = record.spare_blocks
            record.spare_blocks = 0
        return super().allocate_new_blocks(
            request_id,
            self._page_tokens(request_id, num_tokens) + spare * self.block_size,
            self._page_tokens(request_id, num_tokens_main_model),
        )

    def cache_blocks(self, request: Request, num_tokens: int, *args, **kwargs) -> None:
        # A compacted request's blocks hold compacted lists, not its tokens: they never enter the prefix cache.
        record = self.core.get(request.request_id)
        if record is not None and not record.publishes:
            return
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, *args, **kwargs)
        if record is not None and record.evicts:
            metrics().prefix_blocks_published.inc(self.num_cached_block.get(request.request_id, 0) - before)

    def apply_report(self, request_id: str, report: PageReport) -> None:
        """The workers compacted the request: free the blocks they emptied; from now on it is charged by the report's
        pages (`CoreRequests.compacted`)."""
        blocks = self.req_to_blocks.get(request_id, [])
        released = set(report.released_block_ids)
        freed = [block for block in blocks if block.block_id in released]
        if len(freed) != len(released):
            raise RuntimeError(f"kvserve: the worker released blocks request {request_id} does not hold")
        blocks[:] = [block for block in blocks if block.block_id not in released]
        if any(not self.block_pool.is_block_writable(block) for block in blocks):
            raise RuntimeError(f"kvserve: request {request_id} kept a shared block after compacting")
        if request_id in self.num_cached_block:  # its cached blocks all went back (they were protected)
            self.num_cached_block[request_id] = 0
        # cached blocks keep their hashes in the pool: later requests still hit them until vLLM reuses the block
        self.block_pool.free_blocks(reversed(freed))
        self.core.compacted(self.core.records[request_id], report, len(freed))

    def cache_checkpoint(self, request_id: str, key: bytes, block_ids: Sequence[int], group: int) -> tuple[bytes, ...]:
        """A checkpoint's blocks (the request's) enter vLLM's prefix cache under block hashes of their own, derived
        from its key. Returns the hashes. KV-cache events announce neither their storing nor their removal: they hold
        compacted lists, not the tokens a `BlockStored` would name (`patches._patch_removed_events`)."""
        by_id = {block.block_id: block for block in self.req_to_blocks.get(request_id, [])}
        hashes = []
        for index, block_id in enumerate(block_ids):
            block_hash = make_block_hash_with_group_id(BlockHash(block_key(key, index)), group)
            self.block_pool._insert_block_hash(block_hash, by_id[block_id], self.block_size)
            hashes.append(block_hash)
        if self.block_pool.enable_kv_cache_events:  # without events there is nothing to keep quiet
            self.block_pool.__dict__.setdefault(UNANNOUNCED, set()).update(hashes)
        return tuple(hashes)

    def cached_block_id(self, block_hash: bytes) -> int | None:
        """The block vLLM's prefix cache maps `block_hash` to, if any."""
        block = self.block_pool.cached_block_hash_to_block.get_one_block(block_hash)
        return None if block is None else block.block_id

    def evict_last(self, block_ids: Sequence[int]) -> None:
        """Moves these cached free blocks to the back of vLLM's free queue, in order: vLLM reuses (and so evicts) free
        blocks from the front, so they go after every other free block, the last one last of all."""
        queue = self.block_pool.free_block_queue
        for block in self.blocks_of(block_ids):
            if block.ref_cnt == 0 and block.prev_free_block is not None:  # free (a held block is in no queue)
                queue.remove(block)
                queue.append(block)

    def free_pages_held(self) -> int:
        """Free pages inside the blocks of compacted requests (vLLM's usage counts those blocks whole)."""
        free = 0
        for request_id, record in self.core.records.items():
            request = self.requests.get(request_id)
            pages = None if request is None else record.pages_held(request.num_computed_tokens)
            if pages is not None:
                free += len(self.req_to_blocks.get(request_id, ())) * self.core.pages_per_block - pages
        return free

    def pop_blocks_for_free(self, request_id: str):
        # Finish and preemption both land here: a preempted request recomputes from scratch, every list full.
        record = self.core.get(request_id)
        if record is not None:
            self.core.preempted(record)
        return super().pop_blocks_for_free(request_id)
