"""vLLM's own scale-out with kvserve: pipeline parallelism (2 stages, each a worker process evicting its own layers)
gives the single-process engine's greedy tokens and evicted counts, and returns every block. Tensor parallelism:
tests/test_tensor_parallel.py."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from background import Run
from engine_settings import EQUIVALENCE_MAX_TOKENS, equivalence_prompts

from kvserve.parallelism import parallel_env

TESTS = Path(__file__).parent

# One setting per way a stage's lists change: a window policy, accumulated statistics, a ragged gate (heads keep
# different counts, so pages move between blocks), layer-dependent choices (MAT's shallow layers sit on stage 1),
# and eviction after every prefill chunk. Every setting runs the same prompts, so the ones after `full` find them in
# the prefix cache: SnapKV reads the hits (each stage adopts the cached pages of its layers, copies the ones its
# compaction writes out of them and gives them back), the others publish.
SETTINGS = [
    {"kv_policy": "full"},
    {"kv_policy": "snapkv", "kv_budget": 64},
    {"kv_policy": "h2o", "kv_budget": 64},
    {"kv_policy": "attention_gate"},
    {"kv_policy": "mat", "kv_budget": 64},
    {"kv_policy": "streamingllm", "kv_budget": 64, "kv_evict_every_chunk": True},
]


def _two_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


def background_runs() -> list[Run]:
    """The two-stage engine, in its own process (tests/background.py)."""
    if not _two_cpus():
        return []
    settings = Path(tempfile.mkdtemp(prefix="kvserve-pipeline-")) / "settings.json"
    settings.write_text(json.dumps(SETTINGS))
    argv = [sys.executable, str(TESTS / "pipeline_run.py"), str(settings), "{out}"]
    # its stages get a CPU each (kvserve's parallel_env), unless the user bound them
    return [Run("pipeline_results", argv, {"VLLM_PLUGINS": None}, bind_cpu=False)]


@pytest.fixture(scope="module")
def pipeline_results(background):
    if not _two_cpus():
        pytest.skip("pipeline parallelism on CPU needs a CPU per stage; this process may use one")
    return background.results("pipeline_results")[0]


def test_pipeline_stages_give_the_single_process_tokens_and_return_every_block(engine, pipeline_results):
    assert pipeline_results["scheduler"] == "EvictingScheduler"
    assert pipeline_results["batch_queue"] == 2  # vLLM keeps two batches in flight to fill the pipeline
    prompts = equivalence_prompts(engine.tokenizer)
    for result in pipeline_results["results"]:
        kv = result["kv"]
        outputs = engine.generate(prompts, EQUIVALENCE_MAX_TOKENS, kv=kv)
        assert result["outputs"] == [list(o.outputs[0].token_ids) for o in outputs], kv
        assert result["evicted"] == [o.kv_transfer_params["kv_tokens_evicted"] for o in outputs], kv
        assert result["free_blocks"] == pipeline_results["total_blocks"], kv  # the pool is full again
    evicting = [result for result in pipeline_results["results"] if result["kv"]["kv_policy"] != "full"]
    assert all(max(result["evicted"]) > 0 for result in evicting)
    snapkv = next(result for result in evicting if result["kv"]["kv_policy"] == "snapkv")
    assert snapkv["cached"][0] > 0 and snapkv["evicted"][0] > 0  # a prefix hit, then a compaction


def test_pipeline_stages_get_cpus_of_their_own():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no split to check")
    bind = parallel_env(["--pipeline-parallel-size", "2"], {})["VLLM_CPU_OMP_THREADS_BIND"]
    groups = [[int(cpu) for cpu in group.split(",")] for group in bind.split("|")]
    assert len(groups) == 2 and not set(groups[0]) & set(groups[1]) and set(groups[0] + groups[1]) <= set(cpus)
    assert parallel_env(["-pp", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {}  # the user's choice stands
    assert parallel_env([], {}) == {}
