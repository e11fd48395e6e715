"""`kvserve router`: an HTTP front for N kvserve replicas that keeps a conversation on the replica holding its state.

vLLM's CPU build serves a dense model's data parallelism across machines as independent servers behind a load
balancer (it refuses `--data-parallel-rank` for non-MoE models). A generic balancer would scatter a conversation's
turns, and each turn that lands elsewhere recomputes what its checkpoint held. This router forwards every request
(streams included) to the replica `kvserve/server/affinity.py` ranks first for the request's key:

- its session (`x-kv-session` or `X-Session-ID` header, `kv_session` body key), as the API server itself uses it
  between engines;
- else, for generation requests, the conversation's opening (its first messages, or its prompt's first characters),
  so a client that names no session still keeps a conversation together;
- else (model lists, health, metrics, ...) the replicas in turn.

A compression (`POST /v1/kvserve/compress`) without a session is given one, derived from the document, so that the
`kv` settings it answers with (which carry the session) bring its questions back to the same replica. A replica that
refuses connections is skipped for `DOWN_SECONDS` and the request goes to the key's next replica (which recomputes
what it lacks); a request already sent is never sent twice. The response names its replica in `x-kv-replica`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import sys
import time

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.http_client import client_limits
from kvserve.server.affinity import conversation_opening, ranked, session_of
from kvserve.server.paths import COMPLETION_PATHS, COMPRESS_PATH

DOWN_SECONDS = 10.0
GENERATION_PATHS = (*COMPLETION_PATHS, COMPRESS_PATH)  # requests routed by their conversation
# hop-by-hop headers (RFC 9110, section 7.6.1) and what the HTTP client recomputes
NOT_FORWARDED = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length"}


class Router:
    def __init__(self, replicas: list[str], client: httpx.AsyncClient | None = None) -> None:
        if not replicas:
            raise ValueError("kvserve router: give at least one --replica URL")
        self.replicas = [replica.rstrip("/") for replica in replicas]
        self.down_until = dict.fromkeys(self.replicas, 0.0)
        self.turn = itertools.count()
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=client_limits())

    def order(self, key: str | None) -> list[str]:
        """The replicas to try, best first: the key's ranking (or the next in turn), replicas seen down last."""
        if key is None:
            start = next(self.turn) % len(self.replicas)
            candidates = self.replicas[start:] + self.replicas[:start]
        else:
            candidates = [self.replicas[index] for index in ranked(key, self.replicas)]
        now = time.monotonic()
        return sorted(candidates, key=lambda replica: self.down_until[replica] > now)  # stable: keeps the ranking

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in NOT_FORWARDED]
        key = None
        if request.method == "POST" and request.url.path in GENERATION_PATHS:
            try:
                parsed = json.loads(body) if body else None
            except json.JSONDecodeError:
                parsed = None  # the replica answers malformed JSON itself
            key = session_of(headers, parsed)
            if key is None and request.url.path == COMPRESS_PATH:
                key = "document-" + hashlib.blake2b(body, digest_size=12).hexdigest()
                headers.append((b"x-kv-session", key.encode()))
            elif key is None:
                key = conversation_opening(parsed, request.url.path)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        refused = []
        for replica in self.order(key):
            upstream = self.client.build_request(request.method, replica + target, headers=headers, content=body)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self.down_until[replica] = time.monotonic() + DOWN_SECONDS
                refused.append(f"{replica}: {error}")
                continue
            self.down_until[replica] = 0.0
            out_headers = {k: v for k, v in response.headers.items() if k.lower().encode() not in NOT_FORWARDED}
            out_headers["x-kv-replica"] = replica
            return StreamingResponse(
                response.aiter_raw(),
                status_code=response.status_code,
                headers=out_headers,
                background=BackgroundTask(response.aclose),
            )
        return JSONResponse(
            {"error": {"message": "no replica answered: " + "; ".join(refused), "type": "ServiceUnavailable"}},
            status_code=503,
        )

    async def health(self, request: Request) -> Response:
        """Healthy while some replica answers its /health."""
        states = {}
        for replica in self.replicas:
            try:
                states[replica] = (await self.client.get(replica + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                states[replica] = False
        return JSONResponse({"replicas": states}, status_code=200 if any(states.values()) else 503)


def app(replicas: list[str]) -> Starlette:
    router = Router(replicas)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await router.client.aclose()

    return Starlette(
        routes=[
            Route("/router/health", router.health, methods=["GET"]),
            Route("/{path:path}", router.forward, methods=methods),
        ],
        lifespan=lifespan,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat per replica)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    import uvicorn

    print(f"kvserve router: {len(args.replica)} replicas: {', '.join(args.replica)}", file=sys.stderr, flush=True)
    uvicorn.run(app(args.replica), host=args.host, port=args.port, log_level="warning")
