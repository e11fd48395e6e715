"""The HTTP connection limits of kvserve's clients of vLLM's API server: the tools (benchmarks, evaluations,
the load test).

vLLM's API server closes a connection that has been idle for 5 s (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`), and httpx reuses
an idle connection for up to its `keepalive_expiry`, also 5 s by default: a request sent on a connection the server
was closing at that moment came back "Server disconnected without sending a response" (seen twice in `kvserve bench
capacity` runs, once on each server). kvserve's clients drop idle connections well before the server would.
"""

from __future__ import annotations

import httpx

KEEPALIVE_EXPIRY_S = 1.0


def client_limits(max_connections: int = 100, max_keepalive_connections: int = 20) -> httpx.Limits:
    """httpx's default limits with idle connections dropped after `KEEPALIVE_EXPIRY_S`."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
