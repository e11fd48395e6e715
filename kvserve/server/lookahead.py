"""`kv_lookahead=T`: a long prompt's chunks compacted by the votes of its question, computed before the prompt.

With `kv_evict_every_chunk` each prefill chunk is compacted as it arrives, and the queries that vote (SnapKV's window)
are the chunk's own newest ones, which never include the question at the prompt's end: what the question will ask
for is lost before it is read. A server holds the whole prompt when it admits it, so the middleware serves such a
request as two engine requests: first the prompt's last T tokens alone (one token generated, nothing evicted), whose
queries the workers keep per layer (`kvserve/worker/questions.py`); then the request itself, whose compactions inside
the prompt are voted on by those queries at their own positions (`kvserve/worker/eviction.py`). Decode compactions
vote with the request's own window as before. Run alone, the question's queries have not seen the document (the
price of knowing them early); `snapkv_keydiff` adds KeyDiff's choice for what they miss. The transformers reference
is `python -m kvserve.tools.eval.streaming` (`lookahead`, `mix`); measured in docs/benchmarks.md.

The response says `x-kv-lookahead: T`, or `none` when the prompt fits the budget (nothing is evicted).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.config import KVConfig, question_refusal
from kvserve.errors import InvalidSetting
from kvserve.model_support import ServedEngine, served_settings
from kvserve.policies.knobs import parse_int
from kvserve.server.documents import prompt_ids, tokenizer_of
from kvserve.settings import MAX_LOOKAHEAD  # (declared with the setting)


@dataclass(frozen=True)
class Lookahead:
    """A request with kv_lookahead, planned: the body it is served with, and the question's run before it (None:
    the prompt fits its budget, or kv_lookahead is 0)."""

    request_body: dict[str, Any]
    tokens: int = 0
    probe_body: dict[str, Any] | None = None
    probe_config: KVConfig | None = None


def plan_lookahead(body: dict[str, Any], path: str, engine: ServedEngine) -> Lookahead | None:
    """The plan for a request that sets kv_lookahead; None for any other. InvalidSetting names the field of a
    request this cannot serve."""
    xargs = dict(body.get("vllm_xargs") or {})
    if "kv_lookahead" not in xargs:
        return None
    tokens = parse_int("kv_lookahead", xargs.pop("kv_lookahead"))
    if not 0 <= tokens <= MAX_LOOKAHEAD:
        raise InvalidSetting("kv_lookahead", f"must be 0 (off) to {MAX_LOOKAHEAD} prompt tokens, got {tokens}")
    plain = {**body, "vllm_xargs": xargs}
    if tokens == 0:
        return Lookahead(request_body=plain)
    config = served_settings(xargs, engine)  # the rest of its settings, checked as they are
    why = question_refusal(config)
    if why is not None:
        raise InvalidSetting("kv_lookahead", why)
    prompt = prompt_ids(body, path, tokenizer_of(engine), "kv_lookahead")
    if len(prompt) <= config.budget:
        return Lookahead(request_body=plain)
    if tokens >= len(prompt):
        raise InvalidSetting("kv_lookahead", f"must be shorter than the prompt ({len(prompt)} tokens), got {tokens}")
    key = uuid.uuid4().hex
    probe_xargs = {
        "kv_policy": "snapkv",  # it records a window of T queries and keeps everything (T + 1 > T tokens)
        "kv_window": tokens,
        "kv_budget": tokens + 1,
        "kv_span": 1,
        "kv_allocation": "uniform",
        "kv_evict_when": "eager",
        "kv_question_probe": key,
    }
    probe = {"prompt": prompt[-tokens:], "max_tokens": 1, "temperature": 0, "vllm_xargs": probe_xargs}
    for passed in ("model", "cache_salt"):  # (its blocks stay the tenant's)
        if passed in body:
            probe[passed] = body[passed]
    question = {**xargs, "kv_question": key, "kv_question_start": len(prompt) - tokens}
    return Lookahead(
        request_body={**body, "vllm_xargs": question},
        tokens=tokens,
        probe_body=probe,
        probe_config=served_settings(probe_xargs, engine),
    )
