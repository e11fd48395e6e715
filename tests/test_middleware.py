"""The header middleware on a stand-in ASGI app: what it forwards, what it answers, how it labels engine failures."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from kvserve.server.evicted import record_engine_outputs, tally_for
from kvserve.server.middleware import KVHeadersMiddleware

ENGINE_FAILURE = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


def through_middleware(app, request_body: bytes, headers: dict[str, str]) -> list[dict]:
    """POST /v1/completions with this body and these headers through the middleware to `app`; what it sent back."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": request_body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(KVHeadersMiddleware(app)(scope, receive, send))
    return sent


def run(headers: dict[str, str], status: int, reply: dict, chunks: int = 1, policy_failure: str | None = None):
    """One POST /v1/completions through the middleware to an app that answers `status` with `reply`; with
    `policy_failure`, the engine's finished output first says that the request's policy raised."""
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = json.loads((await receive())["body"])
        if policy_failure is not None:  # what the patched AsyncLLM.generate and OutputProcessor do
            output = SimpleNamespace(
                request_id="cmpl-1-0-a",
                kv_transfer_params={
                    "kv_tokens_evicted": 0,
                    "kv_request_id": "cmpl-1-0-a",
                    "kv_policy_failure": policy_failure,
                },
            )
            with tally_for("cmpl-1-0"):
                record_engine_outputs({"cmpl-1-0-a": SimpleNamespace(external_req_id="cmpl-1-0")}, [output])
        body = json.dumps(reply).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        step = max(1, len(body) // chunks)
        parts = [body[i : i + step] for i in range(0, len(body), step)]
        for number, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": number < len(parts) - 1})

    sent = through_middleware(app, b'{"prompt": "hi", "max_tokens": 2}', headers)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start, body, seen


def test_an_engine_failure_of_an_evicting_request_names_its_policy():
    start, body, seen = run(
        {"x-kv-policy": "tova", "x-kv-budget": "64"}, 500, ENGINE_FAILURE, chunks=3, policy_failure="ValueError: boom"
    )
    assert seen["body"]["vllm_xargs"] == {"kv_policy": "tova", "kv_budget": "64"}
    assert start["status"] == 500
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["message"].startswith("Internal server error") and "kv_policy 'tova' failed" in error["message"]
    assert "ValueError: boom" in error["message"]
    assert error["code"] == 500


def test_an_engine_failure_that_is_not_the_policys_is_not_blamed_on_it():
    """E.g. a grammar vLLM's front end accepted and its engine could not compile: vLLM's 500, unchanged."""
    start, body, _ = run({"x-kv-policy": "tova", "x-kv-budget": "64"}, 500, ENGINE_FAILURE)
    assert start["status"] == 500 and json.loads(body) == ENGINE_FAILURE


def run_stream(events: list[bytes]):
    """One streamed POST through the middleware to an app that answers 200 with these server-sent events."""

    async def app(scope, receive, send):
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for number, event in enumerate(events):
            await send({"type": "http.response.body", "body": event, "more_body": number < len(events) - 1})

    return through_middleware(app, b'{"prompt": "hi", "stream": true}', {"x-kv-policy": "full"})


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_a_stream_that_opens_with_a_bad_request_event_is_that_4xx():
    error = {
        "message": "Requested sample logprobs of 50, which is greater than max allowed: 20",
        "type": "BadRequestError",
        "param": "logprobs",
        "code": 400,
    }
    sent = run_stream([_event({"error": error}), b"data: [DONE]\n\n"])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 400
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"x-kv-policy-applied"] == b"full"
    assert int(headers[b"content-length"]) == len(sent[1]["body"])
    assert json.loads(sent[1]["body"]) == {"error": error}


def test_other_streams_pass_unchanged():
    token = _event({"choices": [{"text": "x"}]})
    failure = _event({"error": {"message": "Internal server error", "code": 500}})  # mid-generation: stays an event
    for events in ([token, token, b"data: [DONE]\n\n"], [failure, b"data: [DONE]\n\n"]):
        sent = run_stream(events)
        assert sent[0]["status"] == 200
        assert [m["body"] for m in sent[1:]] == events


def test_other_responses_pass_unchanged():
    ok = {"choices": [{"text": "x"}]}
    for headers, status, reply in [
        ({"x-kv-policy": "snapkv", "x-kv-budget": "64"}, 200, ok),
        ({"x-kv-policy": "full"}, 500, ENGINE_FAILURE),
    ]:
        start, body, _ = run(headers, status, reply)
        assert start["status"] == status and json.loads(body) == reply
        assert dict(start["headers"])[b"x-kv-policy-applied"] == headers["x-kv-policy"].encode()


def test_the_usage_block_gets_the_evicted_count_once_the_engine_reported_it():
    from kvserve.server.evicted import EvictedTally
    from kvserve.server.middleware import _add_evicted_to_stream_event, _add_evicted_to_usage

    done = EvictedTally(by_request={"cmpl-1-0": 200, "cmpl-1-1": 36})
    body = json.dumps({"id": "cmpl-1", "usage": {"prompt_tokens": 300}}).encode()
    assert json.loads(_add_evicted_to_usage(body, done))["usage"] == {"prompt_tokens": 300, "kv_tokens_evicted": 236}
    assert _add_evicted_to_usage(body, EvictedTally()) == body  # nothing reported (yet): no made-up zero
    event = b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":300}}\n\n'
    rewritten = _add_evicted_to_stream_event(event, done)
    assert rewritten.startswith(b"data: ") and rewritten.endswith(b"}\n\n")
    assert json.loads(rewritten[6:])["usage"]["kv_tokens_evicted"] == 236
    assert _add_evicted_to_stream_event(b"data: [DONE]\n\n", done) == b"data: [DONE]\n\n"
