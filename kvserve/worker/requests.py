"""A worker's evicting requests, one `WorkerRequest` each, and the events of a request's life on the worker: admit
(the engine core's plan names its settings), step (its page lists follow its vLLM blocks and take the step's
tokens), compact (after the forward it gives back the blocks its lists no longer need), publish and resume
(`kv_checkpoint`), restart (after a preemption), finish, fail. The boundary (`kvserve/vllm/worker.py`) reads vLLM's
runner and calls these; nothing here touches vLLM.

`num_computed_tokens` stays LOGICAL everywhere in vLLM (it drives RoPE positions and token gathering); where each
(layer, KV head)'s entries live is kvserve's business alone: attention writes and reads through `StepPages` and
ignores vLLM's slot mapping and block table for evicting requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.config import KVConfig
from kvserve.messages import CheckpointId, PageReport, StagePages, StageRelease, StepPlan, StepReport
from kvserve.worker.checkpoints import CheckpointLists, lists_of, resume_from
from kvserve.worker.eviction import record_times
from kvserve.worker.keyed import KeyedLayers
from kvserve.worker.pages import HeadPages, PageLayout, blocks_to_release, copy_pages
from kvserve.worker.ranks import RankMessage, TensorRanks
from kvserve.worker.request import GateRuntime, WorkerRequest
from kvserve.worker.stages import StageLink
from kvserve.worker.step import RowPlan, StepContext


@dataclass(frozen=True)
class BatchRow:
    """One evicting request's row of the step's batch, as vLLM's input batch has it."""

    req_id: str
    row: int  # its row in the batch
    block_ids: list[int]  # its vLLM blocks in the paged group (vLLM's own list: dropping blocks edits it)
    computed: int  # tokens computed before this step
    num_new: int  # tokens this step computes
    query_start: int  # its first query among the step's tokens
    drafts: int = 0  # speculative decoding: draft tokens among them, which the step verifies


class WorkerRequests:
    """This worker's evicting requests, the page view they live in, and the published checkpoints' lists."""

    def __init__(
        self,
        layout: PageLayout,
        pages: torch.Tensor,
        rotary: dict,
        model: str,
        link: StageLink | None,
        group: int,
        ranks: TensorRanks | None = None,
    ) -> None:
        self.layout = layout  # this worker's paged layers, blocks, KV heads
        self.group = group  # the KV-cache group whose blocks hold the pages (a hybrid model's full-attention layers)
        self.pages = pages  # the page view of the whole KV buffer
        self.rotary = rotary  # each paged layer's RoPE table, by page-view index
        self.model = model  # the served model's name (policies trained per model read it)
        self.link = link  # pipeline parallelism: this stage's link to its neighbours
        self.ranks = ranks  # tensor parallelism: the other ranks of this stage
        self.requests: dict[str, WorkerRequest] = {}
        self.checkpoints: dict[CheckpointId, CheckpointLists] = {}  # published checkpoints' lists (kv_checkpoint)
        self.questions = KeyedLayers()  # kv_lookahead: the question's queries, from its probe to its request
        self.pieces = KeyedLayers(capacity=16)  # a document's reconstruction scores, from piece to piece
        # until the engine core hears of them (`report`): why requests failed, and compacted requests' lists
        self.failures: dict[str, str] = {}
        self.reports: dict[str, PageReport] = {}

    def begin_step(self, plan: StepPlan, finished: set[str], restarted: list[str]) -> None:
        """Before vLLM updates its requests for a step: forget finished requests and dropped checkpoints, restart
        the preempted ones, and (on an earlier pipeline stage) move the live pages out of the blocks the last stage
        gave back."""
        for req_id in finished:
            self.finish(req_id)
        for checkpoint in plan.dropped:
            self.checkpoints.pop(checkpoint, None)
        for req_id in restarted:  # after a preemption the request recomputes from scratch into fresh blocks
            if req_id in self.requests:
                self.requests[req_id].reset()
        if self.link is not None and not self.link.is_last:
            for req_id, released in plan.releases.items():
                request = self.requests.get(req_id)
                if request is not None:
                    copy_pages(self.pages, request.pages.release(released))
                    request.released = list(released)

    def finish(self, req_id: str) -> None:
        request = self.requests.pop(req_id, None)
        if request is not None and request.config.question:  # the question's queries served their request
            self.questions.drop(request.config.question)
        if request is not None and request.config.piece_key and request.config.compresses_document:
            self.pieces.drop(request.config.piece_key)  # the last piece compacted with them
        # a worker whose output never reaches the engine core (a tensor-parallel rank > 0) never hands these over
        self.reports.pop(req_id, None)
        self.failures.pop(req_id, None)

    def admit(self, plan: StepPlan, gate: Callable[[str], GateRuntime]) -> None:
        """The step's new evicting requests, with the settings the engine core admitted them with. `gate(req_id)`
        builds a gated request's runtime."""
        for req_id, settings in plan.admitted.items():
            self._admit(req_id, settings, gate)

    def _admit(self, req_id: str, settings: KVConfig, gate: Callable[[str], GateRuntime]) -> None:
        request = WorkerRequest(
            config=settings,
            policy=settings.make_policy(),
            pages=HeadPages(self.layout),
            rotary=self.rotary,
            model=self.model,
        )
        if settings.question_probe:
            request.question = self.questions.recording(settings.question_probe)
        elif settings.question:
            request.question = self.questions.get(settings.question)
            if request.question is None:  # (its probe ran on this server just before; only a flood pushes it out)
                self.failures[req_id] = "kv_lookahead: the question's queries are gone from this worker"
                return
        if settings.piece_key:
            first = settings.piece_start == 0
            request.pieces = self.pieces.recording(settings.piece_key) if first else self.pieces.get(settings.piece_key)
            # (its earlier pieces ran just before; only a flood of documents pushes them out)
            if request.pieces is None:
                self.failures[req_id] = "the document's earlier pieces' reconstruction scores are gone from this worker"
                return
        if settings.ragged:
            try:
                request.gate = gate(req_id)
            except Exception as error:  # e.g. a gate file that fails its checksum: fail the request, not the engine
                self.failures[req_id] = f"kv_policy {settings.policy!r} cannot start: {error}"
                return
        self.requests[req_id] = request

    def released_blocks(self) -> dict[str, list[int]]:
        """The blocks each request gave back last step (vLLM's view of its blocks must drop them); once."""
        released = {}
        for req_id, request in self.requests.items():
            if request.released:
                released[req_id], request.released = request.released, []
        return released

    def step_rows(self, plan: StepPlan, batch: list[BatchRow]) -> tuple[list[RowPlan], dict[int, np.ndarray]]:
        """This step's evicting rows: each request's lists take its new blocks (a first step may start from a
        checkpoint or a prefix-cache hit) and the step's tokens. Returns the rows and, by batch row, the slots
        [L, H, q] of the entries the step appends."""
        rows, appended = [], {}
        for item in batch:
            request = self.requests[item.req_id]
            if item.req_id in plan.adopt:  # its first step resumes from a published checkpoint
                resume_from(request, self.checkpoints[plan.adopt[item.req_id]], item.block_ids)
            elif item.computed and not request.pages.blocks:  # its first step starts from a prefix-cache hit
                request.pages.adopt_prefix(item.block_ids, item.computed)
            _take_new_blocks(request.pages, item.block_ids, item.req_id)
            settle = _verified(request, item)
            appended[item.row] = request.pages.append(item.num_new)
            request.drafted = (item.computed, item.num_new) if item.drafts else None
            compaction = plan.compactions.get(item.req_id)
            if compaction is not None:  # the blocks the compaction must not write (none: it may write all it holds)
                request.pages.protect(compaction.protected_blocks)
                # the core knows the longest list over all pipeline stages; a stage whose layers keep fewer entries
                # (a pyramid allocation's later layers) holds shorter ones
                longest = int(request.pages.lens.max())
                if longest > compaction.cached_tokens or (self.link is None and longest != compaction.cached_tokens):
                    raise RuntimeError(f"kvserve: core and worker disagree on request {item.req_id}'s cache length")
            rows.append(
                RowPlan(
                    req_id=item.req_id,
                    state=request,
                    row=item.row,
                    query_start=item.query_start,
                    query_end=item.query_start + item.num_new,
                    logical_len=item.computed + item.num_new,
                    compaction=compaction,
                    drafts=item.drafts,
                    settle=settle,
                )
            )
        return rows, appended

    def end_step(self, step: StepContext) -> None:
        """After the forward: requests whose policy raised go to the engine core; those that compacted give back the
        blocks their lists no longer need (moving the few live pages out of the emptiest blocks first). The blocks
        are chosen from every worker's counts: under tensor parallelism the ranks first exchange theirs
        (`kvserve/worker/ranks.py`), under pipeline parallelism the stages pass them down the pipeline
        (`kvserve/worker/stages.py`)."""
        if step.rows:
            record_times(step)
            self.failures.update(step.failures())
        compacted = [plan for plan in step.rows if plan.compaction is not None and plan.failure is None]
        # the engine core's plan, the same on every rank (a failure is one rank's own): whether the ranks exchange
        planned = any(plan.compaction is not None for plan in step.rows)
        releases = self._releases(compacted, planned)
        if self.link is not None:
            self._end_stage(compacted, releases)
            return
        publishing = []
        for plan in compacted:
            parts = releases[plan.req_id]
            if plan.req_id in self.failures:  # it failed on another rank: the engine core frees all its blocks
                continue
            self._give_back(plan, parts)
            if plan.compaction.checkpoint is not None:
                publishing.append(plan)
        self._publish(publishing)

    def _releases(self, compacted: list[RowPlan], planned: bool) -> dict[str, list[StageRelease]]:
        """Each compacted request's counts on every rank of this stage (this worker's alone without tensor
        parallelism); under tensor parallelism every rank's failures join this worker's where a compaction was
        planned, and reach rank 0 by a notice where none was (`TensorRanks.quiet_step`)."""
        mine = {plan.req_id: _release(plan.state.pages) for plan in compacted}
        if self.ranks is None:
            return {req_id: [release] for req_id, release in mine.items()}
        if not planned:
            self.failures.update(self.ranks.quiet_step(self.failures))
            return {}
        releases, failures = self.ranks.exchange(RankMessage(mine, dict(self.failures)))
        self.failures.update(failures)
        return releases

    def _end_stage(self, compacted: list[RowPlan], releases: dict[str, list[StageRelease]]) -> None:
        """Pipeline parallelism: add this stage's counts (all its ranks') to the message down the pipeline; the last
        stage chooses the blocks each request gives back from every stage's counts."""
        link = self.link
        message = link.receive()
        for plan in compacted:
            message.releases.setdefault(plan.req_id, []).extend(releases[plan.req_id])
        if not link.is_last:
            message.failures.update(self.failures)  # only the last stage's output reaches the engine core
            self.failures.clear()
            link.send(message)
            for plan in compacted:
                _mark_compacted(plan)
            return
        self.failures.update(message.failures)
        workers = link.group.world_size * (self.ranks.size if self.ranks is not None else 1)
        for plan in compacted:
            stages = message.releases[plan.req_id]
            if plan.req_id in self.failures or len(stages) != workers:
                continue  # it failed on some stage: the engine core frees all its blocks
            if any(stage.block_ids != stages[-1].block_ids for stage in stages):
                raise RuntimeError(f"kvserve: pipeline stages disagree on request {plan.req_id}'s blocks")
            self._give_back(plan, stages)

    def _give_back(self, plan: RowPlan, workers: list[StageRelease]) -> None:
        """The blocks a compacted request gives back, chosen from every worker's counts (`blocks_to_release`: the
        same choice on every worker); this worker moves its live pages out of them."""
        lists = plan.state.pages
        released = blocks_to_release(list(lists.blocks), [worker.counts for worker in workers], lists.protected_ids())
        copy_pages(self.pages, lists.release(released))
        self._compacted(plan, [worker.pages for worker in workers], released)

    def _compacted(self, plan: RowPlan, stages: list[StagePages], released: list[int]) -> None:
        _mark_compacted(plan)
        plan.state.released = released
        self.reports[plan.req_id] = PageReport(
            logical_tokens=plan.compaction.lists_cover, stages=tuple(stages), released_block_ids=tuple(released)
        )

    def _publish(self, plans: list[RowPlan]) -> None:
        """The step ended at a checkpoint for `plans`: keep a copy of each one's lists if they fill whole blocks (on
        every rank, under tensor parallelism), and name their blocks in the report; the engine core gives those
        blocks the checkpoint's hashes. The request itself must not write them any more: they are protected from now
        on."""
        lists = {plan.req_id: found for plan in plans if (found := lists_of(plan.state)) is not None}
        if self.ranks is not None and plans:
            everywhere = self.ranks.agree(set(lists))
            lists = {req_id: found for req_id, found in lists.items() if req_id in everywhere}
        for plan in plans:
            if plan.req_id not in lists:
                continue
            published = lists[plan.req_id]
            self.checkpoints[(plan.compaction.checkpoint, published.blocks)] = published
            plan.state.pages.protected[:] = True
            report = self.reports[plan.req_id]
            self.reports[plan.req_id] = dataclasses.replace(report, checkpoint_blocks=published.blocks)

    def report(self) -> StepReport:
        """What the engine core has not heard yet, once."""
        report = StepReport(failures=self.failures, pages=self.reports)
        self.failures, self.reports = {}, {}
        return report


def _verified(request: WorkerRequest, item: BatchRow) -> tuple[int, int] | None:
    """The request's last step verified draft tokens: vLLM has since rolled its computed count back past the
    rejected ones. Their entries leave the lists (the step's slots overwrite them), and the accepted tokens' queries,
    held back by that step, are settled in this one (`settle_drafts`). Returns (first position, accepted queries),
    or None when its last step had no drafts."""
    if request.drafted is None:
        return None
    first, tokens = request.drafted
    request.drafted = None
    accepted = item.computed - first
    if not 0 < accepted <= tokens:
        raise RuntimeError(
            f"kvserve: request {item.req_id} verified {tokens} tokens from {first} and is now at {item.computed}"
        )
    request.pages.truncate(tokens - accepted)
    return first, accepted


def _take_new_blocks(pages: HeadPages, block_ids: list[int], req_id: str) -> None:
    held = len(pages.blocks)
    if block_ids[:held] != pages.blocks:
        raise RuntimeError(f"kvserve: request {req_id}'s blocks in vLLM and in its page lists differ")
    if len(block_ids) > held:
        pages.add_blocks(block_ids[held:])


def _release(pages: HeadPages) -> StageRelease:
    """What the other workers need of these lists to choose the blocks a request gives back."""
    return StageRelease(
        pages=pages.stage_pages(), block_ids=tuple(pages.blocks), live_pages=tuple(int(n) for n in pages.live_pages())
    )


def _mark_compacted(plan: RowPlan) -> None:
    # entries appended after this compaction have positions from here on
    plan.state.since = plan.compaction.lists_cover
    plan.state.compactions += 1
