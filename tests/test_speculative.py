"""Speculative decoding with eviction. vLLM's n-gram prompt lookup: a step that verifies drafts never compacts, the
rejected drafts' entries leave the lists, and the accepted tokens' queries count in the statistics and windows as
one-token steps would (`kvserve.core.compaction.drafts_allowed`, `kvserve.worker.drafts.settle_drafts`). So greedy
output with speculation equals greedy output without it under every policy family, and so do the compactions: the
positions each (layer, head) kept at its last one. A draft model (here the default model's twin of another cache
shape) keeps a KV cache of its own in the request's blocks, laid out by vLLM's block table, so it drafts for a
request until the request compacts and not after; the output is again the output without speculation. The runs
with speculation are engines of their own (tests/speculative_run.py, in the background); the one without is the
session's engine, on the same prompts under the same cache salts."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from background import Run
from engine_settings import SPECULATIVE_MAX_TOKENS, fitting_window, kept_lists, quoting_prompts, speculation_salt

from kvserve.parallelism import speculation_refusal
from kvserve.policies import representative_policies

TESTS = Path(__file__).parent
BUDGET = 96  # above what any policy always keeps; the first prompt compacts where it ends and every block after


def draft_families() -> list[str]:
    """One policy per way speculation treats it: what settles a draft's queries is whether the policy keeps running
    statistics, which statistics its pass measures, a window, a gate, heads of their own counts, a meta-score
    (kvserve.worker.drafts). Policies that differ only in how they score at a compaction (TOVA, KeyDiff, ...) settle
    as the first of their family does; a new family is in at once. (All 14 settings took 23 min on a 2-core AVX2
    machine, the suite's longest background run.)"""
    from kvserve.policies import POLICIES

    seen, names = set(), []
    for name in representative_policies():
        policy = POLICIES[name]()
        family = (
            bool(policy.stat_names),
            tuple(policy.pass_statistics),
            bool(policy.window_size()),
            getattr(policy, "ragged", False),
            getattr(policy, "own_counts", False),
            "+" in name,
        )
        if family not in seen:
            seen.add(family)
            names.append(name)
    return names


# every way a policy settles drafts (windows, running sums, first logits, a gate, own counts, meta-scores), a per-layer
# allocation, and checkpoints, whose compactions fall at fixed positions in decode too
SETTINGS = [
    {},
    *(fitting_window({"kv_policy": name, "kv_budget": BUDGET}) for name in draft_families()),
    {"kv_policy": "h2o", "kv_budget": BUDGET, "kv_allocation": "pyramid"},
    {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": 64},
]


# a draft model of another cache shape that computes what the target computes (tests/drafters.py: the default model
# with its KV heads repeated, 9 where the target has 3), so every draft it makes is accepted where it reads its own
# cache, in the group of mixed shapes vLLM builds for the two; under B=96 the two longer prompts compact where they
# end and the short one never does
DRAFT_MODEL = {"method": "draft_model", "model": "default, KV heads repeated", "num_speculative_tokens": 3}
DRAFT_SETTINGS = [{}, {"kv_policy": "snapkv", "kv_budget": BUDGET}]


def background_runs() -> list[Run]:
    folder = Path(tempfile.mkdtemp(prefix="kvserve-speculative-"))
    runs = []
    for fixture, settings, config in (
        ("speculative_results", SETTINGS, []),
        ("draft_model_results", DRAFT_SETTINGS, [json.dumps(DRAFT_MODEL)]),
    ):
        path = folder / f"{fixture}.json"
        path.write_text(json.dumps(settings))
        argv = [sys.executable, str(TESTS / "speculative_run.py"), str(path), "{out}", *config]
        # vLLM's n-gram drafter is a numba kernel whose pool starts a thread per CPU, in a process bound to one CPU; a
        # run that took a minute once outlived its 900 s timeout on CI beside the other tests: one thread
        runs.append(Run(fixture, argv, {"NUMBA_NUM_THREADS": "1"}))
    return runs


@pytest.fixture(scope="module")
def speculative_results(background):
    return background.results("speculative_results")[0]


@pytest.fixture(scope="module")
def draft_model_results(background):
    return background.results("draft_model_results")[0]


def _without_speculation(engine, kv: dict):
    prompts = quoting_prompts(engine.tokenizer)
    outputs = engine.generate(prompts, SPECULATIVE_MAX_TOKENS, kv=kv or None, cache_salt=speculation_salt(kv))
    kept = [kept_lists(engine.eviction_state(o.request_id)) if kv else None for o in outputs]
    return outputs, kept


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=[s.get("kv_policy", "full") for s in SETTINGS])
def test_speculation_gives_the_tokens_and_compactions_of_one_token_steps(engine, speculative_results, index):
    result = speculative_results["results"][index]
    kv = result["kv"]
    assert kv == SETTINGS[index]
    outputs, kept = _without_speculation(engine, kv)
    assert result["outputs"] == [list(o.outputs[0].token_ids) for o in outputs], kv
    assert result["evicted"] == [o.kv_transfer_params["kv_tokens_evicted"] for o in outputs], kv
    assert result["kept"] == kept, kv  # every list kept the same positions at its last compaction
    assert result["free_blocks"] == speculative_results["total_blocks"], kv  # rejected drafts leaked nothing
    if kv.get("kv_policy") == "attention_gate":  # its gate decides per token in the attention pass: no drafts
        assert result["speculation"]["num_drafts"] == 0
        return
    speculation = result["speculation"]
    assert speculation["num_accepted_tokens"] > 0, kv
    # drafts were rejected too, so the truncation of their entries ran
    assert speculation["num_accepted_tokens"] < speculation["num_draft_tokens"], kv
    if kv:
        assert max(o.kv_transfer_params["kv_tokens_evicted"] for o in outputs) > 0, kv
        assert max(k["compactions"] for k in kept) >= 3, kv  # decode compactions between the drafts


@pytest.mark.parametrize("index", range(len(DRAFT_SETTINGS)), ids=[s.get("kv_policy", "full") for s in DRAFT_SETTINGS])
def test_a_draft_model_drafts_until_a_request_compacts_and_changes_no_token(engine, draft_model_results, index):
    result, full = draft_model_results["results"][index], draft_model_results["results"][0]
    kv = result["kv"]
    assert kv == DRAFT_SETTINGS[index]
    outputs, kept = _without_speculation(engine, kv)
    assert result["outputs"] == [list(o.outputs[0].token_ids) for o in outputs], kv
    assert result["evicted"] == [o.kv_transfer_params["kv_tokens_evicted"] for o in outputs], kv
    assert result["kept"] == kept, kv
    assert result["free_blocks"] == draft_model_results["total_blocks"], kv  # the drafter's slots leaked nothing
    speculation = result["speculation"]
    # the drafter computes what the target does: where it reads its own cache in vLLM's layout, every draft is accepted
    assert speculation["num_accepted_tokens"] == speculation["num_draft_tokens"] > 0, kv
    # drafts only for the requests that never compacted, as many as each had without eviction
    compacted = [bool(evicted) for evicted in result["evicted"]]
    assert compacted.count(True) == (2 if kv else 0), result["evicted"]
    per_request = full["speculation"]["num_drafts"] / len(compacted)
    assert speculation["num_drafts"] == per_request * compacted.count(False), (kv, speculation)


def test_drafters_that_read_no_hidden_states_are_served():
    assert speculation_refusal(None) is None
    assert speculation_refusal(SimpleNamespace(method="ngram")) is None
    assert speculation_refusal(SimpleNamespace(method="draft_model")) is None
    for method in ("eagle", "eagle3", "mtp", "suffix"):
        refusal = speculation_refusal(SimpleNamespace(method=method))
        assert refusal is not None and repr(method) in refusal and "'ngram'" in refusal and "'draft_model'" in refusal
    assert "pipeline" in speculation_refusal(SimpleNamespace(method="ngram"), pipeline_parallel_size=2)
    # the drafter's layers attend with vLLM's ops over vLLM's layout, which KVSERVE_ATTENTION=kernels does not keep
    assert "KVSERVE_ATTENTION" in speculation_refusal(SimpleNamespace(method="draft_model"), attention_mode="kernels")
    assert speculation_refusal(SimpleNamespace(method="ngram"), attention_mode="kernels") is None


def test_the_targets_layers_page_beside_a_draft_model_of_either_cache_shape():
    """A drafter of the target's cache shape joins the target's group; one whose KV heads, head size or dtype differ
    shares one group of mixed shapes with it (one block table, a cache per layer). Either way kvserve pages the
    target's layers by the target's spec; a group whose target layers differ among themselves is refused."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    from kvserve.vllm.model import paged_group, paged_spec

    target, drafter = "model.layers.0.self_attn.attn", "draft_model.model.layers.0.self_attn.attn"
    support = SimpleNamespace(evicts=True, paged_layers=(0, 1), describe=lambda: "evicts on all 2 layers")

    def spec(head_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=head_size, dtype=torch.float32)

    def config(drafter_head_size: int, second_target_head_size: int = 64) -> SimpleNamespace:
        second = target.replace(".0.", ".1.")
        specs = {target: spec(64), second: spec(second_target_head_size), drafter: spec(drafter_head_size)}
        mixed = len({s.head_size for s in specs.values()}) > 1  # vLLM's grouping: one spec for equal shapes
        group = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=specs) if mixed else specs[target]
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=group, layer_names=list(specs))])

    for drafter_head_size in (64, 128):
        built = config(drafter_head_size)
        assert paged_group(built, support) == 0
        assert paged_spec(built.kv_cache_groups[0]) == spec(64), drafter_head_size
    with pytest.raises(RuntimeError, match="vLLM built KV-cache groups"):
        paged_group(config(64, second_target_head_size=128), support)
