"""The scheduler decides WHEN a request compacts and to HOW MANY entries; the worker decides WHICH entries.

Rules (B = the request's budget, bs = block size), checked after each step is scheduled:
- the chunk that completes the prompt (or a preempted request's recompute): compact to B if the cache exceeds B;
- any earlier prompt chunk: the same, only with `kv_evict_every_chunk`;
- a decode step: compact back to B once the cache reaches B + bs, so eviction runs once per block of new tokens
  (with `kv_allocation`, once the longest list grew by bs since the last compaction: each list returns to its share);
- `kv_checkpoint=C`: instead of all of the above, at every step that ends at a multiple of C tokens (prompt chunks
  are cut to end there), prompt and decode alike, and the compacted lists are published there when they fill whole
  blocks (`kvserve/engine/checkpoints.py`); the lists then hold B to B + C entries;
- `kv_checkpoint=turns`: where a chat turn's prompt ends (its lists over B), and once a turn has ended by the decode
  rule for every later token, prompt or reply (chunks are cut there too), publishing at a prompt's end and in decode;
  a prompt that ends where no turn does compacts there as eager eviction does and publishes nothing after it;
- `kv_evict_when=pressure`: none of the above until the pool is short (`_short_of_blocks`); until its first
  compaction the request is a `full` one (every block it fills, its reply's too, enters the prefix cache), and the
  first step it runs under pressure compacts it by the rules above.
After the step ran, the worker reports the request's page lists and the blocks it emptied (`PageReport`), and
`update_from_output` frees those blocks; from then on the block manager charges the request by its pages.

Each (layer, KV head) list has its own count; "the cache" in these rules is the longest list. A ragged policy
(Attention-Gate) decides its counts in the worker: its prompt always compacts, each head to at most B (or to what its
gate kept, without a budget); during decoding the B + bs rule applies only when a budget was given. A policy with
its own counts (DuoAttention) also always compacts its prompt, with B, and each head keeps its count for B or all it
holds, whichever is less.

Pipeline parallelism (`--pipeline-parallel-size`): every stage gets the same plan and compacts its own layers; the
last stage decides which blocks the request gives back (`kvserve/engine/stages.py`) and reports; the next schedule
tells the earlier stages (`kvserve_releases`). vLLM keeps several batches in flight to fill the pipeline; an
evicting request joins a new batch only once its last one is back, so its plan always starts from the cache its
last report described.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

from kvserve.config import KVConfig, PrefixSharing, parse_kv_config
from kvserve.engine import phases
from kvserve.engine.block_manager import EvictingFullAttentionManager
from kvserve.engine.checkpoints import (
    CheckpointRegistry,
    Published,
    block_key,
    checkpoint_key,
    first_compacting_checkpoint,
    generation_marker,
    marker_ends,
    next_checkpoint,
    position_key,
    turn_positions,
)
from kvserve.engine.plan import (
    ADOPT_ATTR,
    DROPPED_ATTR,
    PLAN_ATTR,
    RELEASES_ATTR,
    CheckpointId,
    Compaction,
    PageReport,
    compactions_of,
    failures_of,
    page_reports_of,
    with_evicted_count,
)
from kvserve.errors import InvalidSetting
from kvserve.metrics import metrics
from kvserve.model_support import eviction_support, paged_group
from kvserve.parallelism import parallelism_refusal

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format, INFO shown

OVERTAKE_LIMIT_S = 30.0  # a waiting request is overtaken by ones that resume from a checkpoint for this long at most


def _is_decode(request: Request, logical: int, num_new: int) -> bool:
    """Whether a step of `num_new` tokens that ends at `logical` tokens is a decode step (one generated token)."""
    return num_new == 1 and logical - 1 >= request.num_prompt_tokens


class EvictingScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        parallel = self.vllm_config.parallel_config
        refusal = parallelism_refusal(parallel.tensor_parallel_size, parallel.decode_context_parallel_size)
        if refusal is not None:
            raise RuntimeError(refusal)
        if self.vllm_config.speculative_config is not None:
            raise RuntimeError("kvserve eviction does not support speculative decoding (drafts would be compacted)")
        self.support = eviction_support(self.vllm_config.model_config)
        group_index = paged_group(self.kv_cache_config, self.support)
        self.pipeline_stages = self.vllm_config.parallel_config.pipeline_parallel_size
        self.evicting_manager: EvictingFullAttentionManager | None = None
        self.paged_group = group_index
        model = self.vllm_config.model_config.served_model_name
        if group_index is None:
            logger.warning("kvserve: %s: %s; eviction requests get HTTP 400", model, self.support.describe())
        else:
            logger.info("kvserve: %s %s", model, self.support.describe())
            # The manager is built deep inside KVCacheManager; swap its class rather than re-implementing the factory.
            manager = self.kv_cache_manager.coordinator.single_type_managers[group_index]
            if type(manager) is not FullAttentionManager:
                raise RuntimeError(f"kvserve: the paged KV-cache group has a {type(manager).__name__}")
            spec = self.kv_cache_config.kv_cache_groups[group_index].kv_cache_spec
            # pages per block over every pipeline stage (the scheduler's cache config names the first stage's layers)
            self.pages_per_block = len(self.support.paged_layers) * spec.num_kv_heads
            manager.__class__ = EvictingFullAttentionManager
            manager.init_eviction_state(
                self.pages_per_block, self.requests, self._keep_after, cdiv(self.max_model_len, self.block_size)
            )
            self.evicting_manager = manager
            self.bytes_per_block = spec.page_size_bytes * len(self.support.paged_layers)
        self.kv_configs: dict[str, KVConfig] = {}
        self.reported_evicted: dict[str, int] = {}  # req id -> the evicted count its outputs last carried
        self.in_flight: set[str] = set()  # evicting requests in a batch whose output has not come back
        self.releases: dict[str, tuple[int, ...]] = {}  # blocks given back, for the earlier pipeline stages
        # Capacity statistics: most requests in the running queue, and most requests decoding in one step (a
        # request decoding holds its whole cache; running ones may still be prefilling and get preempted).
        self.peak_running = 0
        self.peak_decoding = 0
        self.num_preemptions = 0
        self.under_pressure = False  # this schedule found the pool short (`_short_of_blocks`)
        self.checkpoints = CheckpointRegistry()  # published checkpoints (kv_checkpoint)
        self.resuming: dict[str, bytes] = {}  # waiting request -> the checkpoint its hit resumes from
        self.dropped: list[CheckpointId] = []  # checkpoints the workers hold and must forget
        self.turn_private: set[str] = set()  # kv_checkpoint=turns requests that compacted where no turn ended
        # kv_checkpoint=turns request -> (its token count when scanned, where its chat turns end): a sequence grows
        # only while it decodes, when nothing reads this, so a waiting or prefilling request is scanned once
        self.turn_ends: dict[str, tuple[int, list[int]]] = {}
        # waiting kv_checkpoint request -> (tokens it may hit, (position, key) of the checkpoints a miss publishes)
        self.candidates: dict[str, tuple[int, list[tuple[int, bytes]]]] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests and request.sampling_params is not None:
            config = self._config_of(request)
            if config.evicts and self.evicting_manager is None:
                # the front ends answer 400 before a request gets here (`check_against_model`)
                logger.error(
                    "request %s asks for eviction, which this model lacks (%s): served without eviction",
                    request.request_id,
                    self.support.reason,
                )
            elif config.evicts:
                self.kv_configs[request.request_id] = config
                sharing = config.prefix_sharing()
                if not sharing.reads:
                    request.skip_reading_prefix_cache = True
                self.evicting_manager.sharing[request.request_id] = sharing
                if config.evict_every_chunk and config.budget is not None:
                    chunk = self.scheduler_config.max_num_batched_tokens
                    self.evicting_manager.admission_cap[request.request_id] = config.budget + chunk + self.block_size
        super().add_request(request)

    def _config_of(self, request: Request) -> KVConfig:
        try:
            return parse_kv_config(request.sampling_params.extra_args)
        except InvalidSetting:
            # Front ends validate before a request gets here; a request that bypassed them still must not bring
            # the engine down, so it runs without eviction and says so.
            logger.exception("request %s: invalid eviction settings, serving it without eviction", request.request_id)
            return KVConfig()

    def schedule(self, *args, **kwargs):
        with phases.timed("schedule"):
            output = self._schedule(*args, **kwargs)
        phases.publish()
        return output

    def _schedule(self, *args, **kwargs):
        # decided once per schedule: the allocation (`_keep_after`) and the plan below must agree
        self.under_pressure = self.evicting_manager is not None and self._short_of_blocks()
        if self.evicting_manager is not None:
            self._resumable_first()
        output = self._schedule_without_in_flight(*args, **kwargs)
        plan: dict[str, Compaction] = {}
        decoding = 0
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            logical = request.num_computed_tokens  # already advanced past this step by the base scheduler
            is_decode = _is_decode(request, logical, num_new)
            decoding += is_decode
            if req_id not in self.kv_configs:
                continue
            cached, keep = self._compaction_at(req_id, logical, is_decode)
            if keep is not None and self.kv_configs[req_id].defers and req_id not in self.evicting_manager.reports:
                metrics().deferred_compactions.inc()
            if keep is not None:
                plan[req_id] = Compaction(
                    keep,
                    logical_tokens=logical,
                    cached_tokens=cached,
                    decode=is_decode,
                    protected_blocks=self.evicting_manager.protected_blocks(req_id),
                    checkpoint=self._checkpoint_key(request, logical),
                )
        setattr(output, PLAN_ATTR, plan)
        if self.evicting_manager is not None:
            self._tell_checkpoints(output)
        self.in_flight.update(req_id for req_id in output.num_scheduled_tokens if req_id in self.kv_configs)
        if self.pipeline_stages > 1:
            running = {request.request_id for request in self.running}
            setattr(
                output, RELEASES_ATTR, {req_id: blocks for req_id, blocks in self.releases.items() if req_id in running}
            )
            self.releases = {}
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_decoding = max(self.peak_decoding, decoding)
        return output

    def _checkpoint_key(self, request: Request, logical: int) -> bytes | None:
        """The key a compaction after a step ending at `logical` tokens publishes its lists under, or None."""
        config = self.kv_configs[request.request_id]
        if request.request_id in self.evicting_manager.private:  # it stopped publishing (no room for a copy)
            return None
        if config.checkpoint_turns:
            return self._turn_key(request, config, logical)
        whole_blocks = logical // self.hash_block_size
        if not config.checkpoint or logical % config.checkpoint or len(request.block_hashes) < whole_blocks:
            return None
        return checkpoint_key(request.block_hashes[whole_blocks - 1], config)

    def _turn_key(self, request: Request, config: KVConfig, logical: int) -> bytes | None:
        """A turn checkpoint's key; a compaction at a prompt end that is no turn's (a completion prompt) makes the
        request's lists depend on where its prompt ended, so it publishes nothing from then on."""
        req_id = request.request_id
        if req_id in self.turn_private:
            return None
        if not self._turn_ends_at(request, logical) and not self._armed(request, logical):
            self.turn_private.add(req_id)
            return None
        if logical < request.num_prompt_tokens:
            # inside a resent conversation: a later turn resumes from this prompt's end or later, never from here, and
            # publishing every block of a recomputed conversation pushed the useful checkpoints out of a small pool
            return None
        return position_key(request.block_hashes, request.all_token_ids, logical, self.hash_block_size, config)

    def _marker(self) -> tuple[int, ...]:
        model = self.vllm_config.model_config
        marker = generation_marker(model.tokenizer, model.trust_remote_code)
        if marker is None:  # check_against_model refuses kv_checkpoint=turns on such a model
            raise RuntimeError("kvserve: kv_checkpoint=turns on a model without a chat template")
        return marker

    def _turn_ends_at(self, request: Request, logical: int) -> bool:
        marker = self._marker()
        return logical >= len(marker) and tuple(request.all_token_ids[logical - len(marker) : logical]) == marker

    def _turn_ends(self, request: Request) -> list[int]:
        """Where the request's chat turns end (after each generation marker), in order."""
        known = self.turn_ends.get(request.request_id)
        if known is None or known[0] != request.num_tokens:
            ends = marker_ends(request.all_token_ids, self._marker(), request.num_tokens)
            known = self.turn_ends[request.request_id] = (request.num_tokens, ends)
        return known[1]

    def _armed(self, request: Request, logical: int) -> bool:
        """Whether a turn ended before `logical` (from then on the decode rule applies to every token)."""
        known = self.turn_ends.get(request.request_id)
        # tokens are only appended, so the first turn end once found stays the first: a decoding request is not
        # scanned again at each compaction
        ends = known[1] if known is not None and known[1] else self._turn_ends(request)
        return bool(ends) and ends[0] < logical

    def _turn_keep(
        self, config: KVConfig, request: Request, logical: int, cached: int, is_decode: bool, prompt_done: bool
    ) -> int | None:
        """`kv_checkpoint=turns`: compact where a turn ends (its lists over B), then by the decode rule (at B + bs)
        for every later token, prompt or reply; a prompt that ends where no turn does compacts there as usual."""
        budget, block_size = config.budget, self.block_size
        if self._turn_ends_at(request, logical):
            return budget if cached > budget else None
        if is_decode or self._armed(request, logical) or request.request_id in self.evicting_manager.reports:
            return budget if cached >= budget + block_size else None
        return budget if prompt_done and cached > budget else None

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's chunk rule, and a `kv_checkpoint` request's chunks end at its checkpoints (a prompt's, or a preempted
        request's recompute of prompt and output)."""
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        config = self.kv_configs.get(request.request_id)
        # a one-token step (decoding) ends wherever it must anyway: no scan of the sequence on the decode path
        if num_new_tokens <= 1 or config is None or not config.checkpoints:
            return num_new_tokens
        if config.checkpoint_turns:
            stop = self._next_turn_stop(request, config, num_computed_tokens)
        else:
            stop = next_checkpoint(num_computed_tokens, config)
        if stop < request.num_tokens:
            num_new_tokens = min(num_new_tokens, stop - num_computed_tokens)
        return num_new_tokens

    def _next_turn_stop(self, request: Request, config: KVConfig, computed: int) -> int:
        """Where a `kv_checkpoint=turns` request's chunk from `computed` must end: the next turn's end, or where its
        lists reach B + bs once a turn has ended (a miss compacts a resent reply where its decode did)."""
        stops = [end for end in self._turn_ends(request) if end > computed]
        if self._armed(request, computed + 1) or request.request_id in self.evicting_manager.reports:
            cached = self.evicting_manager.longest_list(request.request_id, computed)
            stops.append(computed + max(config.budget + self.block_size - cached, 1))
        return min(stops, default=request.num_tokens)

    def _tell_checkpoints(self, output) -> None:
        """The workers hear which new requests resume from a checkpoint, and which checkpoints are gone."""
        starting = {request.req_id for request in output.scheduled_new_reqs}
        starting.update(output.scheduled_cached_reqs.resumed_req_ids)
        adopt = {req_id: key for req_id, key in self.resuming.items() if req_id in starting}
        for req_id in adopt:
            del self.resuming[req_id]
            metrics().checkpoint_hits.inc()
        # named before pruning (its blocks are held by the adopting request, so it cannot be pruned now anyway)
        setattr(output, ADOPT_ATTR, {req_id: (key, self.checkpoints.entries[key].id) for req_id, key in adopt.items()})
        self.dropped.extend(self.checkpoints.prune(self.kv_cache_manager.block_pool))
        setattr(output, DROPPED_ATTR, tuple(self.dropped))
        self.dropped = []

    def _short_of_blocks(self) -> bool:
        """Whether the pool is short: fewer free blocks (cached ones count, vLLM reuses them) than the running
        requests' uncomputed tokens need (the rest of a prompt, or one block for a decoding request) plus the next
        waiting request's, with one block to spare per running request. `kv_evict_when=pressure` requests compact
        then, so that the running ones keep growing and the waiting one gets in without a preemption. A compaction
        frees its blocks only after its step, so the pool counts as short until it has twice what is needed."""
        waiting = [self.waiting.peek_request()] if self.waiting else []
        need = sum(
            cdiv(max(request.num_tokens - request.num_computed_tokens, 1), self.block_size)
            for request in [*self.running, *waiting]
        )
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        return free < 2 * need if self.under_pressure else free < need + len(self.running)

    def _get_local_prefix_cache_hit(self, request: Request):
        """vLLM's prefix-cache hit, cut for an evicting request so that it computes the prompt's last queries its
        policy reads (`Policy.prompt_queries_read`), in whole blocks: its statistics then come from the cached keys
        plus queries it computes itself, and it keeps what it keeps on a miss. vLLM counts the cut hit."""
        blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        sharing = None if self.evicting_manager is None else self.evicting_manager.sharing.get(request.request_id)
        if sharing is None:
            return blocks, hit, boundary, diverged
        config = self.kv_configs[request.request_id]
        if config.checkpoints:
            resumed = self._checkpoint_hit(request)
            if resumed is not None:
                # one KV-cache group: kv_checkpoint is refused on hybrid models (`check_against_model`)
                found = self.kv_cache_manager.create_kv_cache_blocks((list(resumed.blocks),))
                return found, resumed.position, boundary, diverged
        if hit == 0:
            return blocks, hit, boundary, diverged
        limit = max(min(hit, request.num_tokens - sharing.computed_tail), 0) // self.block_size * self.block_size
        limit = min(limit, self._copyable_hit(request, sharing))
        if config.checkpoints:  # plain blocks: what a miss holds before its first compaction
            limit = min(limit, max(self._first_compaction(request, config) - sharing.computed_tail, 0))
            limit = limit // self.block_size * self.block_size
        if limit < hit:
            # looked up again rather than sliced: a sliding-window group's hit holds only the blocks of the window
            # before ITS end, which a shorter hit moves
            found, limit, _ = self.kv_cache_manager.coordinator.find_longest_cache_hit(request.block_hashes, limit)
            blocks = self.kv_cache_manager.create_kv_cache_blocks(found)
        return blocks, limit, boundary, diverged

    def _turn_positions(self, request: Request, config: KVConfig, limit: int) -> list[int]:
        """Where a miss of this sequence compacts with `kv_checkpoint=turns`, up to `limit` tokens."""
        ends = [end for end in self._turn_ends(request) if end <= limit]
        return turn_positions(ends, config.budget, self.block_size, limit)

    def _first_compaction(self, request: Request, config: KVConfig) -> int:
        if not config.checkpoint_turns:
            return first_compacting_checkpoint(config)
        positions = self._turn_positions(request, config, request.num_tokens)
        return positions[0] if positions else request.num_tokens

    def _candidates(self, request: Request, config: KVConfig, limit: int) -> list[tuple[int, bytes]]:
        """(position, key) of the checkpoints a miss of this prompt would publish up to `limit`, latest first."""
        if config.checkpoint_turns:
            tokens, hashes = request.all_token_ids, request.block_hashes
            positions = self._turn_positions(request, config, limit)
            keys = [(p, position_key(hashes, tokens, p, self.hash_block_size, config)) for p in reversed(positions)]
            return [(p, key) for p, key in keys if key is not None]
        first = first_compacting_checkpoint(config)
        positions = range(limit // config.checkpoint * config.checkpoint, first - 1, -config.checkpoint)
        return [(p, checkpoint_key(request.block_hashes[p // self.hash_block_size - 1], config)) for p in positions]

    def _checkpoint_hit(self, request: Request) -> Published | None:
        """The latest live checkpoint of this prompt (`_live_checkpoint`); the request's page report becomes the
        checkpoint's, so the block manager charges it by the checkpoint's pages."""
        manager = self.evicting_manager
        manager.reports.pop(request.request_id, None)  # a hit found at an earlier, failed admission
        self.resuming.pop(request.request_id, None)
        found = self._live_checkpoint(request)
        if found is None:
            return None
        key, published = found
        manager.reports[request.request_id] = published.report
        self.resuming[request.request_id] = key
        return published

    def _live_checkpoint(self, request: Request) -> tuple[bytes, Published] | None:
        """(key, checkpoint) of the latest live checkpoint a waiting `kv_checkpoint` request can resume from, leaving
        at least the policy's computed tail (its window, in whole blocks) to compute."""
        config = self.kv_configs.get(request.request_id)
        if config is None or not config.checkpoints or not self.checkpoints.entries:
            return None
        limit = request.num_tokens - self.evicting_manager.sharing[request.request_id].computed_tail
        known = self.candidates.get(request.request_id)
        if known is None or known[0] != limit:  # a waiting request's tokens change only when it is preempted
            known = self.candidates[request.request_id] = (limit, self._candidates(request, config, limit))
        for _, key in known[1]:
            published = self.checkpoints.alive(key, self.kv_cache_manager.block_pool)
            if published is not None:
                return key, published
        return None

    def _resumable_first(self) -> None:
        """Waiting requests that can resume from a live checkpoint go ahead of the others, and vLLM evicts their
        checkpoints' blocks after every other cached block, the next one to be admitted last.

        A checkpoint is cheap to keep (the budget's pages) and dear to lose: its next turn recomputes the whole
        conversation, and a recompute holds the full prompt until its first compaction, which evicts more
        checkpoints in a small pool (measured in `kvserve bench chat`: from 39 of 40 later turns resumed to 8 when
        the first turns' recomputes were admitted ahead). Admitting requests that hit first is the longest-prefix
        -match ordering of SGLang ("SGLang: Efficient Execution of Structured Language Model Programs",
        arXiv 2312.07104); a request that has waited `OVERTAKE_LIMIT_S` is no longer overtaken, so none starves.
        Only with the first-come-first-served policy: under `--scheduling-policy priority` the priorities decide."""
        if self.policy != SchedulingPolicy.FCFS or not self.checkpoints.entries or not self.waiting:
            return
        live = {}
        for request in self.waiting:
            found = self._live_checkpoint(request)
            if found is not None:
                live[request.request_id] = found[1]
        if not live:
            return
        now = time.time()
        order = list(self.waiting)
        resuming = [request for request in order if request.request_id in live]
        others = [request for request in order if request.request_id not in live]
        waited = [request for request in others if now - request.arrival_time >= OVERTAKE_LIMIT_S]
        overtaken = [request for request in others if now - request.arrival_time < OVERTAKE_LIMIT_S]
        reordered = waited + resuming + overtaken
        if reordered != order:  # (identity: vLLM's Request has no __eq__) most schedules find it in order already
            self.waiting.remove_requests(order)
            for request in reordered:
                self.waiting.add_request(request)
        self.evicting_manager.evict_last(
            [block for request in reversed(resuming) for block in live[request.request_id].blocks]
        )

    def _publish_checkpoint(self, req_id: str, key: bytes, report: PageReport) -> None:
        """A compaction at a checkpoint left lists that fill whole blocks: their blocks enter the prefix cache under
        the checkpoint's own block hashes (vLLM then keeps them as cached blocks when the request lets them go)."""
        blocks = self.evicting_manager.req_to_blocks.get(req_id, [])
        by_id = {block.block_id: block for block in blocks}
        published = [by_id[block_id] for block_id in report.checkpoint_blocks]
        pool = self.kv_cache_manager.block_pool
        if self.checkpoints.alive(key, pool) is not None:  # another request published the same lists first
            self.dropped.append((key, report.checkpoint_blocks))
            return
        hashes = []
        for index, block in enumerate(published):
            block_hash = make_block_hash_with_group_id(BlockHash(block_key(key, index)), self.paged_group)
            pool._insert_block_hash(block_hash, block, self.block_size)
            hashes.append(block_hash)
        stored = PageReport(logical_tokens=report.logical_tokens, stages=report.stages, released_block_ids=())
        self.checkpoints.entries[key] = Published(stored, published, hashes)
        metrics().checkpoints_published.inc()

    def _copyable_hit(self, request: Request, sharing: PrefixSharing) -> int:
        """The longest hit (tokens) whose blocks the prompt's compaction can copy its kept pages out of. The copies go
        to spare blocks past the prompt's in the request's block-table row; a prompt near `max_model_len` leaves the
        row no room for them, so it hits only as many blocks as the row can still take (the blocks it computes
        itself then stop publishing and are compacted in place: `kvserve:prefix_publish_fallbacks`)."""
        keep = self._keep_after(request.request_id, request.num_tokens)
        if keep is None:  # the prompt does not compact: nothing to copy
            return request.num_tokens
        room = self.evicting_manager.max_blocks_per_request - cdiv(request.num_tokens, self.block_size)
        copies = cdiv(keep, self.block_size) + sharing.spare_blocks
        return request.num_tokens if copies <= room else max(room, 0) * self.block_size

    def _keep_after(self, req_id: str, num_tokens: int) -> int | None:
        """What `_keep_tokens` will decide for a step that ends at `num_tokens` logical tokens, asked while the step
        is allocated (before the scheduler advances the request): the block manager adds the spare blocks a
        compaction's copies need to that same allocation."""
        request = self.requests[req_id]
        is_decode = _is_decode(request, num_tokens, num_tokens - request.num_computed_tokens)
        return self._compaction_at(req_id, num_tokens, is_decode)[1]

    def _compaction_at(self, req_id: str, logical: int, is_decode: bool) -> tuple[int, int | None]:
        """For a step that ends at `logical` tokens: (entries in the longest list then, entries it compacts to or
        None). One rule for the plan and for the allocation that must hold the plan's spare blocks."""
        cached = self.evicting_manager.longest_list(req_id, logical)
        prompt_done = logical >= self.requests[req_id].num_tokens
        return cached, self._keep_tokens(self.kv_configs[req_id], cached, is_decode, prompt_done, req_id, logical)

    def _schedule_without_in_flight(self, *args, **kwargs):
        """vLLM's schedule, with the evicting requests that are in an unfinished batch out of its sight: vLLM keeps
        up to `pipeline_parallel_size` batches in flight and would give such a request its next prefill chunk before
        the last one's page report is back. (Without pipeline parallelism no batch is in flight here.)"""
        held_back = [request for request in self.running if request.request_id in self.in_flight]
        if not held_back:
            return super().schedule(*args, **kwargs)
        self.running = [request for request in self.running if request.request_id not in self.in_flight]
        self.max_num_running_reqs -= len(held_back)  # they still count against --max-num-seqs
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs += len(held_back)
            self.running = held_back + self.running

    def _keep_tokens(
        self, config: KVConfig, cached: int, is_decode: bool, prompt_done: bool, req_id: str, logical: int
    ) -> int | None:
        """The entries a request compacts to after this step, or None if it does not compact now."""
        if config.defers and not self.under_pressure and req_id not in self.evicting_manager.reports:
            return None  # kv_evict_when=pressure, and the pool has room: served as `full` for now
        budget = config.budget
        if config.checkpoint_turns:
            return self._turn_keep(config, self.requests[req_id], logical, cached, is_decode, prompt_done)
        if config.checkpoint:  # at every multiple of C, prompt or not, and nowhere else: lists hold B to B + C
            return budget if logical % config.checkpoint == 0 and cached > budget else None
        if is_decode:
            if budget is None:
                return None
            # an allocation keeps some lists longer than B: compact once a block of tokens came since the last time
            report = self.evicting_manager.reports.get(req_id)
            varies = config.allocation != "uniform" or config.own_counts  # some lists keep more than B
            longest = report.longest if report is not None and varies else budget
            return budget if cached >= longest + self.block_size else None
        if not prompt_done and not config.evict_every_chunk:
            return None
        if config.ragged:  # the gate decides; the budget caps
            return cached if budget is None else min(budget, cached)
        if config.own_counts and budget is not None:  # the policy's counts for B, each capped at what a head holds
            return budget  # (a prompt shorter than B still drops its streaming heads' middle)
        return budget if cached > budget else None

    def update_from_output(self, scheduler_output, model_runner_output):
        failures = failures_of(model_runner_output)
        for req_id, message in failures.items():
            config = self.kv_configs.get(req_id)
            policy = config.policy if config else "unknown"
            logger.error("kvserve: request %s fails: kv_policy %r: %s", req_id, policy, message)
            metrics().policy_errors.labels(policy=policy).inc()
        # vLLM finishes the requests in this set with FINISHED_ERROR (HTTP 500) at the end of this update; the set
        # is named for grammar failures but is its generic "fail these requests" hook.
        self.grammar_compile_error_reqs.update(req_id for req_id in failures if req_id in self.requests)
        manager = self.evicting_manager
        if manager is None:  # this model does not evict
            result = super().update_from_output(scheduler_output, model_runner_output)
            self._report_evicted_counts(result, failures)
            return result
        reports = page_reports_of(model_runner_output)
        for req_id, compaction in compactions_of(scheduler_output).items():
            request = self.requests.get(req_id)
            report = reports.get(req_id)
            if request is None or request.is_finished() or req_id in failures or report is None:
                if report is not None and report.checkpoint_blocks:  # published by the worker, never by us
                    self.dropped.append((compaction.checkpoint, report.checkpoint_blocks))
                continue
            evicted_before = manager.evicted_tokens(req_id)
            freed = manager.apply_report(req_id, report)
            if report.checkpoint_blocks:
                self._publish_checkpoint(req_id, compaction.checkpoint, report)
            if self.pipeline_stages > 1 and report.released_block_ids:
                self.releases[req_id] = report.released_block_ids
            evicted = manager.evicted_tokens(req_id) - evicted_before
            metrics().record_compaction(self.kv_configs[req_id].policy, evicted, freed, self.bytes_per_block)
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        result = super().update_from_output(scheduler_output, model_runner_output)
        self._report_evicted_counts(result, failures)
        metrics().evicted_requests.set(len(manager.reports))
        self._export_pages()
        return result

    def _export_pages(self) -> None:
        """`kvserve:kv_pages_in_use`: every page of a used block, less the free pages inside compacted requests'
        blocks (vLLM's usage counts those blocks whole)."""
        pool = self.kv_cache_manager.block_pool
        total_blocks = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        used_blocks = total_blocks - pool.get_num_free_blocks()
        running = {req_id: request.num_computed_tokens for req_id, request in self.requests.items()}
        in_use = used_blocks * self.pages_per_block - self.evicting_manager.free_pages_held(running)
        metrics().pages_in_use.set(in_use)
        metrics().pages_total.set(total_blocks * self.pages_per_block)

    def _report_evicted_counts(self, outputs_by_client, failures: dict[str, str]) -> None:
        """A request's first output, and each later one whose evicted count changed, carries the count to the front
        end: a request a stop string ends there is aborted in the engine and gets no finished output from here. The
        error output of a request whose policy raised this step says why (vLLM builds it without transfer params)."""
        for engine_outputs in outputs_by_client.values():
            for output in engine_outputs.outputs:
                evicted = self._evicted_tokens(output.request_id)
                failure = failures.get(output.request_id)
                if output.kv_transfer_params is not None or (
                    failure is None and evicted == self.reported_evicted.get(output.request_id)
                ):
                    continue  # finished (_free_request attached the final count), or nothing new since the first
                output.kv_transfer_params = with_evicted_count(None, output.request_id, evicted, failure)
                self.reported_evicted[output.request_id] = evicted
        for req_id in failures:  # finished with FINISHED_ERROR in this update: _free_request ran before the loop
            self.reported_evicted.pop(req_id, None)

    def _evicted_tokens(self, request_id: str) -> int:
        return 0 if self.evicting_manager is None else self.evicting_manager.evicted_tokens(request_id)

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        self.num_preemptions += 1
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request: Request, *args, **kwargs):
        self.resuming.pop(request.request_id, None)
        self.turn_private.discard(request.request_id)
        self.turn_ends.pop(request.request_id, None)
        self.candidates.pop(request.request_id, None)
        config = self.kv_configs.pop(request.request_id, None)
        evicted = self._evicted_tokens(request.request_id)
        if config is not None and request.num_computed_tokens > 0:
            kept = request.num_computed_tokens - evicted
            metrics().kept_ratio.labels(policy=config.policy).observe(kept / request.num_computed_tokens)
        if self.evicting_manager is not None:
            self.evicting_manager.forget(request.request_id)
        self.in_flight.discard(request.request_id)
        self.releases.pop(request.request_id, None)
        kv_transfer_params, ec_transfer_params = super()._free_request(request, *args, **kwargs)
        # The finished request's output carries the count to the front end (the response's usage block).
        self.reported_evicted.pop(request.request_id, None)
        return with_evicted_count(kv_transfer_params, request.request_id, evicted), ec_transfer_params
