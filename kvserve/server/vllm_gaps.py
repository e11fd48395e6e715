"""Requests vLLM 0.32 would answer wrongly (found by `kvserve bench load`'s fuzz): the HTTP middleware answers them
with a 400 saying why instead."""

from __future__ import annotations

from typing import Any

from kvserve.errors import InvalidSetting

# vLLM 0.32 removed these request fields and ignores them with a log line: the output would silently be unconstrained.
REMOVED_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def reject_what_vllm_cannot_serve(body: dict[str, Any], path: str) -> None:
    """Requests vLLM 0.32 would answer wrongly (found by `kvserve bench load`'s fuzz): a 400 saying why instead."""
    for field, replacement in REMOVED_GUIDED_FIELDS.items():
        if field in body:
            raise InvalidSetting(
                field,
                f"{field} was removed in vLLM 0.32 and would be ignored (the output would "
                f'not be constrained); send "structured_outputs": {{"{replacement}": ...}} instead',
            )
    n = body.get("n")
    # OpenAI's best_of samples that many and returns the n most likely; vLLM 0.32 has no such field and ignores it
    if body.get("best_of") not in (None, n or 1):
        raise InvalidSetting(
            "best_of",
            "best_of was removed in vLLM 0.32 and would be ignored (the answer would be n samples, none chosen as "
            "the best of more); ask for n choices with logprobs and pick among them, or use beam search",
        )
    if (
        path == "/v1/completions"
        and body.get("stream")
        and body.get("echo")
        and body.get("logprobs") is not None
        and isinstance(n, int)
        and n > 1
    ):
        raise InvalidSetting(
            "echo",
            "echo with logprobs on a stream with n > 1 breaks in vLLM 0.32 (the echoed "
            "prompt's tokens and log-probabilities fall out of step: an error mid-stream); drop one "
            "of stream, echo and logprobs, or ask for n=1",
        )


def refuse_settings_beam_search_drops(body: dict[str, Any]) -> None:
    """vLLM 0.32's beam search runs each step as a new one-token request of its own sampling parameters, built without
    the request's `vllm_xargs`: a request's own `kv_*` settings would silently not reach the engine (each step gets
    the server's defaults). A 400 saying so instead."""
    asked = [key for key in body.get("vllm_xargs") or {} if key.startswith("kv_")]
    if body.get("use_beam_search") and asked:
        raise InvalidSetting(
            "use_beam_search",
            f"vLLM's beam search runs every step as a new one-token request without the request's settings, so "
            f"{', '.join(sorted(asked))} would not reach the engine (each step's prompt is the whole sequence so far, "
            "served with the server's defaults); send the beam search without kv_* settings or x-kv-* headers",
        )
