"""KVzip under `kv_checkpoint`: the prompt's shared prefix compressed once by its reconstruction, then resumed from.

A request that asks a reconstructing policy (`kvzip`) with `kv_checkpoint` wants compaction that does not depend on
its question, which KVzip gives only when the model has reconstructed the prefix from its cache
(`kvserve/server/documents.py`). So the middleware turns such a request into two engine requests: first the prefix's
compression (what `POST /v1/kvserve/compress` does, skipped when this server already compressed that prefix under the
same settings and salt), then the request itself with `kv_document` set to the prefix, which resumes from the
compressed lists in the prefix cache and keeps the rest of its prompt and its reply in full. The prefix is
- `kv_checkpoint=C`: the prompt's first floor((n - 1) / C) * C tokens, the last checkpoint before its end, where a
  plain policy would have published its last checkpoint;
- `kv_checkpoint=turns` (chat completions): the conversation before its last message, as the chat template renders
  it; the next turn's request starts with this one's whole conversation, so each turn compresses once, and every
  request that repeats a turn (a regenerated answer, other users of a shared conversation) resumes from it.
A prefix that is not longer than `kv_budget` has nothing to compress: the request is served as `full` (its
`x-kv-policy-applied` says so). The response says which happened in `x-kv-document` (`compressed`, `reused`, `none`)
and how long the prefix is in `x-kv-document-tokens`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import env_defaults
from kvserve.errors import InvalidSetting
from kvserve.model_support import ServedEngine
from kvserve.policies import POLICIES
from kvserve.policies.knobs import parse_int
from kvserve.policy_settings import requested_checkpoint, requested_policy
from kvserve.server.documents import Collected, document_ids, prompt_ids, tokenizer_of


@dataclass(frozen=True)
class PrefixCompression:
    """A kvzip request with `kv_checkpoint`, planned: the body it is served with, and the compression to run first
    (None: its prefix is not longer than the budget, and it is served in full)."""

    request_body: dict[str, Any]
    document_tokens: int
    compress_body: dict[str, Any] | None = None
    key: bytes = b""  # the compressed prefix's identity: its tokens, settings, salt and model


def plan_prefix_compression(body: dict[str, Any], path: str, engine: ServedEngine) -> PrefixCompression | None:
    """The plan for a request that asks a reconstructing policy with `kv_checkpoint`; None for any other request (its
    settings are then checked as they are). InvalidSetting names the field of a request this cannot serve."""
    xargs = dict(body.get("vllm_xargs") or {})
    defaults = env_defaults()
    policy = requested_policy(xargs, defaults)  # (kv_checkpoint_policy, kvzip, for checkpoints every C tokens)
    cls = POLICIES.get(policy) if isinstance(policy, str) else None
    checkpoint = requested_checkpoint(xargs, defaults)
    xargs.pop("kv_checkpoint", None)  # (the prefix's compression replaces it)
    if checkpoint in ("0", "") or cls is None or not cls.reconstructs or "kv_document" in xargs:
        return None  # (kv_document with kv_checkpoint is refused by the settings' own check)
    xargs["kv_policy"] = policy  # both engine requests say which policy the plan is for
    budget = xargs.get("kv_budget", defaults.get("kv_budget"))
    if budget is None:
        raise InvalidSetting("kv_budget", f"kv_checkpoint with {policy} compresses the prompt's prefix to kv_budget")
    tokenizer = tokenizer_of(engine)
    document = _prefix(body, path, checkpoint, tokenizer)
    if len(document) <= parse_int("kv_budget", budget):
        body = {key: value for key, value in body.items() if key != "vllm_xargs"}
        return PrefixCompression(request_body={**body, "vllm_xargs": {"kv_policy": "full"}}, document_tokens=0)
    compress_body = {"prompt": document, "vllm_xargs": xargs}
    for passed in ("model", "cache_salt"):
        if passed in body:
            compress_body[passed] = body[passed]
    identity = [document, sorted((k, str(v)) for k, v in xargs.items()), body.get("cache_salt"), body.get("model")]
    return PrefixCompression(
        request_body={**body, "vllm_xargs": {**xargs, "kv_document": len(document)}},
        document_tokens=len(document),
        compress_body=compress_body,
        key=hashlib.sha256(json.dumps(identity).encode()).digest(),
    )


def _prefix(body: dict[str, Any], path: str, checkpoint: str, tokenizer) -> list[int]:
    """The prefix to compress, from the prompt's tokens as vLLM will see them."""
    if checkpoint == "turns" and path != "/v1/chat/completions":
        raise InvalidSetting(
            "kv_checkpoint",
            "turns with kvzip compresses the conversation before its last message: send it to "
            "/v1/chat/completions, or give kv_checkpoint as a token count",
        )
    prompt = prompt_ids(body, path, tokenizer, "kv_checkpoint with kvzip")
    if checkpoint == "turns":
        messages = body["messages"]
        earlier = document_ids({"messages": messages[:-1]}, tokenizer) if len(messages) > 1 else []
        if prompt[: len(earlier)] != earlier:
            raise InvalidSetting(
                "kv_checkpoint",
                "turns with kvzip needs a chat template that renders a conversation's earlier turns as the start "
                "of the whole; give kv_checkpoint as a token count",
            )
        return earlier
    interval = parse_int("kv_checkpoint", checkpoint)
    if interval <= 0:
        raise InvalidSetting("kv_checkpoint", f"must be turns or a token count > 0 with kvzip, got {checkpoint}")
    return prompt[: (len(prompt) - 1) // interval * interval]


class CompressedPrefixes:
    """The prefixes this server compressed (the most recent `capacity`), so each is compressed once: a request whose
    prefix is known resumes from it. A request that found it gone from the prefix cache (vLLM evicted its blocks; the
    request then evicted nothing) makes the next one compress it again (`forget`)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._locks: dict[bytes, asyncio.Lock] = {}

    async def ensure(self, key: bytes, compress: Callable[[], Awaitable[Collected]]) -> tuple[str, Collected | None]:
        """Compress the prefix unless it is known (concurrent requests for one prefix wait for one compression):
        ("compressed" or "reused", None), or ("failed", the compression's response)."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                if key in self._known:
                    self._known.move_to_end(key)
                    return "reused", None
                collected = await compress()
                if collected.status != 200:
                    return "failed", collected
                self._known[key] = None
                while len(self._known) > self.capacity:
                    self._known.popitem(last=False)
                return "compressed", None
        finally:
            if not lock.locked():
                self._locks.pop(key, None)

    def forget(self, key: bytes) -> None:
        self._known.pop(key, None)
