"""The message from scheduler to worker: which requests compact after this step's forward, and to how many entries.

It rides on vLLM's `SchedulerOutput` as the attribute `kvserve_compactions` (extra attributes survive the trip from
engine core to worker; on CPU, scheduling is synchronous, so schedule -> execute -> update stay in lockstep).
"""

from __future__ import annotations

from dataclasses import dataclass

PLAN_ATTR = "kvserve_compactions"


@dataclass(frozen=True)
class Compaction:
    keep_tokens: int  # B: entries per layer and KV head after the step (a ragged policy: at most this many)
    logical_tokens: int  # tokens the request has computed after the step (drives RoPE positions)
    cached_tokens: int  # entries in the longest (layer, head) list after the step's writes, before compaction


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
class PageReport:
    """An evicting request's page lists after a compaction, as the worker left them: what the scheduler needs to
    charge it blocks (`pages` now, and how many pages any number of new tokens will take) and which of its vLLM
    blocks the worker emptied and gave back."""

    logical_tokens: int  # tokens the request had computed when the report was made
    pages: int  # pages in its lists
    free_slots: tuple[int, ...]  # lists with f free slots in their last page, f = 0 .. block_size - 1
    longest: int  # entries in its longest list
    entries: int  # entries over all lists
    released_block_ids: tuple[int, ...]


def page_reports_of(model_runner_output) -> dict[str, PageReport]:
    return getattr(model_runner_output, PAGES_ATTR, None) or {}
