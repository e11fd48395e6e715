"""The evicting block manager: vLLM's full-attention manager that knows a request's cache may hold fewer entries
than it has logical tokens, and can return a compacted request's tail blocks to the pool.

vLLM sizes allocations from logical token counts (`num_computed_tokens + new`); for a compacted request we subtract
its offset there, so it asks only for the blocks its cache really needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager


class EvictingFullAttentionManager(FullAttentionManager):
    def init_eviction_state(self) -> None:
        self.evicted: dict[str, int] = {}  # request id -> logical tokens minus cache entries
        self.evicting: set[str] = set()  # requests that evict: never read or publish prefix-cache blocks
        self.admission_cap: dict[str, int] = {}  # per-chunk evicting requests: most entries they ever hold

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        offset = self.evicted.get(request_id, 0)
        num_tokens -= offset
        num_tokens_main_model -= offset
        if apply_admission_cap and request_id in self.admission_cap:
            # Admission reserves the whole prompt; a request that evicts after every chunk never holds more than
            # budget + one chunk, so that is what it must reserve.
            num_tokens = min(num_tokens, self.admission_cap[request_id])
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        offset = self.evicted.get(request_id, 0)
        return super().allocate_new_blocks(request_id, num_tokens - offset, num_tokens_main_model - offset)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Compaction rewrites blocks in place, so an evicting request's blocks must never enter the prefix cache.
        if request.request_id in self.evicting:
            return
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def truncate(self, request_id: str, keep_tokens: int, logical_tokens: int) -> int:
        """The worker compacted the request to `keep_tokens` entries: free the blocks past them. Returns #freed."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        keep_blocks = cdiv(keep_tokens, self.block_size)
        tail = blocks[keep_blocks:]
        del blocks[keep_blocks:]
        if request_id in self.num_cached_block:
            self.num_cached_block[request_id] = min(self.num_cached_block[request_id], keep_blocks)
        self.block_pool.free_blocks(reversed(tail))
        self.evicted[request_id] = logical_tokens - keep_tokens
        return len(tail)

    def pop_blocks_for_free(self, request_id: str):
        # Finish and preemption both land here: a preempted request recomputes from scratch, offset 0.
        self.evicted.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def forget(self, request_id: str) -> None:
        self.evicting.discard(request_id)
        self.admission_cap.pop(request_id, None)
        self.evicted.pop(request_id, None)
