"""Which data-parallel engine (or replica behind a router) serves a request that must meet state left by another.

A chat checkpoint (`kv_checkpoint`), a compressed document (`POST /v1/kvserve/compress`) and a lookahead probe live
in ONE engine's prefix cache or worker: a later request that reaches another engine recomputes (it still answers
correctly, at the cost of a prefill and of the compression it came for). vLLM's own balancer (`--data-parallel-size`)
picks the least loaded engine per request, so a conversation's turns scatter.

A request keeps to one engine by naming a session: the header `x-kv-session: S` (or `X-Session-ID: S`, the header
vLLM's router hashes on) or the body key `kv_session` (either way, as every kvserve setting). Requests of one session
go to the engine `rendezvous(S, engines)` picks; that is highest-random-weight hashing, so the same session always
picks the same engine, sessions spread evenly, and when a replica leaves a router's list only its own sessions move.
The API server pins its engine with vLLM's `X-data-parallel-rank` header (`kvserve/server/middleware.py`); `kvserve
router` picks a replica with the same function (`kvserve/server/router.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidSetting

if TYPE_CHECKING:  # the router imports this module and needs none of the model machinery
    from kvserve.model_support import ServedEngine

SESSION_KEY = "kv_session"
# the headers that name it: kvserve's, and vLLM router's (`vllm-router --policy consistent_hash` keys on X-Session-ID)
SESSION_HEADERS = ("x-kv-session", "x-session-id")
RANK_HEADER = b"x-data-parallel-rank"  # vLLM's: the engine of the API server's balancer a request goes to
MAX_SESSION = 256
# a conversation's opening, for a router's requests without a session: every turn of a conversation begins with it
OPENING_CHARS = 512


def ranked(key: str, choices: Sequence[str]) -> list[int]:
    """The choices' indices by the hash of (key, choice), highest first: the first is the key's, the next its
    fallback should that one be down."""

    def weight(index: int) -> bytes:
        return hashlib.blake2b(f"{choices[index]}\0{key}".encode(), digest_size=8).digest()

    return sorted(range(len(choices)), key=weight, reverse=True)


def rendezvous(key: str, choices: Sequence[str]) -> int:
    """The index of the choice with the highest hash of (key, choice): stable per key, even across keys."""
    if not choices:
        raise ValueError("no choices to route to")
    return ranked(key, choices)[0]


def engine_for(key: str, engines: int) -> int:
    """The data-parallel rank (of an API server's `engines`) that serves session `key`."""
    return rendezvous(key, [f"engine-{rank}" for rank in range(engines)])


def session_of(headers: list[tuple[bytes, bytes]], body: Any) -> str | None:
    """The session a request names (header `x-kv-session` or vLLM router's `X-Session-ID`, body key `kv_session` or
    `vllm_xargs.kv_session`), as a router reads it: without changing the request."""
    for name, value in headers:
        if name.decode("latin-1").lower() in SESSION_HEADERS:
            return value.decode("latin-1").strip()
    if isinstance(body, dict):
        for source in (body, body.get("vllm_xargs")):
            if isinstance(source, dict) and source.get(SESSION_KEY) is not None:
                return str(source[SESSION_KEY])
    return None


def conversation_opening(body: Any, path: str) -> str | None:
    """What every turn of a conversation begins with: a chat's first messages up to the first user message, or a
    completion prompt's first OPENING_CHARS characters (a later turn's prompt extends the earlier one's)."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions") or "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        opening = []
        for message in messages:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return json.dumps(opening, sort_keys=True)[: OPENING_CHARS * 4]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:OPENING_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return json.dumps(prompt[: OPENING_CHARS // 4])
    return None


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
