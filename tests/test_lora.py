"""LoRA adapters with eviction (vLLM's `enable_lora`, punica's CPU path): an adapter's request evicts as a base-model
request does, gives vanilla vLLM's tokens where nothing is evicted, and the prefix cache is keyed by adapter as in
vanilla. The adapter is trained here (tests/lora_adapter.py); both engines run in the background
(tests/lora_run.py), vanilla with kvserve's plugin off."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from background import Run

TESTS = Path(__file__).parent
SETTINGS = [{}, {"kv_policy": "streamingllm", "kv_budget": 64}, {"kv_policy": "snapkv", "kv_budget": 64}]
VANILLA_SETTINGS = [{}]


def background_runs() -> list[Run]:
    from lora_adapter import session_adapter, session_adapter_path

    folder = Path(tempfile.mkdtemp(prefix="kvserve-lora-"))
    adapter = session_adapter_path()
    runs = []
    for fixture, settings, plugins in (
        ("lora_vanilla", VANILLA_SETTINGS, "none"),
        ("lora_kvserve", SETTINGS, None),
    ):
        path = folder / f"{fixture}.json"
        path.write_text(json.dumps(settings))
        argv = [sys.executable, str(TESTS / "lora_run.py"), str(adapter), str(path), "{out}"]
        runs.append(Run(fixture, argv, {"VLLM_PLUGINS": plugins}, prepare=session_adapter))
    return runs


@pytest.fixture(scope="module")
def lora_vanilla(background):
    return background.results("lora_vanilla")[0]


@pytest.fixture(scope="module")
def lora_kvserve(background):
    return background.results("lora_kvserve")[0]


def tokens(rows: list[dict]) -> list[list[int]]:
    return [row["tokens"] for row in rows]


def test_an_adapter_request_without_eviction_gives_vanillas_tokens(lora_vanilla, lora_kvserve):
    vanilla, kvserve = lora_vanilla["results"][0], lora_kvserve["results"][0]
    assert tokens(kvserve["base"]) == tokens(vanilla["base"])
    assert tokens(kvserve["adapter"]) == tokens(vanilla["adapter"])
    assert tokens(vanilla["adapter"]) != tokens(vanilla["base"])  # the adapter changes the answers


@pytest.mark.parametrize("index", range(1, len(SETTINGS)), ids=[s["kv_policy"] for s in SETTINGS[1:]])
def test_an_adapter_request_evicts_as_a_base_model_request_does(lora_kvserve, index):
    result = lora_kvserve["results"][index]
    assert result["kv"] == SETTINGS[index]
    base, adapter = result["base"], result["adapter"]
    assert [row["evicted"] for row in adapter] == [row["evicted"] for row in base]
    assert max(row["evicted"] for row in adapter) > 0
    assert tokens(adapter) != tokens(base)


def test_the_prefix_cache_is_keyed_by_adapter_as_in_vanilla(lora_vanilla, lora_kvserve):
    for run in (lora_vanilla, lora_kvserve):
        base, adapter_first, adapter_again = run["order"]
        assert adapter_first["cached"] == 0  # the base model's blocks are not the adapter's
        assert adapter_again["cached"] > 0  # its own are
        assert adapter_again["tokens"] == adapter_first["tokens"]
        assert run["free_blocks"] == run["total_blocks"]  # the pool is whole after
