"""vLLM's scheduler with eviction (`EvictingScheduler`, chosen by the `scheduler_choice` point of
`kvserve/vllm/points.py`): an adapter between vLLM's scheduling and kvserve's engine-core rules
(`kvserve/core/`), which decide when a request compacts (`kvserve/core/compaction.py`), where its checkpoints fall,
when the pool is short, which waiting request goes first and what a prefix-cache hit may cover. Each request's
state is its `CoreRequest` record; its life events go through `CoreRequests`.

After each schedule the step's `StepPlan` rides to the workers; after the step ran, the workers' `StepReport` says
what each compacted request's page lists hold and which blocks they emptied, and `update_from_output` frees those
blocks (`EvictingFullAttentionManager.apply_report`); from then on the request is charged by its pages.

Pipeline parallelism (`--pipeline-parallel-size`): every stage gets the same plan and compacts its own layers; the
last stage decides which blocks the request gives back (`kvserve/worker/stages.py`) and reports; the next schedule
tells the earlier stages (`StepPlan.releases`). vLLM keeps several batches in flight to fill the pipeline; an
evicting request joins a new batch only once its last one is back, so its plan always starts from the cache its
last report described.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

from kvserve import phases
from kvserve.config import KVConfig, settings_from
from kvserve.core.admission import resumable_first
from kvserve.core.checkpoints import chunk_end, first_compaction, publish_key
from kvserve.core.compaction import compaction_after, drafts_allowed, is_decode
from kvserve.core.prefix import copyable_hit, hit_limit
from kvserve.core.pressure import short_of_blocks
from kvserve.core.record import CoreRequest
from kvserve.core.requests import CoreRequests
from kvserve.errors import InvalidSetting
from kvserve.messages import Compaction, PageReport, StepPlan, cdiv, with_evicted_count
from kvserve.metrics import metrics, set_engine
from kvserve.model_support import eviction_support, generation_marker
from kvserve.parallelism import drafter_has_own_cache, parallelism_refusal, speculation_refusal
from kvserve.vllm.carriers import attach_plan, plan_of, report_of
from kvserve.vllm.kv_cache_manager import EvictingFullAttentionManager, keep_after, progress_of
from kvserve.vllm.model import paged_group, paged_spec
from kvserve.worker.kernel_dispatch import attention_mode

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format, INFO shown


class EvictingScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        parallel = self.vllm_config.parallel_config
        set_engine(parallel.data_parallel_index)  # kvserve's series carry the engine label vLLM gives this engine
        self.support = eviction_support(self.vllm_config.model_config)
        kv_heads = self.vllm_config.model_config.get_total_num_kv_heads() if self.support.evicts else None
        refusal = parallelism_refusal(
            parallel.tensor_parallel_size, parallel.decode_context_parallel_size, num_kv_heads=kv_heads
        )
        if refusal is not None:
            raise RuntimeError(refusal)
        speculative = self.vllm_config.speculative_config
        refusal = speculation_refusal(speculative, parallel.pipeline_parallel_size, attention_mode())
        if refusal is not None:
            raise RuntimeError(refusal)
        self.drafter_cache = drafter_has_own_cache(speculative)
        self.paged_group = paged_group(self.kv_cache_config, self.support)
        self.pipeline_stages = parallel.pipeline_parallel_size
        self.evicting_manager: EvictingFullAttentionManager | None = None
        model = self.vllm_config.model_config.served_model_name
        pages_per_block = bytes_per_block = 0
        if self.paged_group is None:
            logger.warning("kvserve: %s: %s; eviction requests get HTTP 400", model, self.support.describe())
        else:
            logger.info("kvserve: %s %s", model, self.support.describe())
            # The manager is built deep inside KVCacheManager; swap its class rather than re-implementing the factory.
            manager = self.kv_cache_manager.coordinator.single_type_managers[self.paged_group]
            if type(manager) is not FullAttentionManager:
                raise RuntimeError(f"kvserve: the paged KV-cache group has a {type(manager).__name__}")
            spec = paged_spec(self.kv_cache_config.kv_cache_groups[self.paged_group], self.support.num_layers)
            # pages per block over every pipeline stage (the scheduler's cache config names the first stage's layers)
            # and every tensor-parallel rank (the spec counts one rank's KV heads)
            ranks = parallel.tensor_parallel_size
            pages_per_block = len(self.support.paged_layers) * spec.num_kv_heads * ranks
            bytes_per_block = spec.page_size_bytes * len(self.support.paged_layers) * ranks
            manager.__class__ = EvictingFullAttentionManager
            self.evicting_manager = manager
        self.core = CoreRequests(
            evicting=self.evicting_manager is not None,
            block_size=self.block_size,
            pages_per_block=pages_per_block,
            bytes_per_block=bytes_per_block,
            chunk_tokens=self.scheduler_config.max_num_batched_tokens,
            marker=self._marker,
        )
        if self.evicting_manager is not None:
            self.evicting_manager.attach(self.core, self.requests, cdiv(self.max_model_len, self.block_size))
        # Capacity statistics: most requests in the running queue, and most requests decoding in one step (a
        # request decoding holds its whole cache; running ones may still be prefilling and get preempted).
        self.peak_running = 0
        self.peak_decoding = 0
        self.num_preemptions = 0

    def _marker(self) -> tuple[int, ...]:
        model = self.vllm_config.model_config
        marker = generation_marker(model.tokenizer, model.trust_remote_code)
        if marker is None:  # the front ends refuse kv_checkpoint=turns on such a model
            raise RuntimeError("kvserve: kv_checkpoint=turns on a model without a chat template")
        return marker

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            record = self.core.admit(request.request_id, self._settings_of(request))
            if record.settings.evicts and not record.evicts:  # the front ends answer 400 before it gets here
                logger.error(
                    "request %s asks for eviction, which this model lacks (%s): served without eviction",
                    request.request_id,
                    self.support.reason,
                )
            if record.evicts and not record.sharing.reads:
                request.skip_reading_prefix_cache = True
        super().add_request(request)

    def _settings_of(self, request: Request) -> KVConfig:
        try:
            return settings_from(request.sampling_params)
        except InvalidSetting:
            # vLLM's input validation writes them; a request handed to the engine some other way must still not
            # bring it down: it runs without eviction, and says so
            logger.exception(
                "request %s: unreadable eviction settings, serving it without eviction", request.request_id
            )
            return KVConfig()

    def schedule(self, *args, **kwargs):
        with phases.timed("schedule"):
            output = self._schedule(*args, **kwargs)
        phases.publish()
        return output

    def _schedule(self, *args, **kwargs):
        core, manager = self.core, self.evicting_manager
        if manager is not None:
            # decided once per schedule: the allocation (the manager's spare blocks) and the plan must agree
            core.under_pressure = self._short_of_blocks()
            self._resumable_first()
        output = self._schedule_without_in_flight(*args, **kwargs)
        compactions: dict[str, Compaction] = {}
        decoding = 0
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            logical = request.num_computed_tokens  # already advanced past this step by the base scheduler
            drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            decode = is_decode(logical, num_new, request.num_prompt_tokens, drafts)
            decoding += decode
            record = core.evicting_record(req_id)
            if record is None:
                continue
            record.in_flight = True
            progress = progress_of(request)
            cached, keep = compaction_after(
                record, progress, logical, num_new, self.block_size, core.under_pressure, drafts=drafts
            )
            if keep is None:
                continue
            if record.settings.defers and not record.compacted:
                metrics().deferred_compactions.inc()
            compactions[req_id] = Compaction(
                keep,
                logical_tokens=logical,
                cached_tokens=cached,
                decode=decode,
                protected_blocks=manager.protected_blocks(req_id),
                checkpoint=publish_key(record, progress, logical, self.hash_block_size),
                covers=record.settings.document if record.settings.reconstruct else None,
            )
        attach_plan(output, self._plan(output, compactions))
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_decoding = max(self.peak_decoding, decoding)
        return output

    def _plan(self, output, compactions: dict[str, Compaction]) -> StepPlan:
        """The step's message to the workers: the new evicting requests' settings, the compactions, which new
        requests resume from a checkpoint, which checkpoints are gone, and (pipeline parallelism) the blocks the
        last stage gave back."""
        core = self.core
        starting = [request.req_id for request in output.scheduled_new_reqs]
        admitted = {req_id: record.settings for req_id in starting if (record := core.evicting_record(req_id))}
        adopt = {}
        for req_id in [*starting, *output.scheduled_cached_reqs.resumed_req_ids]:
            record = core.evicting_record(req_id)
            if record is not None and record.resuming is not None:
                # named before pruning (its blocks are held by the adopting request, so it cannot be pruned now)
                adopt[req_id] = (record.resuming, core.checkpoints.entries[record.resuming].block_ids)
                record.resuming = None
                metrics().checkpoint_hits.inc()
        dropped = ()
        if self.evicting_manager is not None:
            core.dropped.extend(core.checkpoints.prune(self.evicting_manager.cached_block_id))
            dropped, core.dropped = tuple(core.dropped), []
        releases = {}
        if self.pipeline_stages > 1:
            running = {request.request_id for request in self.running}
            for req_id, record in core.records.items():
                if record.released and req_id in running:
                    releases[req_id] = record.released
                record.released = ()
        return StepPlan(admitted=admitted, compactions=compactions, adopt=adopt, dropped=dropped, releases=releases)

    def _resumable_first(self) -> None:
        """Waiting requests that can resume from a live checkpoint go ahead of the others (`kvserve.core.admission`),
        and vLLM evicts their checkpoints' blocks after every other cached block, the next one to be admitted last.
        Only with the first-come-first-served policy: under `--scheduling-policy priority` the priorities decide."""
        core = self.core
        if self.policy != SchedulingPolicy.FCFS or not core.checkpoints.entries or not self.waiting:
            return
        live = {}
        for request in self.waiting:
            record = core.get(request.request_id)
            found = None if record is None else self._live_checkpoint(record, request)
            if found is not None:
                live[request.request_id] = found[1]
        if not live:
            return
        order = list(self.waiting)
        reordered = resumable_first(
            order, lambda request: request.request_id in live, lambda request: request.arrival_time, time.time()
        )
        if reordered != order:  # (identity: vLLM's Request has no __eq__) most schedules find it in order already
            self.waiting.remove_requests(order)
            for request in reordered:
                self.waiting.add_request(request)
        resuming = [request for request in order if request.request_id in live]
        self.evicting_manager.evict_last(
            [block for request in reversed(resuming) for block in live[request.request_id].block_ids]
        )

    def _live_checkpoint(self, record: CoreRequest, request: Request):
        return self.core.live_checkpoint(
            record, progress_of(request), self.evicting_manager.cached_block_id, self.hash_block_size
        )

    def _short_of_blocks(self) -> bool:
        waiting = [self.waiting.peek_request()] if self.waiting else []
        return short_of_blocks(
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            (request.num_tokens - request.num_computed_tokens for request in [*self.running, *waiting]),
            len(self.running),
            self.block_size,
            was_short=self.core.under_pressure,
        )

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's chunk rule, and a `kv_checkpoint` request's chunks end at its checkpoints (a prompt's, or a preempted
        request's recompute of prompt and output). Speculative decoding: an evicting request's drafts stop before
        its next compaction (`drafts_allowed`); vLLM schedules the drafts that fit in the step."""
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        record = self.core.evicting_record(request.request_id)
        if record is not None and request.spec_token_ids and num_computed_tokens + 1 >= request.num_tokens:
            progress = progress_of(request, computed=num_computed_tokens)
            wanted, pressure = num_new_tokens - 1, self.core.under_pressure
            allowed = drafts_allowed(
                record, progress, num_computed_tokens, wanted, self.block_size, pressure, self.drafter_cache
            )
            return min(num_new_tokens, 1 + allowed)
        # a one-token step (decoding) ends wherever it must anyway: no scan of the sequence on the decode path
        if num_new_tokens <= 1 or record is None or not record.settings.checkpoints:
            return num_new_tokens
        stop = chunk_end(record, progress_of(request, computed=num_computed_tokens), self.block_size)
        if stop < request.num_tokens:
            num_new_tokens = min(num_new_tokens, stop - num_computed_tokens)
        return num_new_tokens

    def _get_local_prefix_cache_hit(self, request: Request):
        """vLLM's prefix-cache hit, or for a `kv_checkpoint` request the checkpoint it resumes from; an evicting
        request's plain hit is cut to what `kvserve.core.prefix` lets it cover. vLLM counts the hit."""
        blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        record = self.core.evicting_record(request.request_id)
        if record is None:
            return blocks, hit, boundary, diverged
        manager, settings, progress = self.evicting_manager, record.settings, progress_of(request)
        if settings.checkpoints:
            resumed = self.core.checkpoint_hit(record, progress, manager.cached_block_id, self.hash_block_size)
            if resumed is not None:
                # one KV-cache group: kv_checkpoint is refused on hybrid models (`check_against_model`)
                found = self.kv_cache_manager.create_kv_cache_blocks((manager.blocks_of(resumed.block_ids),))
                return found, resumed.position, boundary, diverged
        if hit == 0:
            return blocks, hit, boundary, diverged
        keep = keep_after(self.core, record, request, request.num_tokens)
        copyable = copyable_hit(
            request.num_tokens, keep, manager.max_blocks_per_request, record.sharing.spare_blocks, self.block_size
        )
        first = first_compaction(record, progress, self.block_size) if settings.checkpoints else None
        limit = hit_limit(hit, request.num_tokens, record.sharing.computed_tail, copyable, self.block_size, first)
        if limit < hit:
            # looked up again rather than sliced: a sliding-window group's hit holds only the blocks of the window
            # before ITS end, which a shorter hit moves
            found, limit, _ = self.kv_cache_manager.coordinator.find_longest_cache_hit(request.block_hashes, limit)
            blocks = self.kv_cache_manager.create_kv_cache_blocks(found)
        return blocks, limit, boundary, diverged

    def _schedule_without_in_flight(self, *args, **kwargs):
        """vLLM's schedule, with the evicting requests that are in an unfinished batch out of its sight: vLLM keeps
        up to `pipeline_parallel_size` batches in flight and would give such a request its next prefill chunk before
        the last one's page report is back. (Without pipeline parallelism no batch is in flight here.)"""
        held_back = [request for request in self.running if self._in_flight(request.request_id)]
        if not held_back:
            return super().schedule(*args, **kwargs)
        self.running = [request for request in self.running if not self._in_flight(request.request_id)]
        self.max_num_running_reqs -= len(held_back)  # they still count against --max-num-seqs
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs += len(held_back)
            self.running = held_back + self.running

    def _in_flight(self, request_id: str) -> bool:
        record = self.core.get(request_id)
        return record is not None and record.in_flight

    def update_from_output(self, scheduler_output, model_runner_output):
        report = report_of(model_runner_output)
        failures = report.failures
        self.core.failed(failures)
        # vLLM finishes the requests in this set with FINISHED_ERROR (HTTP 500) at the end of this update; the set
        # is named for grammar failures but is its generic "fail these requests" hook.
        self.grammar_compile_error_reqs.update(req_id for req_id in failures if req_id in self.requests)
        manager = self.evicting_manager
        if manager is None:  # this model does not evict
            result = super().update_from_output(scheduler_output, model_runner_output)
            self._report_evicted_counts(result, failures)
            return result
        for req_id, compaction in plan_of(scheduler_output).compactions.items():
            request, pages = self.requests.get(req_id), report.pages.get(req_id)
            if request is None or request.is_finished() or req_id in failures or pages is None:
                if pages is not None and pages.checkpoint_blocks:  # published by the worker, never by the core
                    self.core.dropped.append((compaction.checkpoint, pages.checkpoint_blocks))
                continue
            manager.apply_report(req_id, pages)
            if pages.checkpoint_blocks:
                self._publish_checkpoint(req_id, compaction.checkpoint, pages)
            if self.pipeline_stages > 1 and pages.released_block_ids:
                self.core.records[req_id].released = pages.released_block_ids
        for req_id in scheduler_output.num_scheduled_tokens:
            record = self.core.get(req_id)
            if record is not None:
                record.in_flight = False
        result = super().update_from_output(scheduler_output, model_runner_output)
        self._report_evicted_counts(result, failures)
        metrics().evicted_requests.set(sum(record.compacted for record in self.core.records.values()))
        self._export_pages()
        return result

    def _publish_checkpoint(self, req_id: str, key: bytes, report: PageReport) -> None:
        """A compaction at a checkpoint left lists that fill whole blocks: their blocks enter the prefix cache under
        the checkpoint's own block hashes (vLLM then keeps them as cached blocks when the request lets them go)."""
        manager = self.evicting_manager
        if self.core.checkpoints.alive(key, manager.cached_block_id) is not None:  # published by another first
            self.core.dropped.append((key, report.checkpoint_blocks))
            return
        hashes = manager.cache_checkpoint(req_id, key, report.checkpoint_blocks, self.paged_group)
        self.core.published(key, report, report.checkpoint_blocks, hashes)

    def _export_pages(self) -> None:
        """`kvserve:kv_pages_in_use`: every page of a used block, less the free pages inside compacted requests'
        blocks (vLLM's usage counts those blocks whole)."""
        pool = self.kv_cache_manager.block_pool
        total_blocks = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        used_blocks = total_blocks - pool.get_num_free_blocks()
        pages_per_block = self.core.pages_per_block
        metrics().pages_in_use.set(used_blocks * pages_per_block - self.evicting_manager.free_pages_held())
        metrics().pages_capacity.set(total_blocks * pages_per_block)

    def _report_evicted_counts(self, outputs_by_client, failures: dict[str, str]) -> None:
        """A request's first output, and each later one whose evicted count changed, carries the count to the front
        end: a request a stop string ends there is aborted in the engine and gets no finished output from here. The
        error output of a request whose policy raised this step says why (vLLM builds it without transfer params)."""
        for engine_outputs in outputs_by_client.values():
            for output in engine_outputs.outputs:
                record = self.core.get(output.request_id)  # (a finished request's is gone: _free_request ran)
                evicted = 0 if record is None else record.evicted_tokens(self.core.pages_per_block)
                failure = failures.get(output.request_id)
                reported = None if record is None else record.reported_evicted
                if output.kv_transfer_params is not None or (failure is None and evicted == reported):
                    continue  # finished (_free_request attached the final count), or nothing new since the first
                output.kv_transfer_params = with_evicted_count(None, output.request_id, evicted, failure)
                if record is not None:
                    record.reported_evicted = evicted

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        self.num_preemptions += 1
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request: Request, *args, **kwargs):
        record = self.core.finish(request.request_id, request.num_computed_tokens)
        evicted = 0 if record is None else record.evicted_tokens(self.core.pages_per_block)
        kv_transfer_params, ec_transfer_params = super()._free_request(request, *args, **kwargs)
        # The finished request's output carries the count to the front end (the response's usage block).
        return with_evicted_count(kv_transfer_params, request.request_id, evicted), ec_transfer_params
