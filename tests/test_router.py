"""`kvserve router` over real HTTP: two replica servers (small ASGI apps that answer which replica they are and what
they received, streams included) behind the router, each on a port of its own. A session keeps to the replica the
affinity rule ranks first; a conversation without one keeps to the replica of its opening; a compression is given a
session its questions can carry; a replica that refuses connections is skipped for the next in the key's ranking."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from waiting import wait_until

from kvserve.server.affinity import ranked
from kvserve.server.router import app as router_app
from kvserve.tools.bench.servers import free_port


def replica_app(name: str) -> Starlette:
    async def answer(request: Request):
        body = await request.body()
        received = {"replica": name, "path": request.url.path, "headers": dict(request.headers), "body": body.decode()}
        if json.loads(body or b"{}").get("stream"):

            async def events():
                for part in ("one", "two", "three"):
                    yield f"data: {json.dumps({'part': part, 'replica': name})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(received)

    async def health(request: Request):
        return JSONResponse({})

    return Starlette(routes=[Route("/health", health), Route("/{path:path}", answer, methods=["GET", "POST"])])


class Served:
    """An ASGI app served by uvicorn in a thread of this process, on a free port."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, f"a server on port {self.port}")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def routed():
    replicas = [Served(replica_app(name)) for name in ("a", "b")]
    router = Served(router_app([replica.url for replica in replicas]))
    yield router.url, replicas
    for served in (router, *replicas):
        served.stop()


def post(router: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(router + path, json=body, headers=headers or {}, timeout=30)


def test_a_session_keeps_to_the_replica_its_key_ranks_first(routed):
    router, replicas = routed
    urls = [replica.url for replica in replicas]
    seen = set()
    for number in range(12):
        session = f"user-{number}"
        expected = urls[ranked(session, urls)[0]]
        for turn in range(4):
            headers = {1: {"x-kv-session": session}, 3: {"X-Session-ID": session}}.get(turn, {})
            body = {"prompt": f"turn {turn}", **({} if turn % 2 else {"kv_session": session})}
            response = post(router, "/v1/completions", body, headers)
            assert response.headers["x-kv-replica"] == expected, (session, turn)
            assert json.loads(response.json()["body"]) == body  # forwarded as it came
        seen.add(expected)
    assert seen == set(urls)  # sessions spread over both


def test_a_conversation_without_a_session_keeps_to_the_replica_of_its_opening(routed):
    router, _ = routed
    for number in range(6):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {number}?"}]
        first = post(router, "/v1/chat/completions", {"messages": messages}).headers["x-kv-replica"]
        messages += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
        assert post(router, "/v1/chat/completions", {"messages": messages}).headers["x-kv-replica"] == first
        prompt = f"Document {number}: " + "word " * 200
        opened = post(router, "/v1/completions", {"prompt": prompt}).headers["x-kv-replica"]
        assert post(router, "/v1/completions", {"prompt": prompt + " More."}).headers["x-kv-replica"] == opened


def test_a_compression_is_given_the_session_its_questions_carry(routed):
    router, _ = routed
    body = {"prompt": "a document " * 50, "kv_budget": 64}
    compressed = post(router, "/v1/kvserve/compress", body)
    session = compressed.json()["headers"]["x-kv-session"]
    assert session.startswith("document-")
    again = post(router, "/v1/kvserve/compress", body).json()["headers"]["x-kv-session"]
    assert again == session  # the same document, the same session
    question = post(router, "/v1/completions", {"prompt": "a document " * 50 + "Q?", "kv_session": session})
    assert question.headers["x-kv-replica"] == compressed.headers["x-kv-replica"]


def test_streams_pass_through(routed):
    router, _ = routed
    with httpx.stream("POST", router + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e[6:])["part"] for e in events[:-1]] == ["one", "two", "three"] and events[-1] == "data: [DONE]"


def test_a_replica_that_refuses_connections_is_skipped():
    replicas = [Served(replica_app(name)) for name in ("a", "b")]
    urls = [replica.url for replica in replicas]
    router = Served(router_app(urls))
    try:
        session = next(f"s{n}" for n in range(100) if ranked(f"s{n}", urls)[0] == 0)
        assert (
            post(router.url, "/v1/completions", {"prompt": "x", "kv_session": session}).headers["x-kv-replica"]
            == (urls[0])
        )
        replicas[0].stop()
        wait_until(lambda: _refuses(urls[0]), 30, "the stopped replica refusing connections")
        moved = post(router.url, "/v1/completions", {"prompt": "x", "kv_session": session})
        assert moved.status_code == 200 and moved.headers["x-kv-replica"] == urls[1]
        health = httpx.get(router.url + "/router/health", timeout=30).json()
        assert health == {"replicas": {urls[0]: False, urls[1]: True}}
        replicas[1].stop()
        wait_until(lambda: _refuses(urls[1]), 30, "the second replica refusing connections")
        none = post(router.url, "/v1/completions", {"prompt": "x", "kv_session": session})
        assert none.status_code == 503 and "no replica answered" in none.json()["error"]["message"]
        assert httpx.get(router.url + "/router/health", timeout=30).status_code == 503
    finally:
        router.stop()
        for replica in replicas:
            if replica.thread.is_alive():
                replica.stop()


def _refuses(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    time.sleep(0.1)
    return False


def test_the_scale_out_manifest_routes_to_every_replica_and_scrapes_each():
    """deploy/scale-out/compose.yaml (no cluster here: parsed): the router's command parses with the router's own
    parser and names every replica service at the port it serves on, each replica has CPUs of its own, and
    Prometheus scrapes each replica."""
    from pathlib import Path

    import yaml

    from kvserve.server.router import build_parser

    folder = Path(__file__).parent.parent / "deploy" / "scale-out"
    services = yaml.safe_load((folder / "compose.yaml").read_text())["services"]
    replicas = sorted(name for name in services if name.startswith("replica-"))
    assert len(replicas) >= 2
    command = services["router"]["entrypoint"]
    assert command[:2] == ["kvserve", "router"]
    args = build_parser().parse_args(command[2:])
    assert sorted(args.replica) == [f"http://{name}:8000" for name in replicas]
    assert services["router"]["ports"] == [f"{args.port}:{args.port}"]
    cpus = [services[name]["cpuset"] for name in replicas]
    expanded = [set(range(int(a), int(b) + 1)) for a, b in (cpu.split("-") for cpu in cpus)]
    assert all(not (x & y) for i, x in enumerate(expanded) for y in expanded[i + 1 :])  # no CPU shared
    for name in replicas:
        assert services[name]["image"] == services["router"]["image"]
    scrape = yaml.safe_load((folder / "prometheus.yml").read_text())["scrape_configs"][0]
    assert sorted(scrape["static_configs"][0]["targets"]) == [f"{name}:8000" for name in replicas]
    assert "prometheus.yml" in services["prometheus"]["volumes"][0]
