"""An fp8 KV cache (`--kv-cache-dtype fp8`) with eviction: the engine of tests/fp8_run.py (the test engine's settings,
an fp8 cache) against vanilla vLLM on the same cache, a PyTorch reference that attends over the dequantised cache,
and the properties every policy and every way of sharing a cache keeps on the unquantised one.

vLLM 0.32 has an fp8 CPU cache only on CPUs with AVX-512 or AMX; elsewhere these tests skip, naming the flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from background import Run
from cache_writers import vllm_cannot_write_fp8
from fp8_run import CHECKPOINT, EVERY_POLICY_BUDGET, EVERY_POLICY_TOKENS, SETTINGS, SNAPKV
from hf_reference import fp8_cache, snapkv_reference
from test_engine import _assert_same_kept

from kvserve.policies.snapkv import SnapKV

TESTS = Path(__file__).parent
KERNEL = SnapKV().kernel_size  # the pool a request naming snapkv gets
EXACT_LAYERS = 5  # layers whose inputs have not yet passed through enough fp8 rounding to differ from the reference's


def background_runs() -> list[Run]:
    if vllm_cannot_write_fp8("vec"):
        return []
    run = [sys.executable, str(TESTS / "fp8_run.py")]
    return [
        Run("fp8_results", [*run, "kvserve", "{out}"]),
        Run("fp8_vanilla", [*run, "vanilla", "{out}"], {"VLLM_PLUGINS": "none"}),
    ]


@pytest.fixture(scope="module")
def fp8_results(background):
    if vllm_cannot_write_fp8("vec"):
        pytest.skip(vllm_cannot_write_fp8("vec"))
    return background.results("fp8_results")[0]


@pytest.fixture(scope="module")
def fp8_vanilla(background, fp8_results):
    return background.results("fp8_vanilla")[0]


def test_eviction_off_and_a_budget_above_the_prompt_give_vanilla_vllms_tokens_on_fp8(fp8_results, fp8_vanilla):
    assert fp8_results["scheduler"] == "EvictingScheduler" and fp8_results["layout"] == "QuantisedPages"
    want = fp8_vanilla["equivalence"]["full"]
    assert fp8_results["equivalence"]["full"] == want
    assert fp8_results["equivalence"]["budget_above_sequence"] == want


def _differences(kept: torch.Tensor, keep: torch.Tensor, scores: torch.Tensor) -> tuple[int, float]:
    """Entries one side keeps and the other drops, over the heads of one layer, and the largest score gap between
    such a pair relative to the head's top score."""
    count, worst = 0, 0.0
    for head in range(keep.shape[0]):
        ours, theirs = set(kept[head].tolist()), set(keep[head].tolist())
        count += len(ours - theirs)
        for a, b in zip(sorted(ours - theirs), sorted(theirs - ours), strict=True):
            worst = max(worst, abs(float(scores[head, a] - scores[head, b])) / float(scores[head].max()))
    return count, worst


def test_snapkv_on_fp8_keeps_what_dense_attention_over_the_dequantised_cache_chooses(fp8_results, hf_model):
    """The first layers keep exactly the reference's choice (float ties aside). Deeper, the engine's and the
    reference's hidden states differ in float rounding, and rounding keys toward zero to fp8 turns a difference
    at a code boundary into a whole code: a few kept entries differ (under 2% of them), each where the two scores
    lie within 2.5% of the head's top score (SnapKV's pool of 31 spreads a head's top score over more keys than its
    former 15, so a near-tie is a larger share of it), and less than half as many as against the unquantised
    reference."""
    ids = fp8_results["snapkv"]["prompt"]
    budget = SNAPKV["kv_budget"]
    with fp8_cache(torch.float8_e4m3fn):  # "fp8" is e4m3; the engine's scales are 1 (the checkpoint brings none)
        ref_keep, ref_scores = snapkv_reference(hf_model, ids, budget, 32, KERNEL)
    plain_keep, plain_scores = snapkv_reference(hf_model, ids, budget, 32, KERNEL)
    kept = [torch.tensor(layer) for layer in fp8_results["snapkv"]["kept"]]
    assert len(kept) == len(ref_keep) == hf_model.config.num_hidden_layers
    for layer in range(EXACT_LAYERS):
        _assert_same_kept(kept[layer], ref_keep[layer], ref_scores[layer], layer)
    differing = [_differences(kept[layer], ref_keep[layer], ref_scores[layer]) for layer in range(len(kept))]
    plain = sum(_differences(kept[layer], plain_keep[layer], plain_scores[layer])[0] for layer in range(len(kept)))
    total = sum(count for count, _ in differing)
    assert total <= 0.02 * budget * len(kept) * 3, total
    assert max(worst for _, worst in differing) <= 0.025, sorted(worst for _, worst in differing)[-3:]
    assert total < plain / 2, (total, plain)  # the quantised reference is the one the engine follows


def test_every_policy_evicts_within_its_budget_on_fp8(fp8_results):
    results = fp8_results["every_policy"]
    assert len(results) >= 10
    for name, result in results.items():
        assert result["tokens"] == EVERY_POLICY_TOKENS, name
        assert result["compactions"] >= 2, name  # after the prompt, then while decoding
        assert result["kept_shapes"] == [[3, EVERY_POLICY_BUDGET]], name
        assert result["ascending"], name


@pytest.mark.parametrize("label", list(SETTINGS))
def test_allocations_spans_gates_and_prefix_hits_on_fp8(fp8_results, label):
    """Each setting runs one prompt twice: both evict and give the same tokens; where the setting reads the prefix
    cache the second request finds the first's blocks."""
    result = fp8_results["settings"][label]
    assert result["tokens"][0] == result["tokens"][1], label
    assert result["evicted"][0] == result["evicted"][1] > 0, label
    assert result["compactions"] >= 1, label
    if label in ("prefix", "span"):  # uniform allocations read and publish prefix-cache blocks
        assert result["cached"][1] > 0, label


def test_a_checkpoint_on_fp8_resumes_as_a_miss_computes(fp8_results):
    result = fp8_results["checkpoint"]
    hit, miss = result["cached"]
    assert hit >= CHECKPOINT["kv_checkpoint"] and miss == 0
    assert result["tokens"][0] == result["tokens"][1]
    assert result["evicted"][0] == result["evicted"][1] > 0
    assert result["kept"][0] == result["kept"][1]


def test_deferred_eviction_on_fp8_compacts_under_pressure_and_the_pool_is_full_again(fp8_results):
    assert all(count == 64 for count in fp8_results["pressure"]["tokens"])
    assert any(count > 0 for count in fp8_results["pressure"]["evicted"])
    assert fp8_results["free_blocks"] == fp8_results["total_blocks"]


def test_kvserves_own_kernels_refuse_an_fp8_cache_with_the_reason():
    from kvserve.vllm.backend import readable_cache_dtypes

    assert "fp8" in readable_cache_dtypes("vllm") and "fp8_e5m2" in readable_cache_dtypes("vllm")
    assert readable_cache_dtypes("kernels") == ("auto",)
