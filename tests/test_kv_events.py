"""vLLM's KV-cache events (`--kv-events-config`) under eviction: what they say the prefix cache holds is what it
holds. An engine evicts, compacts, publishes and resumes checkpoints, hits the prefix cache and aborts requests
while a subscriber reads its ZMQ stream (tests/kv_events_run.py, in the background); the session's `kvserve serve`
publishes them too, and its HTTP requests' blocks arrive as stored events naming their tokens.

kvserve's rule: vLLM's events describe its prefix cache by tokens. A checkpoint (compacted lists cached under
kvserve's own hashes) is announced neither when cached nor when its blocks leave: its tokens are not what it holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from background import Run
from waiting import wait_until

TESTS = Path(__file__).parent


def background_runs() -> list[Run]:
    return [Run("kv_events", [sys.executable, str(TESTS / "kv_events_run.py"), "{out}"])]


@pytest.fixture(scope="module")
def kv_events(background) -> dict:
    return background.results("kv_events")[0]


def test_after_every_phase_the_events_say_what_the_prefix_cache_holds(kv_events):
    """Per phase (plain hits, an evicting request and its hit, checkpoints, aborts, the pool cycled), the blocks per
    hash that the events stored and did not remove equal the blocks vLLM's cache maps each token hash to, and no
    removal names a block never stored."""
    names = [phase["name"] for phase in kv_events["phases"]]
    assert len(names) == 5
    for phase in kv_events["phases"]:
        assert phase["events"] == phase["pool"], phase["name"]
        assert phase["counts"]["removed_unknown"] == 0, phase["name"]
    cycled = kv_events["phases"][-1]
    assert cycled["counts"]["removed"] > 0  # the last phase pushed earlier blocks out: removals were checked


def test_a_checkpoint_is_announced_neither_stored_nor_removed(kv_events):
    phases = {phase["name"]: phase for phase in kv_events["phases"]}
    published = phases["checkpoints published and resumed"]["checkpoints"]
    assert published and kv_events["checkpoint_hits"] >= 1  # checkpoints were cached and one was resumed from
    assert not set(published) & set(kv_events["stored_hashes"])
    assert phases["pool cycled by plain requests"]["checkpoints"] == []  # gone, and (above) no removal announced


def test_every_stored_event_names_whole_blocks_of_a_requests_own_tokens(kv_events):
    assert kv_events["stored_hashes"]
    assert kv_events["misnamed_blocks"] == []


def test_the_stream_is_whole_and_the_pool_full_again(kv_events):
    assert kv_events["sequence_numbers"] == list(range(kv_events["published"]))
    assert kv_events["live_batches"] > 0 and kv_events["live_matches_replay"]
    assert kv_events["free_blocks"] == kv_events["total_blocks"]


def stored_blocks(endpoint: str) -> list[list[int]]:
    """Every block the server's replay buffer holds a BlockStored for, as its token ids."""
    from kv_events_run import replay, stored_events

    blocks = []
    for event in stored_events(replay(endpoint)):
        size = event.block_size
        blocks += [event.token_ids[i : i + size] for i in range(0, len(event.token_ids), size)]
    return blocks


@pytest.mark.parametrize("kv", [{"x-kv-policy": "full"}, {"x-kv-policy": "snapkv", "x-kv-budget": "64"}])
def test_kvserve_serve_publishes_an_http_requests_blocks(server, server_kv_events, kv):
    """`kvserve serve --kv-events-config ...`: a request's whole prompt blocks arrive as stored events naming its
    tokens, an evicting request's too (they enter the cache before it compacts)."""
    import uuid

    import httpx
    from engine_settings import BLOCK_SIZE, SERVED_MODEL

    prompt = [1000 + (i * 37) % 20000 for i in range(3 * BLOCK_SIZE + 5)]  # three whole blocks and a tail
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": uuid.uuid4().hex}
    answer = httpx.post(server + "/v1/completions", json=body, headers=kv, timeout=300)
    assert answer.status_code == 200, answer.text
    whole = [prompt[i : i + BLOCK_SIZE] for i in range(0, 3 * BLOCK_SIZE, BLOCK_SIZE)]
    wait_until(lambda: all(block in stored_blocks(server_kv_events) for block in whole), 120, "the blocks' events")
