"""Which data-parallel engine serves a request that must meet state left by another.

A chat checkpoint (`kv_checkpoint`), a compressed document (`POST /v1/kvserve/compress`) and a lookahead probe live
in ONE engine's prefix cache or worker: a later request that reaches another engine recomputes (it still answers
correctly, at the cost of a prefill and of the compression it came for). vLLM's own balancer (`--data-parallel-size`)
picks the least loaded engine per request, so a conversation's turns scatter.

A request keeps to one engine by naming a session: the header `x-kv-session: S` (or `X-Session-ID: S`, the header
vLLM's router hashes on) or the body key `kv_session` (either way, as every kvserve setting). Requests of one session
go to the engine `rendezvous(S, engines)` picks; that is highest-random-weight hashing, so the same session always
picks the same engine and sessions spread evenly. The API server pins its engine with vLLM's `X-data-parallel-rank`
header (`kvserve/server/middleware.py`). Across servers, vLLM's router does the same with the same header
(`vllm-router --policy consistent_hash`, docs/guide/deployment.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidSetting

if TYPE_CHECKING:  # the API server's middleware imports this module before the model machinery
    from kvserve.model_support import ServedEngine

SESSION_KEY = "kv_session"
# the headers that name it: kvserve's, and vLLM router's (`vllm-router --policy consistent_hash` keys on X-Session-ID)
SESSION_HEADERS = ("x-kv-session", "x-session-id")
RANK_HEADER = b"x-data-parallel-rank"  # vLLM's: the engine of the API server's balancer a request goes to
MAX_SESSION = 256


def rendezvous(key: str, choices: Sequence[str]) -> int:
    """The index of the choice with the highest hash of (key, choice): stable per key, even across keys."""
    if not choices:
        raise ValueError("no choices to route to")

    def weight(index: int) -> bytes:
        return hashlib.blake2b(f"{choices[index]}\0{key}".encode(), digest_size=8).digest()

    return max(range(len(choices)), key=weight)


def engine_for(key: str, engines: int) -> int:
    """The data-parallel rank (of an API server's `engines`) that serves session `key`."""
    return rendezvous(key, [f"engine-{rank}" for rank in range(engines)])


def check_session(value: Any) -> str:
    session = str(value).strip()
    if not session:
        raise InvalidSetting(SESSION_KEY, "must not be empty")
    if len(session) > MAX_SESSION:
        raise InvalidSetting(SESSION_KEY, f"is longer than {MAX_SESSION} characters")
    return session


def pinned(headers: list[tuple[bytes, bytes]], engine: ServedEngine | None, affinity: str | None) -> list:
    """The request's headers with vLLM's X-data-parallel-rank set to the engine `affinity` maps to, when this API
    server balances over several engines and the client named none itself."""
    if affinity is None or engine is None or engine.engines <= 1:
        return headers
    if any(name.lower() == RANK_HEADER for name, _ in headers):
        return headers  # the client's (or an outer router's) choice stands
    return [*headers, (RANK_HEADER, str(engine_for(affinity, engine.engines)).encode())]


def with_content_length(headers: list[tuple[bytes, bytes]], length: int) -> list:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]
