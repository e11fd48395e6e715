"""How many tokens eviction removed, from the engine to the HTTP response's `usage.kv_tokens_evicted`.

The path, end to end:
1. engine core: the scheduler puts a request's running count under `kv_tokens_evicted` (with the engine request's
   id under `kv_request_id`) in the `kv_transfer_params` of its first output, of every later one where the count
   changed, and of its finished one (vLLM's one free-form dict that travels with a request's output from the
   scheduler to the front end; kvserve adds its keys beside any KV connector's). A running count, not only the final
   one: a request that a stop string ends is finished by the front end and aborted in the engine, which sends
   nothing more;
2. API server: the patched `OutputProcessor.process_outputs` records the latest count per engine request in the
   tally of the HTTP request being served (several engine requests with `n` or a prompt list; the header middleware
   opened the tally, and the patched `AsyncLLM.generate` maps vLLM's request id to it), and `AsyncLLM.generate`
   takes the keys off the outputs it yields (so the response does not grow a `kv_transfer_params` field);
3. the middleware writes the tally's sum into the response's usage block (JSON body, or the final streamed usage
   chunk).

Offline (`vllm.LLM`), the count stays in `RequestOutput.kv_transfer_params["kv_tokens_evicted"]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvserve.messages import EVICTED_KEY, POLICY_FAILURE_KEY, REQUEST_KEY


@dataclass
class EvictedTally:
    """Tokens evicted over the engine requests of one HTTP request (several with `n` or a prompt list)."""

    by_request: dict[str, int] = field(default_factory=dict)  # engine request id -> its latest count
    policy_failure: str | None = None  # set when the engine failed one of them because its policy raised

    @property
    def tokens(self) -> int:
        return sum(self.by_request.values())


_current: ContextVar[EvictedTally | None] = ContextVar("kvserve_evicted_tally", default=None)


def open_tally() -> EvictedTally:
    """Called by the middleware before the app runs; tasks the handler spawns copy the context, so they share it."""
    tally = EvictedTally()
    _current.set(tally)
    return tally


_by_request_id: dict[str, EvictedTally] = {}  # the tally of each engine request a served HTTP request generates


@contextmanager
def tally_for(request_id: str) -> Iterator[None]:
    """While the patched `AsyncLLM.generate` serves `request_id` (vLLM's id for one prompt of an HTTP request), the
    counts of its engine requests go to the current HTTP request's tally."""
    tally = _current.get()
    if tally is not None:
        _by_request_id[request_id] = tally
    try:
        yield
    finally:
        _by_request_id.pop(request_id, None)


def record_engine_outputs(request_states: dict[str, Any], engine_outputs: list[Any]) -> None:
    """Called (patched `OutputProcessor.process_outputs`) on every engine output the front end receives, before vLLM
    turns them into `RequestOutput`s: with `n` > 1 vLLM merges its engine requests' outputs into one and keeps only
    the last one's `kv_transfer_params`, so the counts are read here, per engine request."""
    for output in engine_outputs:
        params = output.kv_transfer_params
        if not params or EVICTED_KEY not in params:
            continue
        state = request_states.get(output.request_id)
        tally = _by_request_id.get(getattr(state, "external_req_id", None))
        if tally is None:
            continue
        tally.by_request[output.request_id] = int(params[EVICTED_KEY])  # a running count: the latest replaces
        if POLICY_FAILURE_KEY in params:
            tally.policy_failure = str(params[POLICY_FAILURE_KEY])


def strip_kvserve_keys(output: Any) -> None:
    """Take kvserve's keys off a served `RequestOutput`, so the response does not grow a `kv_transfer_params` field."""
    params = getattr(output, "kv_transfer_params", None)
    if not params or EVICTED_KEY not in params:
        return
    kept = {key: value for key, value in params.items() if key not in (EVICTED_KEY, REQUEST_KEY, POLICY_FAILURE_KEY)}
    output.kv_transfer_params = kept or None
