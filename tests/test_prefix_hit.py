"""What a prefix hit guarantees with eviction off: exactly what vanilla vLLM gives on the same hit. A hit is not
bit-identical to a miss in vLLM itself (in bfloat16 its chunk's attention over cached blocks rounds differently from
the miss's chunks), so kvserve's hit is held to vanilla's hit and its miss to vanilla's miss, not a hit to a miss.
Both engines run in the background (tests/prefix_hit_run.py): bfloat16, the dtype in which the two differ."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from background import Run
from engine_settings import BLOCK_SIZE
from prefix_hit_run import DOCUMENT_TOKENS

TESTS = Path(__file__).parent


def background_runs() -> list[Run]:
    argv = [sys.executable, str(TESTS / "prefix_hit_run.py"), "{out}"]
    return [
        Run("prefix_hits", argv, {"VLLM_PLUGINS": None}),  # kvserve's plugin, loaded by vLLM
        Run("prefix_hits", argv, {"VLLM_PLUGINS": "none"}),  # vanilla vLLM
    ]


@pytest.fixture(scope="module")
def prefix_hits(background) -> tuple[dict, dict]:
    kvserve, vanilla = background.results("prefix_hits")
    assert (kvserve["plugins"], vanilla["plugins"]) == (None, "none")
    return kvserve["requests"], vanilla["requests"]


def test_the_hits_read_cached_blocks_and_the_misses_none(prefix_hits):
    """The setting the next test relies on: each 'hit' read the document's blocks, in both engines alike."""
    kvserve, vanilla = prefix_hits
    for name, request in kvserve.items():
        assert request["cached_tokens"] == vanilla[name]["cached_tokens"], name
        if "miss" in name:
            assert request["cached_tokens"] == 0, name
        else:
            assert request["cached_tokens"] >= (DOCUMENT_TOKENS // BLOCK_SIZE - 1) * BLOCK_SIZE, name


@pytest.mark.parametrize("name", ["first, miss", "first again, hit", "second, hit on the document", "second, miss"])
def test_full_gives_vanillas_numbers_on_a_hit_and_on_a_miss(prefix_hits, name):
    kvserve, vanilla = prefix_hits
    assert kvserve[name]["tokens"] == vanilla[name]["tokens"]
    assert kvserve[name]["logprobs"] == vanilla[name]["logprobs"]  # bit for bit: the same computation
