"""The evicting block manager: vLLM's full-attention manager that charges an evicting request by its head pages.

vLLM sizes allocations in blocks from logical token counts (`num_computed_tokens + new`). Once an evicting request
has compacted, its (layer, KV head) lists hold fewer entries than it has tokens, each list its own count, and a
block is just `L * H` pages any list may use (`kvserve/engine/pages.py`). So for such a request the manager
replaces the token count by the token equivalent of its pages: `cdiv(pages + need, L * H)` blocks, where `need` is
exactly the pages the new tokens will take (from the worker's last `PageReport`). Under pipeline parallelism each
stage holds its own layers' pages in the same blocks, so the request needs the most blocks any stage needs.
Admission, preemption and `vllm:kv_cache_usage_perc` then follow what the request really holds, up to one block of
rounding.

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
from collections.abc import Callable, Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from kvserve.config import PrefixSharing
from kvserve.engine.pages import pages_needed
from kvserve.engine.plan import PageReport
from kvserve.metrics import metrics


class EvictingFullAttentionManager(FullAttentionManager):
    def init_eviction_state(
        self,
        pages_per_block: int,
        requests: dict,
        compaction_at: Callable[[str, int], int | None],
        max_blocks_per_request: int,
    ) -> None:
        self.pages_per_block = pages_per_block  # layers x KV heads, all pipeline stages together
        self.reports: dict[str, PageReport] = {}  # request id -> its lists at its last compaction
        self.sharing: dict[str, PrefixSharing] = {}  # evicting requests: how each shares the prefix cache
        self.private: set[str] = set()  # evicting requests that stopped publishing (no room for a compaction's copy)
        self.spare: dict[str, int] = {}  # request id -> spare blocks its allocation this step adds
        self.spare_taken: dict[str, int] = {}  # request id -> spare blocks its last allocation added
        self.resuming_request = False  # the hit being allocated is a checkpoint's (`_has_partial_local_hit`)
        self.admission_cap: dict[str, int] = {}  # per-chunk evicting requests: most entries they ever hold
        self.requests = requests  # the scheduler's requests, by id
        self.compaction_at = compaction_at  # (request id, tokens after a step) -> entries it keeps then, or None
        self.max_blocks_per_request = max_blocks_per_request  # the worker's block-table rows hold no more

    def publishes(self, request_id: str) -> bool:
        """Whether the request's complete blocks enter the prefix cache now (a plain request's always do)."""
        sharing = self.sharing.get(request_id)
        if sharing is None:
            return True
        return sharing.publishes and request_id not in self.private and request_id not in self.reports

    def protected_blocks(self, request_id: str) -> tuple[int, ...]:
        """The request's blocks a compaction must not write: in the prefix cache, or held by another request."""
        return tuple(
            block.block_id
            for block in self.req_to_blocks.get(request_id, ())
            if not self.block_pool.is_block_writable(block)
        )

    def _spare_blocks(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence) -> int:
        """Blocks a step ending at `num_tokens` needs beside its tokens' for a compaction's copies out of protected
        blocks: one page per (layer, head) and kept page that lies in a protected block."""
        sharing = self.sharing.get(request_id)
        if sharing is None:
            return 0
        # (a compacted request holds protected blocks only if it resumed from a checkpoint or published one)
        keep = self.compaction_at(request_id, num_tokens)
        if keep is None:
            return 0
        held = self.req_to_blocks.get(request_id, ())
        protected = len(new_computed_blocks) + sum(not self.block_pool.is_block_writable(b) for b in held)
        if self.publishes(request_id):  # this step's allocation publishes every complete block up to num_tokens
            request = self.requests[request_id]
            protected = max(protected, min(num_tokens, request.num_tokens) // self.block_size)
        return min(cdiv(keep, self.block_size) + sharing.spare_blocks, protected)

    def _stop_publishing(self, request_id: str) -> None:
        """No room for a compaction's copy: the request's blocks that only it holds leave the prefix cache (they are
        compacted in place; a checkpoint among them is gone with them), and it publishes nothing more. Blocks others
        hold stay protected."""
        self.private.add(request_id)
        metrics().prefix_publish_fallbacks.inc()
        blocks = self.req_to_blocks.get(request_id, [])
        for block in blocks:
            if block.ref_cnt == 1 and block.block_hash is not None:
                self.block_pool._maybe_evict_cached_block(block)
        # others hold a prefix of the cached blocks (they hit it), so what stays cached is a prefix too
        still_cached = 0
        while still_cached < len(blocks) and blocks[still_cached].block_hash is not None:
            still_cached += 1
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = still_cached

    def pages_held(self, request_id: str, num_tokens: int) -> int | None:
        """Pages a compacted request's lists hold once they cover `num_tokens` logical tokens, over all stages
        (None: never compacted, all lists hold every token)."""
        stages = self._stage_pages(request_id, num_tokens)
        return None if stages is None else sum(pages for pages, _ in stages)

    def blocks_held(self, request_id: str, num_tokens: int) -> int | None:
        """Blocks a compacted request needs once its lists cover `num_tokens` logical tokens: the most any stage
        needs for its pages (None: never compacted)."""
        stages = self._stage_pages(request_id, num_tokens)
        return None if stages is None else max(cdiv(pages, per_block) for pages, per_block in stages)

    def _stage_pages(self, request_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Per pipeline stage: (pages its lists hold once they cover `num_tokens` logical tokens, pages per block)."""
        report = self.reports.get(request_id)
        if report is None:
            return None
        new_tokens = max(num_tokens - report.logical_tokens, 0)
        return [
            (stage.pages + pages_needed(stage.free_slots, new_tokens), stage.pages_per_block) for stage in report.stages
        ]

    def longest_list(self, request_id: str, num_tokens: int) -> int:
        """Entries in the request's longest list once it covers `num_tokens` logical tokens."""
        report = self.reports.get(request_id)
        return num_tokens if report is None else report.longest + num_tokens - report.logical_tokens

    def evicted_tokens(self, request_id: str) -> int:
        """Tokens of the sequence no longer in the cache, averaged over the (layer, head) lists."""
        report = self.reports.get(request_id)
        if report is None:
            return 0
        return report.logical_tokens - round(report.entries / self.pages_per_block)

    def _page_tokens(self, request_id: str, num_tokens: int) -> int:
        blocks = self.blocks_held(request_id, num_tokens)
        return num_tokens if blocks is None else blocks * self.block_size

    def _has_partial_local_hit(self, new_computed_blocks: Sequence, num_local_computed_tokens: int) -> bool:
        # A checkpoint's blocks hold compacted lists, not the first tokens of the hit: a hit that ends inside a block
        # (a turn checkpoint) has no partial block to copy.
        if self.resuming_request:
            return False
        return super()._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)

    @contextlib.contextmanager
    def _hit_of(self, request_id: str, new_computed_blocks: Sequence):
        """While vLLM sizes or adds a hit: whether it is a checkpoint's (a request has a page report before its first
        step only when it resumes from one)."""
        self.resuming_request = bool(new_computed_blocks) and request_id in self.reports
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
        if apply_admission_cap and request_id in self.admission_cap and request_id not in self.reports:
            # Admission reserves the whole prompt; a request that evicts after every chunk never holds more than
            # budget + one chunk, so that is what it must reserve.
            num_tokens = min(num_tokens, self.admission_cap[request_id])

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
        if apply_admission_cap:  # the whole-sequence admission check; the step's own allocation adds the spares
            return needed
        spare = self._spare_blocks(request_id, num_tokens, new_computed_blocks)
        row_room = self.max_blocks_per_request - cdiv(num_tokens, self.block_size)
        room = min(self.block_pool.get_num_free_blocks() - needed, row_room)
        if 0 <= room < spare and request_id not in self.private:
            self._stop_publishing(request_id)
            spare = self._spare_blocks(request_id, num_tokens, new_computed_blocks)
        # beyond a row's width no spare fits: a compaction short of pages fails its request with the reason
        spare = min(spare, max(row_room, 0))
        self.spare[request_id] = spare
        # the spares are whole blocks past the tokens' (allocate_new_blocks adds them the same way)
        return needed if not spare else blocks_for(num_tokens + spare * self.block_size)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        self.spare_taken[request_id] = self.spare.pop(request_id, 0)
        spare_tokens = self.spare_taken[request_id] * self.block_size
        return super().allocate_new_blocks(
            request_id,
            self._page_tokens(request_id, num_tokens) + spare_tokens,
            self._page_tokens(request_id, num_tokens_main_model),
        )

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # A compacted request's blocks hold compacted lists, not its tokens: they never enter the prefix cache.
        if not self.publishes(request.request_id):
            return
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, *args, **kwargs)
        if request.request_id in self.sharing:
            metrics().prefix_blocks_published.inc(self.num_cached_block.get(request.request_id, 0) - before)

    def apply_report(self, request_id: str, report: PageReport) -> int:
        """The worker compacted the request: free the blocks it emptied, remember its pages. Returns the blocks the
        compaction saved: those it gave back less the spare blocks its step took for copies out of protected ones."""
        blocks = self.req_to_blocks.get(request_id, [])
        spares = self.spare_taken.pop(request_id, 0)  # the step's spare blocks for copies out of protected ones
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
        self.reports[request_id] = report
        return len(freed) - spares

    def evict_last(self, blocks: Sequence) -> None:
        """Moves these cached free blocks to the back of vLLM's free queue, in order: vLLM reuses (and so evicts) free
        blocks from the front, so they go after every other free block, the last one last of all."""
        queue = self.block_pool.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and block.prev_free_block is not None:  # free (a held block is in no queue)
                queue.remove(block)
                queue.append(block)

    def free_pages_held(self, running: dict[str, int]) -> int:
        """Free pages inside the blocks of compacted requests (`running`: request id -> logical tokens now)."""
        free = 0
        for request_id, num_tokens in running.items():
            pages = self.pages_held(request_id, num_tokens)
            if pages is not None:
                free += len(self.req_to_blocks.get(request_id, ())) * self.pages_per_block - pages
        return free

    def pop_blocks_for_free(self, request_id: str):
        # Finish and preemption both land here: a preempted request recomputes from scratch, every list full.
        self.reports.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def forget(self, request_id: str) -> None:
        self.sharing.pop(request_id, None)
        self.private.discard(request_id)
        self.spare.pop(request_id, None)
        self.spare_taken.pop(request_id, None)
        self.admission_cap.pop(request_id, None)
        self.reports.pop(request_id, None)
