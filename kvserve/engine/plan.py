"""The messages between scheduler and workers (and between pipeline stages): which requests compact after this
step's forward and to how many entries; what their page lists hold afterwards; which blocks they gave back.

Scheduler -> worker messages ride on vLLM's `SchedulerOutput` as extra attributes (they survive the trip from engine
core to worker); worker -> scheduler ones on the `ModelRunnerOutput`. Scheduling is synchronous, and under pipeline
parallelism an evicting request is never in two batches at once, so for each request schedule -> execute -> update
stay in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAN_ATTR = "kvserve_compactions"


@dataclass(frozen=True)
class Compaction:
    keep_tokens: int  # B: entries per layer and KV head after the step (a ragged policy: at most this many)
    logical_tokens: int  # tokens the request has computed after the step (drives RoPE positions)
    cached_tokens: int  # entries in the longest (layer, head) list after the step's writes, before compaction
    decode: bool = False  # a decode step's compaction: each (layer, head) returns to its share (kv_allocation)
    # blocks whose contents must not change (prefix-cache blocks, blocks another request holds): the compaction
    # copies the pages it would write out of them first, and they all go back to vLLM after the step
    protected_blocks: tuple[int, ...] = ()
    # set when the compaction is at a checkpoint (`kv_checkpoint`): the key its lists are published under
    checkpoint: bytes | None = None


def compactions_of(scheduler_output: object) -> dict[str, Compaction]:
    return getattr(scheduler_output, PLAN_ATTR, None) or {}


# Attribute of a ModelRunnerOutput: {req_id: message} for requests whose policy raised in that step.
FAILURES_ATTR = "kvserve_failures"


def failures_of(model_runner_output) -> dict[str, str]:
    return getattr(model_runner_output, FAILURES_ATTR, None) or {}


# Keys kvserve adds to a request output's `kv_transfer_params` (vLLM's free-form dict that travels with a request's
# output from the scheduler to the front end, beside any KV connector's keys); kvserve/server/evicted.py reads them.
EVICTED_KEY = "kv_tokens_evicted"  # tokens of the sequence no longer in the cache (a running count)
REQUEST_KEY = "kv_request_id"  # the engine request the count belongs to (one HTTP request may have several)
POLICY_FAILURE_KEY = "kv_policy_failure"  # why the engine failed the request, when its eviction policy raised


def with_evicted_count(params: dict | None, request_id: str, tokens: int, policy_failure: str | None = None) -> dict:
    """A request output's `kv_transfer_params` with kvserve's count added (the connector's dict is not mutated),
    and why its policy failed, if it did."""
    failure = {} if policy_failure is None else {POLICY_FAILURE_KEY: policy_failure}
    return {**(params or {}), EVICTED_KEY: tokens, REQUEST_KEY: request_id, **failure}


# Attribute of a ModelRunnerOutput: {req_id: PageReport} for requests that compacted in that step.
PAGES_ATTR = "kvserve_pages"


@dataclass(frozen=True)
class StagePages:
    """One worker's part of a request's page lists (a pipeline stage holds some layers; without pipeline
    parallelism the one worker holds them all)."""

    pages: int  # pages in its lists
    free_slots: tuple[int, ...]  # lists with f free slots in their last page, f = 0 .. block_size - 1
    pages_per_block: int  # its layers x KV heads: the pages one vLLM block holds on this worker
    longest: int  # entries in its longest list
    entries: int  # entries over all its lists


@dataclass(frozen=True)
class PageReport:
    """An evicting request's page lists after a compaction, as the workers left them: what the scheduler needs to
    charge it blocks (each stage's pages now, and how many pages any number of new tokens will take there) and which
    of its vLLM blocks the workers emptied and gave back."""

    logical_tokens: int  # tokens the request had computed when the report was made
    stages: tuple[StagePages, ...]  # one per pipeline stage, first to last
    released_block_ids: tuple[int, ...]
    # a checkpoint the worker published (the plan's `Compaction.checkpoint`): the blocks that hold its lists, in the
    # request's order; empty when the step was no checkpoint or its lists did not fill whole blocks
    checkpoint_blocks: tuple[int, ...] = ()

    @property
    def longest(self) -> int:
        return max(stage.longest for stage in self.stages)

    @property
    def entries(self) -> int:
        return sum(stage.entries for stage in self.stages)


def page_reports_of(model_runner_output) -> dict[str, PageReport]:
    return getattr(model_runner_output, PAGES_ATTR, None) or {}


@dataclass(frozen=True)
class StageRelease:
    """Pipeline parallelism: what one stage tells the last one about a request it compacted, so that every stage
    gives back the SAME blocks (a vLLM block spans all layers, so it is free only when every stage emptied it)."""

    pages: StagePages
    block_ids: tuple[int, ...]  # the request's vLLM blocks, in order
    live_pages: tuple[int, ...]  # pages in use on this stage, per block


# Attribute of a SchedulerOutput (pipeline parallelism only): {req_id: block ids} the last stage gave back after the
# request's last compaction; every earlier stage moves its live pages out of them before this step runs.
RELEASES_ATTR = "kvserve_releases"


def releases_of(scheduler_output: object) -> dict[str, tuple[int, ...]]:
    return getattr(scheduler_output, RELEASES_ATTR, None) or {}


# Attributes of a SchedulerOutput (`kv_checkpoint`): {req_id: (key, block ids)} for requests whose first step resumes
# from a published checkpoint (their first blocks are its blocks), and the (key, block ids) of checkpoints the workers
# must forget (vLLM reused a block, or the scheduler never registered them).
ADOPT_ATTR = "kvserve_adopt"
DROPPED_ATTR = "kvserve_dropped_checkpoints"
CheckpointId = tuple[bytes, tuple[int, ...]]  # (key, the blocks holding the lists): what scheduler and worker share


def adoptions_of(scheduler_output: object) -> dict[str, CheckpointId]:
    return getattr(scheduler_output, ADOPT_ATTR, None) or {}


def dropped_checkpoints_of(scheduler_output: object) -> tuple[CheckpointId, ...]:
    return getattr(scheduler_output, DROPPED_ATTR, None) or ()
