"""How many tokens eviction removed, from the engine to the HTTP response's `usage.kv_tokens_evicted`.

The path, end to end:
1. engine core: the scheduler puts each finished request's count under `kv_tokens_evicted` in the request's
   `kv_transfer_params` (vLLM's one free-form dict that travels with a finished request from the scheduler to the
   front end; kvserve adds its key beside any KV connector's);
2. API server: the patched `AsyncLLM.generate` takes the key out again (so the response does not grow a
   `kv_transfer_params` field) and adds the count to the tally of the HTTP request being served, a context variable
   the header middleware opened for it;
3. the middleware writes the tally into the response's usage block (JSON body, or the final streamed usage chunk).

Offline (`vllm.LLM`), the count stays in `RequestOutput.kv_transfer_params["kv_tokens_evicted"]`.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

EVICTED_KEY = "kv_tokens_evicted"


@dataclass
class EvictedTally:
    """Tokens evicted over the finished engine requests of one HTTP request (several with `n` or a prompt list)."""

    tokens: int = 0
    finished_requests: int = 0


_current: ContextVar[EvictedTally | None] = ContextVar("kvserve_evicted_tally", default=None)


def open_tally() -> EvictedTally:
    """Called by the middleware before the app runs; tasks the handler spawns copy the context, so they share it."""
    tally = EvictedTally()
    _current.set(tally)
    return tally


def with_evicted_count(params: dict[str, Any] | None, tokens: int) -> dict[str, Any]:
    """A finished request's `kv_transfer_params` with kvserve's count added (the connector's dict is not mutated)."""
    return {**(params or {}), EVICTED_KEY: tokens}


def take_evicted_count(output: Any) -> None:
    """Move the count off a `RequestOutput` into the current HTTP request's tally (if any)."""
    params = getattr(output, "kv_transfer_params", None)
    if not params or EVICTED_KEY not in params:
        return
    params = dict(params)
    tokens = int(params.pop(EVICTED_KEY))
    output.kv_transfer_params = params or None
    tally = _current.get()
    if tally is not None:
        tally.tokens += tokens
        tally.finished_requests += 1
