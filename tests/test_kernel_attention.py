"""kvserve's own attention (KVSERVE_ATTENTION=kernels: output and statistics from kvserve_kernels' operations, the
GPU path of the design, here on their PyTorch references) in the real engine, against vanilla vLLM and against the
default mode (vLLM's CPU kernel, statistics measured after it) on the same batch."""

from __future__ import annotations

import os
import sys

import pytest
from background import Run
from kernel_attention_run import kept_positions, policy_batch, run_batch

SCRIPT = os.path.join(os.path.dirname(__file__), "kernel_attention_run.py")


def background_runs() -> list[Run]:
    """The KVSERVE_ATTENTION=kernels engines, each in its own process (tests/background.py)."""
    env = {"KVSERVE_ATTENTION": "kernels"}
    return [
        Run("kernel_engine_run", [sys.executable, SCRIPT, "{out}"], env, timeout_s=300),  # ~30 s here
        Run("triton_engine_run", [sys.executable, SCRIPT, "{out}", "--triton"], env),
    ]


@pytest.fixture(scope="module")
def kernel_engine_run(background):
    return background.results("kernel_engine_run")[0]


@pytest.fixture(scope="module")
def triton_engine_run(background):
    return background.results("triton_engine_run")[0]


def test_kernel_attention_is_what_served(kernel_engine_run):
    assert kernel_engine_run["impls"] == ["KVServeKernelAttentionImpl"]


def test_kernel_attention_without_eviction_matches_vanilla(kernel_engine_run, vanilla_outputs):
    assert kernel_engine_run["plain"] == vanilla_outputs["outputs"]


def test_kernel_attention_returns_every_block(kernel_engine_run):
    before, after = kernel_engine_run["free_blocks"]
    assert after == before


def _assert_same_eviction(engine, run: dict, triton: bool) -> None:
    """Same batch, same policies: the statistics from the attention operation keep the same entries as the
    statistics measured after vLLM's kernel, and the greedy text is the same. Both are fp32; the two attentions
    differ only in summation order (~1e-6), so a kept set may differ where two scores tie to that precision: at most
    one entry per layer and head, in at most a few of the 30 layers x 3 heads x policies (0 seen). Greedy tokens
    are compared exactly: on these prompts the smallest gap between the two most likely tokens' log-probabilities is
    9.6e-3 (measured with logprobs=2), far above what summation order moves."""
    prompts, kv_settings, max_tokens = policy_batch(engine.tokenizer, triton)
    outputs = run_batch(engine.llm, prompts, kv_settings, max_tokens)
    names = [kv["kv_policy"] for kv in kv_settings]
    differing_rows = 0
    for name, out, tokens, kept in zip(names, outputs, run["tokens"], run["kept"], strict=True):
        assert list(out.outputs[0].token_ids) == tokens, name
        reference = kept_positions(engine.eviction_state(out.request_id))
        assert (
            len(kept) == len(reference) == engine.runner.model_config.get_num_layers(engine.runner.parallel_config)
        ), name
        for layer, (got_layer, want_layer) in enumerate(zip(kept, reference, strict=True)):
            for head, (got, want) in enumerate(zip(got_layer, want_layer, strict=True)):
                assert len(got) == len(want) and len(set(got) ^ set(want)) <= 2, (name, layer, head)
                differing_rows += got != want
    assert differing_rows <= 3, differing_rows


def test_kernel_attention_evicts_as_the_default_mode(kernel_engine_run, engine):
    _assert_same_eviction(engine, kernel_engine_run, triton=False)


def test_triton_kernels_in_the_engine_evict_as_the_default_mode(triton_engine_run, engine):
    """The Triton kernels themselves (decode with scores, prefill with column and window sums, compaction), under
    Triton's interpreter, serving the real model in vLLM: the GPU path minus the GPU."""
    launches = triton_engine_run["triton_launches"]
    assert all(count > 0 for count in launches.values()), launches
    assert triton_engine_run["impls"] == ["KVServeKernelAttentionImpl"]
    assert triton_engine_run["free_blocks"][0] == triton_engine_run["free_blocks"][1]
    _assert_same_eviction(engine, triton_engine_run, triton=True)
