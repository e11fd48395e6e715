"""The messages between the engine core and the workers (and between pipeline stages), as vLLM v1's scheduler and
workers exchange theirs: once per step, the core's `StepPlan` (which requests start with which settings, which
compact after this step's forward and to how many entries, which resume from a checkpoint) and the workers'
`StepReport` (what the compacted requests' page lists hold afterwards and which blocks they gave back; which requests
failed).

They ride on vLLM's `SchedulerOutput` and `ModelRunnerOutput` (`kvserve/vllm/carriers.py`), which reach the workers
and come back pickled. Scheduling is synchronous, and under pipeline parallelism an evicting request is never in two
batches at once, so for each request schedule -> execute -> update stay in lockstep.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvserve.config import KVConfig


def cdiv(a, b):
    """Ceiling division: the pages or blocks that `a` entries or pages take at `b` per page or block."""
    return -(-a // b)


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
    # the logical tokens the compacted lists stand for, when not `logical_tokens`: a document's reconstruction
    # (`kv_reconstruct`) keeps only the document's entries, so its lists are the document's
    covers: int | None = None

    @property
    def lists_cover(self) -> int:
        return self.logical_tokens if self.covers is None else self.covers


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


@dataclass(frozen=True)
class StagePages:
    """One worker's part of a request's page lists (a pipeline stage holds some layers; without pipeline
    parallelism the one worker holds them all)."""

    pages: int  # pages in its lists
    free_slots: tuple[int, ...]  # lists with f free slots in their last page, f = 0 .. block_size - 1
    pages_per_block: int  # its layers x KV heads: the pages one vLLM block holds on this worker
    longest: int  # entries in its longest list
    entries: int  # entries over all its lists

    def pages_after(self, tokens: int) -> int:
        """Pages its lists hold once `tokens` more entries are appended to every list."""
        return self.pages + _pages_for(self._lists_by_free, tokens, len(self.free_slots))

    @functools.cached_property
    def _lists_by_free(self) -> tuple[tuple[int, int], ...]:
        """(f, lists with f free slots) for the f some list has: the scheduler asks `pages_after` several times per
        request and step, and a walk over all block_size counts each time was most of what it added to vLLM's
        scheduling."""
        return tuple((free, count) for free, count in enumerate(self.free_slots) if count)


def pages_needed(free_slot_counts: tuple[int, ...], tokens: int) -> int:
    """Pages that appending `tokens` entries to every list takes, given how many lists have f free slots in their
    last page for f = 0 .. block_size - 1 (`HeadPages.free_slot_counts()`)."""
    lists_by_free = ((free, count) for free, count in enumerate(free_slot_counts) if count)
    return _pages_for(lists_by_free, tokens, len(free_slot_counts))


def _pages_for(lists_by_free, tokens: int, block_size: int) -> int:
    """Pages that `tokens` more entries take over lists given as (f free slots, lists with f) pairs."""
    return sum(count * cdiv(max(tokens - free, 0), block_size) for free, count in lists_by_free)


@dataclass(frozen=True)
class PageReport:
    """An evicting request's page lists after a compaction, as the workers left them: what the scheduler needs to
    charge it blocks (each stage's pages now, and how many pages any number of new tokens will take there) and which
    of its vLLM blocks the workers emptied and gave back."""

    logical_tokens: int  # tokens the request had computed when the report was made
    stages: tuple[StagePages, ...]  # one per worker: pipeline stages first to last, each stage's ranks in order
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


@dataclass(frozen=True)
class StageRelease:
    """What one worker (a pipeline stage, a tensor-parallel rank) tells the others about a request it compacted, so
    that every worker gives back the SAME blocks (a vLLM block spans all layers and KV heads, so it is free only when
    every worker emptied it)."""

    pages: StagePages
    block_ids: tuple[int, ...]  # the request's vLLM blocks, in order
    live_pages: tuple[int, ...]  # pages in use on this stage, per block

    @property
    def counts(self) -> tuple[int, int, tuple[int, ...]]:
        """(pages in use, pages per block, live pages per block): what `blocks_to_release` weighs."""
        return self.pages.pages, self.pages.pages_per_block, self.live_pages


CheckpointId = tuple[bytes, tuple[int, ...]]  # (key, the blocks holding the lists): what core and workers share


@dataclass(frozen=True)
class StepPlan:
    """Engine core -> workers, with each scheduled step."""

    # requests the step starts that evict: their settings, as the front end validated them
    admitted: dict[str, KVConfig] = field(default_factory=dict)
    compactions: dict[str, Compaction] = field(default_factory=dict)  # requests that compact after the forward
    # requests whose first step resumes from a published checkpoint (their first blocks are its blocks)
    adopt: dict[str, CheckpointId] = field(default_factory=dict)
    # checkpoints the workers must forget: vLLM reused a block, or the core never registered them
    dropped: tuple[CheckpointId, ...] = ()
    # pipeline parallelism: blocks the last stage gave back after a request's last compaction; every earlier stage
    # moves its live pages out of them before this step runs
    releases: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepReport:
    """Workers -> engine core, with each step's output (the last pipeline stage's, which speaks for all)."""

    failures: dict[str, str] = field(default_factory=dict)  # requests whose policy raised: why
    pages: dict[str, PageReport] = field(default_factory=dict)  # requests that compacted: their lists now
