"""ASGI middleware: `x-kv-*` headers -> `vllm_xargs`, validated before vLLM sees the request.

`x-kv-budget: 256` becomes `vllm_xargs["kv_budget"] = "256"` (dashes to underscores), and so does a top-level body key
`"kv_budget": 256` (what OpenAI clients send as `extra_body`; vLLM would otherwise drop it with a log line). A
setting given twice (header, top level, `vllm_xargs`) with different values is a conflict (400), never a silent
choice. Every invalid setting gets HTTP 400 in OpenAI's error format, naming the field. Responses say what was
applied in `x-kv-policy-applied`, `x-kv-budget-applied`, `x-kv-allocation-applied`, `x-kv-span-applied` and
`x-kv-layers-applied` (`all`, or the model layers that evict: a hybrid local/global model's full-attention layers,
which B applies to), and how many tokens eviction removed in `usage.kv_tokens_evicted`.

The plugin installs this middleware inside vLLM's own (`kvserve/vllm/patches.py`), so with `--api-key` an
unauthenticated request gets vLLM's 401 before anything here reads it.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable

from kvserve.config import INTERNAL_KEYS
from kvserve.errors import InvalidSetting
from kvserve.messages import EVICTED_KEY
from kvserve.model_support import EvictionSupport, ServedEngine, eviction_support, served_settings
from kvserve.server.affinity import SESSION_KEY, pinned, with_content_length
from kvserve.server.checkpoint_documents import CompressedPrefixes, PrefixCompression, plan_prefix_compression
from kvserve.server.documents import Collected, compress_request, compress_response, reconstruct
from kvserve.server.evicted import EvictedTally, open_tally
from kvserve.server.lookahead import Lookahead, plan_lookahead
from kvserve.server.paths import COMPLETION_PATHS, COMPRESS_PATH
from kvserve.server.request_keys import HEADER_PREFIX, headers_to_xargs, merge_into_body, pop_session
from kvserve.server.vllm_gaps import refuse_settings_beam_search_drops, reject_what_vllm_cannot_serve

HANDLED = "kvserve.headers_handled"  # scope key: a second copy of this middleware (given by --middleware too) passes


def error_body(field: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": field, "code": 400}}).encode()


class KVHeadersMiddleware:
    """`served(scope)` says which engine serves a request (`kvserve/vllm/model.py` reads it off vLLM's app; None: not
    known, the checks that need the model wait for vLLM's input validation)."""

    def __init__(self, app, served: Callable[[dict], ServedEngine | None] = lambda scope: None) -> None:
        self.app = app
        self.served = served
        self.prefixes = CompressedPrefixes()  # kvzip with kv_checkpoint (`kvserve/server/checkpoint_documents.py`)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == COMPRESS_PATH:
            await self._compress(scope, receive, send)
            return
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in COMPLETION_PATHS
            or scope.get(HANDLED)
        ):
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        plan: PrefixCompression | None = None
        lookahead: Lookahead | None = None
        try:
            header_xargs = headers_to_xargs(scope["headers"])
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                body = None  # not ours to judge: vLLM answers malformed JSON itself
            if isinstance(body, dict):
                reject_what_vllm_cannot_serve(body, scope["path"])
                body = merge_into_body(body, header_xargs)
                refuse_settings_beam_search_drops(body)
                session = pop_session(body)
                for key in INTERNAL_KEYS:
                    if key in (body.get("vllm_xargs") or {}):
                        raise InvalidSetting(key, "is set by kvserve itself, not by a request")
                engine = self.served(scope)
                if engine is not None:
                    plan = plan_prefix_compression(body, scope["path"], engine)
                    body = body if plan is None else plan.request_body
                    lookahead = plan_lookahead(body, scope["path"], engine)
                    body = body if lookahead is None else lookahead.request_body
                # here, a streamed request still gets a 400 rather than an error event (without an engine known, the
                # checks that need the model wait for vLLM's validation)
                config = served_settings(body.get("vllm_xargs"), engine, remember=True)
                layers = "all" if engine is None else evicting_layers(eviction_support(engine.model_config))
                raw = json.dumps(body).encode()
            elif header_xargs:
                raise InvalidSetting("body", "x-kv-* headers need a JSON object body")
            else:
                config, layers, session, engine = None, "all", None, None
        except InvalidSetting as exc:
            await _send_json(send, 400, error_body(exc.field, str(exc)))
            return
        # what must meet state in one engine: the session's, the compressed prefix's, the lookahead probe's
        affinity = session or (plan.key.hex() if plan is not None and plan.key else None)
        if affinity is None and lookahead is not None and lookahead.probe_body is not None:
            affinity = uuid.uuid4().hex
        scope = dict(scope, headers=with_content_length(pinned(scope["headers"], engine, affinity), len(raw)))
        scope[HANDLED] = True
        extra_headers: list[tuple[bytes, bytes]] = []
        if plan is not None:
            done = "none"
            if plan.compress_body is not None:
                compress = plan.compress_body
                done, failed = await self.prefixes.ensure(plan.key, lambda: self._compressed(scope, receive, compress))
                if failed is not None:
                    await _send_json(send, failed.status or 500, failed.body)
                    return
            extra_headers = [
                (b"x-kv-document", done.encode()),
                (b"x-kv-document-tokens", str(plan.document_tokens).encode()),
            ]
        if lookahead is not None:
            extra_headers.append((b"x-kv-lookahead", str(lookahead.tokens or "none").encode()))
            if lookahead.probe_body is not None:  # the question alone first: the workers keep its queries
                asked = await self._engine_completion(
                    scope, receive, lookahead.probe_body, lookahead.probe_config, engine
                )
                if asked.status != 200:
                    await _send_json(send, asked.status or 500, asked.body)
                    return
        tally = open_tally()
        await self.app(scope, _replay(raw, receive), _with_applied_headers(send, config, layers, tally, extra_headers))
        if plan is not None and plan.compress_body is not None and not tally.tokens:
            self.prefixes.forget(plan.key)  # it was gone from the prefix cache: the next request compresses it again

    async def _compressed(self, scope, receive, body: dict) -> Collected:
        """A prefix's compression (`kvserve/server/checkpoint_documents.py`) as `POST /v1/kvserve/compress` runs it;
        its response is kept, not sent."""
        engine = self.served(scope)
        try:
            completions, _, _ = compress_request(body, engine)
            configs = [served_settings(completion["vllm_xargs"], engine) for completion in completions]
        except InvalidSetting as exc:
            collected = Collected()
            collected.status, collected.body = 400, error_body(exc.field, str(exc))
            return collected
        run = functools.partial(self._engine_completion, scope, receive, engine=engine)
        return await reconstruct(run, completions, configs)

    async def _compress(self, scope, receive, send) -> None:
        """`POST /v1/kvserve/compress` (`kvserve/server/documents.py`): one engine completion through vLLM's own
        handler, answered with what a question needs to resume from the compressed document."""
        started = time.perf_counter()
        engine = self.served(scope)
        try:
            try:
                body = json.loads(await _read_body(receive))
            except json.JSONDecodeError as exc:
                raise InvalidSetting("body", f"is not valid JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise InvalidSetting("body", "must be a JSON object")
            if engine is None:
                raise InvalidSetting("model", "the served engine is not known to kvserve yet")
            body = merge_into_body(body, headers_to_xargs(scope["headers"]))
            session = pop_session(body)
            if session is None and engine.engines > 1:
                session = uuid.uuid4().hex  # its questions name it to reach the engine holding the document
            completions, question_settings, tokens = compress_request(body, engine)
            if session is not None:
                question_settings = {**question_settings, SESSION_KEY: session}
            configs = [served_settings(c["vllm_xargs"], engine, remember=True) for c in completions]
        except InvalidSetting as exc:
            await _send_json(send, 400, error_body(exc.field, str(exc)))
            return
        scope = dict(scope, headers=pinned(scope["headers"], engine, session))
        run = functools.partial(self._engine_completion, scope, receive, engine=engine)
        collected = await reconstruct(run, completions, configs)
        if collected.status != 200:
            await _send_json(send, collected.status or 500, collected.body)
            return
        seconds = time.perf_counter() - started
        await _send_json(send, 200, compress_response(collected.body, question_settings, tokens, seconds))

    async def _engine_completion(self, scope, receive, completion: dict, config, engine: ServedEngine) -> Collected:
        """One completion through vLLM's own handler, its response collected."""
        raw = json.dumps(completion).encode()
        inner = dict(
            scope,
            path="/v1/completions",
            raw_path=b"/v1/completions",
            headers=[
                (k, v)
                for k, v in scope["headers"]
                if k.lower() != b"content-length" and not k.startswith(HEADER_PREFIX)
            ]
            + [(b"content-length", str(len(raw)).encode()), (b"content-type", b"application/json")],
        )
        inner[HANDLED] = True
        collected = Collected()
        layers = evicting_layers(eviction_support(engine.model_config))
        await self.app(inner, _replay(raw, receive), _with_applied_headers(collected, config, layers, open_tally()))
        return collected


def evicting_layers(support: EvictionSupport) -> str:
    """`x-kv-layers-applied`: `all`, or the model layers that evict (a hybrid model's full-attention layers)."""
    return ",".join(str(layer) for layer in support.paged_layers) if support.hybrid else "all"


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """Hand the (rewritten) body to the app once, then the real channel: vLLM watches it to abort on disconnect."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_applied_headers(send, config, layers: str, tally: EvictedTally, extra: list | None = None):
    """Say what was applied (headers) and what was evicted (usage block); on a 500 for a request whose policy failed,
    say which policy. A JSON body is buffered to rewrite it (it is small); a stream is rewritten event by event, and
    its start is held until its first event: vLLM validates some fields (logprobs, logit_bias, structured output)
    only once the stream has begun, and reports them as an error event after a 200; such a stream becomes the 4xx it
    means."""
    held_start: dict | None = None
    held_body: list[bytes] = []
    held_stream_start: dict | None = None
    rejected_stream = False

    async def wrapped(message):
        nonlocal held_start, held_stream_start, rejected_stream
        if rejected_stream:
            return  # the rest of a stream already answered with its error ([DONE])
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if config is not None:
                headers.append((b"x-kv-policy-applied", config.policy.encode()))
                if config.budget is not None:
                    headers.append((b"x-kv-budget-applied", str(config.budget).encode()))
                if config.evicts:  # what the server's defaults and the request made of these two
                    headers.append((b"x-kv-allocation-applied", config.allocation.encode()))
                    headers.append((b"x-kv-span-applied", str(config.span).encode()))
                    headers.append((b"x-kv-layers-applied", layers.encode()))
            headers += extra or []
            message = dict(message, headers=headers)
            content_type = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
            if content_type.startswith(b"application/json") and message["status"] in (200, 500):
                held_start = message
                return
            if content_type.startswith(b"text/event-stream") and message["status"] == 200:
                held_stream_start = message
                return
        elif message["type"] == "http.response.body" and held_start is not None:
            held_body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(held_body)
            if held_start["status"] == 500 and config is not None and tally.policy_failure is not None:
                body = name_the_policy(body, config.policy, tally.policy_failure)
            elif held_start["status"] == 200:
                body = _add_evicted_to_usage(body, tally)
            headers = [(k, v) for k, v in held_start["headers"] if k.lower() != b"content-length"]
            await send(dict(held_start, headers=headers + [(b"content-length", str(len(body)).encode())]))
            await send({"type": "http.response.body", "body": body})
            return
        elif message["type"] == "http.response.body" and held_stream_start is not None:
            start, held_stream_start = held_stream_start, None
            status, error = _client_error_event(message.get("body", b""))
            if error is not None:
                rejected_stream = message.get("more_body", False)
                body = json.dumps({"error": error}).encode()
                headers = [(k, v) for k, v in start["headers"] if k.lower() not in (b"content-type", b"content-length")]
                await send(
                    dict(
                        start,
                        status=status,
                        headers=headers
                        + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                    )
                )
                await send({"type": "http.response.body", "body": body})
                return
            await send(start)
        if message["type"] == "http.response.body" and b'"usage":{' in message.get("body", b""):
            message = dict(message, body=_add_evicted_to_stream_event(message["body"], tally))
        await send(message)

    return wrapped


def _client_error_event(body: bytes) -> tuple[int, dict | None]:
    """(status, error) when a stream's first event is vLLM's error event for a bad request (code 4xx)."""
    if not body.startswith(b"data: {"):
        return 0, None
    try:
        error = json.loads(body[len(b"data: ") :].split(b"\n\n", 1)[0]).get("error")
    except (ValueError, AttributeError):
        return 0, None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        return code, error
    return 0, None


def _add_evicted_to_usage(body: bytes, tally: EvictedTally) -> bytes:
    try:
        response = json.loads(body)
    except ValueError:
        return body
    if not isinstance(response, dict) or not isinstance(response.get("usage"), dict) or not tally.by_request:
        return body
    response["usage"][EVICTED_KEY] = tally.tokens
    return json.dumps(response).encode()


def _add_evicted_to_stream_event(body: bytes, tally: EvictedTally) -> bytes:
    """vLLM sends each server-sent event as one body message: `data: {json}\n\n`. The usage chunk comes after the
    last output, so the tally is complete by then."""
    prefix, _, rest = body.partition(b"data: ")
    payload = rest.rstrip(b"\n")
    rewritten = _add_evicted_to_usage(payload, tally)
    if prefix or rewritten is payload:
        return body
    return b"data: " + rewritten + rest[len(payload) :]


def name_the_policy(body: bytes, policy: str, failure: str) -> bytes:
    """vLLM answers a request the engine failed with a bare "Internal server error"; when kvserve's engine failed it
    because its eviction policy raised, the message says so (the scheduler tags such requests' outputs)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return body
    error["message"] += (
        f" (kv_policy {policy!r} failed: {failure}. kvserve fails a request whose eviction policy"
        " raises; the server log has the traceback, kvserve:policy_errors_total counts them)"
    )
    return json.dumps({"error": error}).encode()


async def _send_json(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
