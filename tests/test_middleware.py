"""The header middleware on a stand-in ASGI app: what it forwards, what it answers, how it labels engine failures."""

from __future__ import annotations

import asyncio
import json

from kvserve.server.middleware import KVHeadersMiddleware

ENGINE_FAILURE = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}


def run(headers: dict[str, str], status: int, reply: dict, chunks: int = 1):
    """One POST /v1/completions through the middleware to an app that answers `status` with `reply`."""
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = json.loads((await receive())["body"])
        body = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        step = max(1, len(body) // chunks)
        parts = [body[i : i + step] for i in range(0, len(body), step)]
        for number, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": number < len(parts) - 1})

    sent = []

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "hi", "max_tokens": 2}', "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(KVHeadersMiddleware(app)(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start, body, seen


def test_an_engine_failure_of_an_evicting_request_names_its_policy():
    start, body, seen = run({"x-kv-policy": "tova", "x-kv-budget": "64"}, 500, ENGINE_FAILURE, chunks=3)
    assert seen["body"]["vllm_xargs"] == {"kv_policy": "tova", "kv_budget": "64"}
    assert start["status"] == 500
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["message"].startswith("Internal server error") and "kv_policy 'tova'" in error["message"]
    assert error["code"] == 500


def test_other_responses_pass_unchanged():
    ok = {"choices": [{"text": "x"}]}
    for headers, status, reply in [({"x-kv-policy": "snapkv", "x-kv-budget": "64"}, 200, ok),
                                   ({"x-kv-policy": "full"}, 500, ENGINE_FAILURE)]:
        start, body, _ = run(headers, status, reply)
        assert start["status"] == status and json.loads(body) == reply
        assert dict(start["headers"])[b"x-kv-policy-applied"] == headers["x-kv-policy"].encode()


def test_the_usage_block_gets_the_evicted_count_once_the_engine_reported_it():
    from kvserve.server.evicted import EvictedTally
    from kvserve.server.middleware import _add_evicted_to_stream_event, _add_evicted_to_usage

    done = EvictedTally(tokens=236, finished_requests=1)
    body = json.dumps({"id": "cmpl-1", "usage": {"prompt_tokens": 300}}).encode()
    assert json.loads(_add_evicted_to_usage(body, done))["usage"] == {"prompt_tokens": 300, "kv_tokens_evicted": 236}
    assert _add_evicted_to_usage(body, EvictedTally()) == body  # nothing reported (yet): no made-up zero
    event = b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":300}}\n\n'
    rewritten = _add_evicted_to_stream_event(event, done)
    assert rewritten.startswith(b"data: ") and rewritten.endswith(b"}\n\n")
    assert json.loads(rewritten[6:])["usage"]["kv_tokens_evicted"] == 236
    assert _add_evicted_to_stream_event(b"data: [DONE]\n\n", done) == b"data: [DONE]\n\n"
