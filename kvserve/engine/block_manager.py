"""The evicting block manager: vLLM's full-attention manager that charges an evicting request by its head pages.

vLLM sizes allocations in blocks from logical token counts (`num_computed_tokens + new`). Once an evicting request
has compacted, its (layer, KV head) lists hold fewer entries than it has tokens, each list its own count, and a
block is just `L * H` pages any list may use (`kvserve/engine/pages.py`). So for such a request the manager
replaces the token count by the token equivalent of its pages: `cdiv(pages + need, L * H)` blocks, where `need` is
exactly the pages the new tokens will take (from the worker's last `PageReport`). Under pipeline parallelism each
stage holds its own layers' pages in the same blocks, so the request needs the most blocks any stage needs.
Admission, preemption and `vllm:kv_cache_usage_perc` then follow what the request really holds, up to one block of
rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from kvserve.engine.pages import pages_needed
from kvserve.engine.plan import PageReport


class EvictingFullAttentionManager(FullAttentionManager):
    def init_eviction_state(self, pages_per_block: int) -> None:
        self.pages_per_block = pages_per_block  # layers x KV heads, all pipeline stages together
        self.reports: dict[str, PageReport] = {}  # request id -> its lists at its last compaction
        self.evicting: set[str] = set()  # requests that evict: never read or publish prefix-cache blocks
        self.admission_cap: dict[str, int] = {}  # per-chunk evicting requests: most entries they ever hold

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
        return super().get_num_blocks_to_allocate(
            request_id,
            self._page_tokens(request_id, num_tokens),
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            self._page_tokens(request_id, num_tokens_main_model),
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        return super().allocate_new_blocks(
            request_id, self._page_tokens(request_id, num_tokens), self._page_tokens(request_id, num_tokens_main_model)
        )

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Compaction rewrites pages in place, so an evicting request's blocks must never enter the prefix cache.
        if request.request_id in self.evicting:
            return
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def apply_report(self, request_id: str, report: PageReport) -> int:
        """The worker compacted the request: free the blocks it emptied, remember its pages. Returns #freed."""
        blocks = self.req_to_blocks.get(request_id, [])
        released = set(report.released_block_ids)
        freed = [block for block in blocks if block.block_id in released]
        if len(freed) != len(released):
            raise RuntimeError(f"kvserve: the worker released blocks request {request_id} does not hold")
        blocks[:] = [block for block in blocks if block.block_id not in released]
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = min(self.num_cached_block[request_id], len(blocks))
        self.block_pool.free_blocks(reversed(freed))
        self.reports[request_id] = report
        return len(freed)

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
        self.evicting.discard(request_id)
        self.admission_cap.pop(request_id, None)
        self.reports.pop(request_id, None)
