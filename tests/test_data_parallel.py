"""Data parallelism with eviction: ONE real `kvserve serve --data-parallel-size 2` (vLLM's internal balancer, an
engine per CPU) against the single-engine `server` fixture started with the same flags.

Each engine evicts as the single engine does (same text, evicted count and applied headers for a request sent to
either, settings given as headers or body keys); `/metrics` counts kvserve's series per engine under vLLM's own
`engine` label, each engine's equal to what its requests reported, nothing counted twice; a session
(`x-kv-session`) keeps a conversation on the engine holding its checkpoints, so its later turns resume from them,
and a turn sent to the other engine recomputes and answers the same; both pools are whole again afterwards.
"""

from __future__ import annotations

import os
import uuid

import httpx
import pytest
from engine_settings import SERVED_MODEL, SERVER_ARGS
from waiting import wait_until

from kvserve.server.affinity import engine_for
from kvserve.tools.bench.sessions import grew, per_engine

ENGINES = 2
RANK = "X-data-parallel-rank"  # vLLM's header: which engine serves the request


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < ENGINES:
        pytest.skip("two data-parallel engines need a CPU each; this process may use one")
    from kvserve.tools.bench.servers import running_server

    log_path = tmp_path_factory.mktemp("dp_server") / "server.log"
    args = [*SERVER_ARGS, "--data-parallel-size", str(ENGINES)]
    with running_server("kvserve", None, args, log_path, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
        yield base


def scrape(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=60).text


def complete(base: str, prompt, headers: dict | None = None, max_tokens: int = 8, **body) -> httpx.Response:
    payload = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}
    response = httpx.post(base + "/v1/completions", json=payload, headers=headers or {}, timeout=300)
    assert response.status_code == 200, response.text
    return response


def applied(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("x-kv-") and k.endswith("-applied")}


def test_each_engine_evicts_as_one_engine_does_and_counts_under_its_own_label(dp_server, server, long_prompt):
    """The same request sent to engine 0, to engine 1 and to the single-engine server: the same text, evicted count
    and applied headers, with the settings as headers on one engine and as body keys on the other. Each engine's
    kvserve:tokens_evicted_total grew by what its requests reported, and vLLM's own per-engine count of finished
    requests agrees on which engine served them."""
    settings = [({"x-kv-policy": "snapkv", "x-kv-budget": "64"}, {}), ({}, {"kv_policy": "h2o", "kv_budget": 96})]
    before = scrape(dp_server)
    reported = {str(rank): 0 for rank in range(ENGINES)}
    for headers, body in settings:
        reference = complete(server, long_prompt, headers, **body)
        for rank in range(ENGINES):
            served = complete(dp_server, long_prompt, {**headers, RANK: str(rank)}, **body)
            label = f"engine {rank}, {headers or body}"
            assert served.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"], label
            assert served.json()["usage"]["kv_tokens_evicted"] == reference.json()["usage"]["kv_tokens_evicted"] > 0
            assert applied(served) == applied(reference), label
            reported[str(rank)] += served.json()["usage"]["kv_tokens_evicted"]
    after = scrape(dp_server)
    assert grew(before, after, "kvserve:tokens_evicted_total") == reported
    finished = grew(before, after, "vllm:request_success_total")
    assert finished == {str(rank): len(settings) for rank in range(ENGINES)}
    # the server's total is the sum of its engines' (each engine counted once, in its own processes)
    assert sum(per_engine(after, "kvserve:kv_pages_capacity").values()) == pytest.approx(
        2 * per_engine(after, "kvserve:kv_pages_capacity")["0"]
    )


def _sessions_on_each_engine(count: int) -> list[str]:
    """Session names, `count` of them on each engine (by the rule the server routes them with)."""
    chosen: dict[int, list[str]] = {rank: [] for rank in range(ENGINES)}
    number = 0
    while any(len(names) < count for names in chosen.values()):
        name = f"conversation-{number}"
        if len(chosen[engine_for(name, ENGINES)]) < count:
            chosen[engine_for(name, ENGINES)].append(name)
        number += 1
    return [name for names in chosen.values() for name in names]


def chat(base: str, messages: list[dict], headers: dict) -> httpx.Response:
    payload = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    body = {"kv_policy": "snapkv", "kv_budget": 64, "kv_checkpoint": "turns"}
    response = httpx.post(base + "/v1/chat/completions", json={**payload, **body}, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return response


def converse(base: str, opening: str, headers: dict) -> tuple[list[dict], float]:
    """A conversation of three turns; its messages for a fourth, and the checkpoint hits it made on `base`."""
    before = sum(per_engine(scrape(base), "kvserve:checkpoint_hits_total").values())
    messages = [{"role": "user", "content": f"{opening} What is this text about?"}]
    for question in ("Say it in other words.", "Name one detail."):
        reply = chat(base, messages, headers).json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    chat(base, messages, headers)
    return messages, sum(per_engine(scrape(base), "kvserve:checkpoint_hits_total").values()) - before


def test_a_session_keeps_a_conversation_on_the_engine_with_its_checkpoints(dp_server, server, long_prompt):
    """Conversations of three turns with turn checkpoints, each naming a session (two per engine), resume from
    checkpoints as often as the same conversations on the single-engine server do (kvserve:checkpoint_hits_total),
    each in the engine its session maps to, whether named by x-kv-session or by vLLM router's X-Session-ID. The last
    turn of one conversation sent to the other engine as well recomputes there and answers the same."""
    sessions = _sessions_on_each_engine(2)
    before = scrape(dp_server)
    expected = {str(rank): 0.0 for rank in range(ENGINES)}
    histories = {}
    for number, session in enumerate(sessions):
        opening = long_prompt[: 900 + 40 * number]
        _, single_hits = converse(server, opening, {})
        header = ("x-kv-session", "X-Session-ID")[number % 2]
        histories[session], _ = converse(dp_server, opening, {header: session})
        assert single_hits >= 1, "a later turn resumes on one engine"
        expected[str(engine_for(session, ENGINES))] += single_hits
    assert grew(before, scrape(dp_server), "kvserve:checkpoint_hits_total") == expected

    session = sessions[0]
    home = engine_for(session, ENGINES)
    after = scrape(dp_server)
    resumed = chat(dp_server, histories[session], {RANK: str(home)})
    elsewhere = chat(dp_server, histories[session], {RANK: str(1 - home)})
    assert elsewhere.json()["choices"][0]["message"] == resumed.json()["choices"][0]["message"]
    hits = grew(after, scrape(dp_server), "kvserve:checkpoint_hits_total")
    assert hits == {str(home): 1, str(1 - home): 0}


def test_a_compressed_document_is_found_by_its_questions_on_either_engine(dp_server, long_prompt):
    """`POST /v1/kvserve/compress` on two engines answers with a session in its `kv` settings; questions that send
    those settings reach the engine holding the compressed lists and resume from them, while the same question sent
    to the other engine is served in full there (nothing evicted: the lists are not in that engine's cache)."""
    text = long_prompt[:1000] + "\n"
    salt = uuid.uuid4().hex
    made = httpx.post(
        dp_server + "/v1/kvserve/compress",
        json={"model": SERVED_MODEL, "prompt": text, "cache_salt": salt},
        headers={"x-kv-budget": "64"},
        timeout=300,
    )
    assert made.status_code == 200, made.text
    kv, tokens = made.json()["kv"], made.json()["document_tokens"]
    assert kv["kv_session"] and kv["kv_document"] == tokens
    home = engine_for(kv["kv_session"], ENGINES)
    question = text + "What is this text about? It is about"
    for _ in range(2):  # sessions do not move
        asked = complete(dp_server, question, max_tokens=4, cache_salt=salt, **kv)
        assert asked.json()["usage"]["kv_tokens_evicted"] == tokens - 64  # it resumed from the compressed lists
    elsewhere = {key: value for key, value in kv.items() if key != "kv_session"}
    other = complete(dp_server, question, {RANK: str(1 - home)}, max_tokens=4, cache_salt=salt, **elsewhere)
    assert other.json()["usage"]["kv_tokens_evicted"] == 0


def test_a_checkpoint_compression_and_its_question_meet_in_one_engine(dp_server, long_prompt):
    """A `kv_checkpoint=C` request (kvzip compresses its prefix first, then serves it) names no session: the
    compression and the request are pinned to the engine its prefix maps to, so the request resumes from the
    compressed prefix (`x-kv-document: compressed`, tokens evicted), whichever engine vLLM's balancer would pick."""
    for number in range(4):  # several prefixes: both engines serve some
        salt = uuid.uuid4().hex
        prompt = long_prompt[40 * number : 1100 + 40 * number] + " What is this text about?"
        served = complete(dp_server, prompt, {"x-kv-checkpoint": "64", "x-kv-budget": "64"}, cache_salt=salt)
        assert served.headers["x-kv-document"] == "compressed", served.headers
        assert served.json()["usage"]["kv_tokens_evicted"] > 0


def test_vllms_router_keeps_each_session_on_one_server_with_kvserves_settings(dp_server, server, tmp_path):
    """`vllm-router --policy consistent_hash` (vLLM's router, the guide's scale-out) in front of two real kvserve
    servers (the single-engine one and the two-engine one): both requests of each session (`X-Session-ID`) reach the
    same server, which applies kvserve's settings and answers its usage block through the router."""
    import subprocess

    from kvserve.tools.bench.replicas import Replica, router_binary, router_command
    from kvserve.tools.bench.servers import free_port
    from kvserve.tools.eval.client import metric_sum

    port = free_port()
    replicas = [server, dp_server]
    command = router_command(router_binary(), "consistent_hash", port, [Replica(url, "") for url in replicas], 32)
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def served() -> list[float]:
        return [metric_sum(httpx.get(url + "/metrics").text, "vllm:request_success_total") for url in replicas]

    try:
        wait_until(lambda: _answers(base + "/health"), 120, "vLLM's router answering")
        landed = set()
        for number in range(16):  # until sessions have landed on both servers (all 16 on one: p = 2^-15)
            if landed == {0, 1}:
                break
            session = f"routed-{number}-{uuid.uuid4().hex[:6]}"
            before = served()
            for _ in range(2):
                answer = complete(base, "Hello there", {"X-Session-ID": session, "x-kv-policy": "streamingllm"})
                assert answer.headers["x-kv-policy-applied"] == "streamingllm"
                assert "kv_tokens_evicted" in answer.json()["usage"]
            grew = [after - then for after, then in zip(served(), before, strict=True)]
            assert sorted(grew) == [0, 2], (session, grew)  # both on one server
            landed.add(grew.index(2))
        assert landed == {0, 1}  # sessions spread over both servers
    finally:
        router.terminate()
        router.wait(timeout=60)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_session_is_a_routing_key_not_a_setting(dp_server):
    """`kv_session` leaves the request before vLLM sees it; given twice with different values it is a 400 naming
    it, as every kvserve setting."""
    session = f"check-{uuid.uuid4().hex}"
    ok = complete(dp_server, "Hello", {"x-kv-session": session}, kv_session=session)
    assert ok.json()["usage"]["completion_tokens"] > 0
    conflict = httpx.post(
        dp_server + "/v1/completions",
        json={"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 2, "kv_session": "a"},
        headers={"x-kv-session": "b"},
        timeout=60,
    )
    assert conflict.status_code == 400 and conflict.json()["error"]["param"] == "kv_session"
    both = {"x-kv-session": "b", "X-Session-ID": "c"}
    body = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 2}
    conflict = httpx.post(dp_server + "/v1/completions", json=body, headers=both, timeout=60)
    assert conflict.status_code == 400 and "X-Session-ID".lower() in conflict.json()["error"]["message"], conflict.text
    assert complete(dp_server, "Hello", {"x-kv-session": session, "X-Session-ID": session}).status_code == 200


def test_both_pools_are_whole_after_the_requests(dp_server):
    def idle() -> bool:
        samples = scrape(dp_server)
        in_use = per_engine(samples, "kvserve:kv_pages_in_use")
        usage = per_engine(samples, "vllm:kv_cache_usage_perc")
        return set(in_use) == set(usage) == {"0", "1"} and not any(in_use.values()) and not any(usage.values())

    wait_until(
        idle, 120, lambda: f"pages in use per engine: {per_engine(scrape(dp_server), 'kvserve:kv_pages_in_use')}"
    )


def test_the_external_balancer_layout_is_refused_at_start_up_with_vllms_reason(tmp_path):
    """vLLM 0.32 serves a dense model's data parallelism across machines as independent servers: `kvserve serve
    --data-parallel-rank` stops at start-up with vLLM's own reason (the guide's router layout replaces it)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", *SERVER_ARGS, "--data-parallel-size", "2"]
        + ["--data-parallel-rank", "1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "Non-MoE models do not support external data parallel mode" in result.stdout + result.stderr


def test_each_engine_and_node_gets_cpus_of_its_own():
    """kvserve serve's CPU split counts the workers on this machine: every engine's (vLLM's order: engine 0's
    workers first), none for an external-balancer engine (whoever starts it binds it), world size / nodes on a
    node of a model split over machines; the user's own binding stands."""
    from kvserve.parallelism import parallel_env

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no split to check")
    groups = parallel_env(["--data-parallel-size", "2"], {})["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert len(groups) == 2 and not set(groups[0].split(",")) & set(groups[1].split(","))
    assert parallel_env(["-dp", "2", "--data-parallel-size-local", "1"], {}) == {}  # one engine here
    assert parallel_env(["-dp", "2", "--data-parallel-rank", "1"], {}) == {}
    assert parallel_env(["-tp", "2", "--nnodes", "2", "--node-rank", "1"], {}) == {}  # one rank on this node
    assert len(parallel_env(["-tp", "2", "-n", "2", "-dp", "2"], {})["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert parallel_env(["-dp", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {}
    if len(cpus) < 4:
        with pytest.raises(SystemExit, match="a CPU per worker"):
            parallel_env(["-dp", "2", "-tp", "2"], {})


def test_sessions_spread_over_engines_and_keep_their_engine_when_one_is_added():
    """Rendezvous hashing: the same session always maps to the same engine, sessions spread about evenly, and
    going from 2 to 3 engines moves only the sessions the new engine takes (about a third)."""
    sessions = [f"user-{number}" for number in range(3000)]
    two = [engine_for(session, 2) for session in sessions]
    assert two == [engine_for(session, 2) for session in sessions]
    assert abs(two.count(0) - 1500) < 150
    three = [engine_for(session, 3) for session in sessions]
    moved = [(a, b) for a, b in zip(two, three, strict=True) if a != b]
    assert all(b == 2 for _, b in moved) and abs(len(moved) - 1000) < 150


def test_several_api_servers_are_refused_rather_than_ignored():
    """kvserve serve runs one API server process; `--api-server-count 2` (vllm serve's default under data
    parallelism) stops at start-up saying so instead of serving with one."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", *SERVER_ARGS, "-dp", "2", "--api-server-count", "2"]
        + ["--port", "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1 and "--api-server-count 2" in result.stderr
