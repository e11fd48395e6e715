"""The engine core's requests, one record each (`kvserve/core/record.py`), and the events of a request's life in one
place (`CoreRequests`: admit, compact, publish, resume, preempt, finish, fail). The scheduler and the KV-cache
manager (`kvserve/vllm/`) both read and change requests through them; vLLM's own `Request` stays vLLM's."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvserve.config import KVConfig
from kvserve.core.checkpoints import CheckpointRegistry, Published, candidates
from kvserve.core.record import CoreRequest, Progress
from kvserve.core.turns import TurnEnds
from kvserve.messages import CheckpointId, PageReport
from kvserve.metrics import metrics
from kvserve.policies import POLICY_NAMES

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format, INFO shown


class CoreRequests:
    """Every request the engine core serves, by id, and the events of their lives. `evicting`: the model evicts
    (otherwise every request is served without eviction); `pages_per_block`, `bytes_per_block`: of one vLLM block
    over all pipeline stages; `chunk_tokens`: vLLM's most tokens per step; `marker`: the model's generation marker
    (asked only for `kv_checkpoint=turns`, which the front ends refuse on a model without one)."""

    def __init__(
        self,
        *,
        evicting: bool,
        block_size: int,
        pages_per_block: int,
        bytes_per_block: int,
        chunk_tokens: int,
        marker: Callable[[], tuple[int, ...]],
    ) -> None:
        self.evicting = evicting
        self.block_size = block_size
        self.pages_per_block = pages_per_block
        self.bytes_per_block = bytes_per_block
        self.chunk_tokens = chunk_tokens
        self.marker = marker
        self.records: dict[str, CoreRequest] = {}
        self.checkpoints = CheckpointRegistry()  # published checkpoints (kv_checkpoint)
        self.dropped: list[CheckpointId] = []  # checkpoints the workers hold and must forget
        self.under_pressure = False  # this schedule found the pool short (`kvserve.core.pressure`)
        for policy in POLICY_NAMES:  # every policy's error count is served from the start: 0, not "no data"
            metrics().policy_errors.labels(policy=policy)

    def get(self, request_id: str) -> CoreRequest | None:
        return self.records.get(request_id)

    def evicting_record(self, request_id: str) -> CoreRequest | None:
        record = self.records.get(request_id)
        return record if record is not None and record.evicts else None

    def admit(self, request_id: str, settings: KVConfig) -> CoreRequest:
        """A new request's record, from the settings it was validated with. One that asks for eviction from a model
        that cannot evict is served without (the front ends answer it 400 before it gets here)."""
        record = CoreRequest(request_id, settings)
        if settings.evicts and self.evicting:
            record.sharing = settings.prefix_sharing()
            if settings.evict_every_chunk and settings.budget is not None:
                record.admission_cap = settings.budget + self.chunk_tokens + self.block_size
            if settings.checkpoint_turns:
                record.turns = TurnEnds(self.marker())
        self.records[request_id] = record
        return record

    def compacted(self, record: CoreRequest, report: PageReport, blocks_freed: int) -> None:
        """The workers compacted the request and gave back `blocks_freed` blocks (its step's spare blocks included):
        from now on it is charged by `report`'s pages."""
        evicted_before = record.evicted_tokens(self.pages_per_block)
        record.report = report
        evicted = record.evicted_tokens(self.pages_per_block) - evicted_before
        metrics().record_compaction(
            record.settings.policy, evicted, blocks_freed - record.spare_taken, self.bytes_per_block
        )
        record.spare_taken = 0

    def published(self, key: bytes, report: PageReport, block_ids: tuple[int, ...], hashes: tuple[bytes, ...]) -> None:
        """A compaction at a checkpoint left lists that fill whole blocks, now in the prefix cache under `hashes`."""
        stored = PageReport(logical_tokens=report.logical_tokens, stages=report.stages, released_block_ids=())
        self.checkpoints.entries[key] = Published(stored, block_ids, hashes)
        metrics().checkpoints_published.inc()

    def resume(self, record: CoreRequest, key: bytes, checkpoint: Published) -> None:
        """The request's prefix-cache hit is a checkpoint: it starts from the checkpoint's lists, and is charged by
        their pages."""
        record.report = checkpoint.report
        record.resuming = key

    def preempted(self, record: CoreRequest) -> None:
        """Its blocks are freed (preemption, or finishing): a preempted request recomputes from scratch, every list
        full."""
        record.report = None

    def finish(self, request_id: str, num_computed_tokens: int) -> CoreRequest | None:
        """The request leaves the engine; its kept share of the sequence is recorded."""
        record = self.records.pop(request_id, None)
        if record is not None and record.evicts and num_computed_tokens > 0:
            kept = num_computed_tokens - record.evicted_tokens(self.pages_per_block)
            metrics().kept_ratio.labels(policy=record.settings.policy).observe(kept / num_computed_tokens)
        return record

    def failed(self, failures: dict[str, str]) -> None:
        """The workers failed these requests (their policy raised); vLLM then finishes them with an error."""
        for request_id, message in failures.items():
            record = self.records.get(request_id)
            policy = record.settings.policy if record is not None else "unknown"
            logger.error("kvserve: request %s fails: kv_policy %r: %s", request_id, policy, message)
            metrics().policy_errors.labels(policy=policy).inc()

    def live_checkpoint(
        self,
        record: CoreRequest,
        progress: Progress,
        cached_block_id: Callable[[bytes], int | None],
        hash_block_size: int,
    ) -> tuple[bytes, Published] | None:
        """(key, checkpoint) of the latest live checkpoint a waiting `kv_checkpoint` request can resume from,
        leaving at least its computed tail (its policy's window, in whole blocks) to compute, or (`kv_document`) one
        token."""
        if not record.evicts or not record.settings.checkpoints or not self.checkpoints.entries:
            return None
        # a request that resumes from a compressed document compacts nothing after it: one token to compute is enough
        limit = progress.count - (1 if record.settings.document else record.sharing.computed_tail)
        known = record.candidates
        if known is None or known[0] != limit:  # a waiting request's tokens change only when it is preempted
            found = candidates(record, progress, limit, self.block_size, hash_block_size)
            known = record.candidates = (limit, found)
        for _, key in known[1]:
            published = self.checkpoints.alive(key, cached_block_id)
            if published is not None:
                return key, published
        return None

    def checkpoint_hit(
        self,
        record: CoreRequest,
        progress: Progress,
        cached_block_id: Callable[[bytes], int | None],
        hash_block_size: int,
    ) -> Published | None:
        """The checkpoint a `kv_checkpoint` request's prefix-cache hit resumes from (`live_checkpoint`), if any; the
        request then starts from its lists."""
        record.report = None  # a hit found at an earlier, failed admission
        record.resuming = None
        found = self.live_checkpoint(record, progress, cached_block_id, hash_block_size)
        if found is None:
            return None
        key, published = found
        self.resume(record, key, published)
        return published
