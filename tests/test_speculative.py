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

# EAGLE and EAGLE-3 heads (tests/drafters.py: trained here, they draft from the target's hidden states and keep a KV
# cache of their own), each prompt alone so that each request's drafts are counted on their own
HEADS = {
    f"{method}_results": {
        "method": method,
        "model": f"default's {name} head, trained here",
        "num_speculative_tokens": 3,
    }
    for method, name in (("eagle", "EAGLE"), ("eagle3", "EAGLE-3"))
}


def background_runs() -> list[Run]:
    folder = Path(tempfile.mkdtemp(prefix="kvserve-speculative-"))
    runs = []
    for fixture, settings, config, timeout_s in (
        ("speculative_results", SETTINGS, [], 900),
        ("draft_model_results", DRAFT_SETTINGS, [json.dumps(DRAFT_MODEL)], 900),
        # each head is trained first (tests/drafters.py: about 2 min on two cores, more on the one a run is bound to)
        *((fixture, DRAFT_SETTINGS, [json.dumps(config), "alone"], 1500) for fixture, config in HEADS.items()),
    ):
        path = folder / f"{fixture}.json"
        path.write_text(json.dumps(settings))
        argv = [sys.executable, str(TESTS / "speculative_run.py"), str(path), "{out}", *config]
        # vLLM's n-gram drafter is a numba kernel whose pool starts a thread per CPU, in a process bound to one CPU; a
        # run that took a minute once outlived its 900 s timeout on CI beside the other tests: one thread
        runs.append(Run(fixture, argv, {"NUMBA_NUM_THREADS": "1"}, timeout_s=timeout_s))
    return runs


@pytest.fixture(scope="module")
def speculative_results(background):
    return background.results("speculative_results")[0]


@pytest.fixture(scope="module")
def draft_model_results(background):
    return background.results("draft_model_results")[0]


@pytest.fixture(scope="module")
def eagle_results(background):
    return background.results("eagle_results")[0]


@pytest.fixture(scope="module")
def eagle3_results(background):
    return background.results("eagle3_results")[0]


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
    result, full, compacted = _drafter_changes_no_token(engine, draft_model_results, index)
    kv, speculation = result["kv"], result["speculation"]
    # the drafter computes what the target does: where it reads its own cache in vLLM's layout, every draft is accepted
    assert speculation["num_accepted_tokens"] == speculation["num_draft_tokens"] > 0, kv
    # drafts only for the requests that never compacted, as many as each had without eviction
    per_request = full["speculation"]["num_drafts"] / len(compacted)
    assert speculation["num_drafts"] == per_request * compacted.count(False), (kv, speculation)


@pytest.mark.parametrize("index", range(len(DRAFT_SETTINGS)), ids=[s.get("kv_policy", "full") for s in DRAFT_SETTINGS])
def test_an_eagle_head_drafts_as_without_eviction_until_a_request_compacts(engine, eagle_results, index):
    _drafts_as_without_eviction_until_a_request_compacts(engine, eagle_results, index)


@pytest.mark.parametrize("index", range(len(DRAFT_SETTINGS)), ids=[s.get("kv_policy", "full") for s in DRAFT_SETTINGS])
def test_an_eagle3_head_drafts_as_without_eviction_until_a_request_compacts(engine, eagle3_results, index):
    _drafts_as_without_eviction_until_a_request_compacts(engine, eagle3_results, index)


def _drafter_changes_no_token(engine, results: dict, index: int) -> tuple[dict, dict, list[bool]]:
    """A drafter with a cache of its own under DRAFT_SETTINGS[index]: the tokens, evicted counts and kept lists are
    those without speculation and the pool is whole after; under eviction the two longer prompts compacted. Returns
    (this setting's result, the full setting's, whether each request compacted)."""
    result, full = results["results"][index], results["results"][0]
    kv = result["kv"]
    assert kv == DRAFT_SETTINGS[index]
    outputs, kept = _without_speculation(engine, kv)
    assert result["outputs"] == [list(o.outputs[0].token_ids) for o in outputs], kv
    assert result["evicted"] == [o.kv_transfer_params["kv_tokens_evicted"] for o in outputs], kv
    assert result["kept"] == kept, kv
    assert result["free_blocks"] == results["total_blocks"], kv  # the drafter's slots leaked nothing
    compacted = [bool(evicted) for evicted in result["evicted"]]
    assert compacted.count(True) == (2 if kv else 0), result["evicted"]
    return result, full, compacted


def _drafts_as_without_eviction_until_a_request_compacts(engine, eagle_results: dict, index: int) -> None:
    """Until a request compacts, the target's hidden states and the head's own cache are what they are without
    eviction, so the request gets the drafts it gets without eviction, accepted as often; after, none."""
    result, full, compacted = _drafter_changes_no_token(engine, eagle_results, index)
    kv = result["kv"]
    assert sum(counts["num_accepted_tokens"] for counts in full["speculation"]) > 0  # the head drafts some right
    for own, unevicted, was_compacted in zip(result["speculation"], full["speculation"], compacted, strict=True):
        assert own == ({name: 0 for name in own} if was_compacted else unevicted), (kv, own, unevicted)


def test_which_drafters_serve_with_eviction():
    assert speculation_refusal(None) is None
    for method in ("ngram", "draft_model", "eagle", "eagle3"):
        assert speculation_refusal(SimpleNamespace(method=method)) is None
    for method in ("mtp", "suffix", "medusa"):
        refusal = speculation_refusal(SimpleNamespace(method=method))
        assert refusal is not None and repr(method) in refusal and "'ngram'" in refusal and "'eagle'" in refusal
    assert "pipeline" in speculation_refusal(SimpleNamespace(method="ngram"), pipeline_parallel_size=2)
    # the drafter's layers attend with vLLM's ops over vLLM's layout, which KVSERVE_ATTENTION=kernels does not keep
    for method in ("draft_model", "eagle", "eagle3"):
        assert "KVSERVE_ATTENTION" in speculation_refusal(SimpleNamespace(method=method), attention_mode="kernels")
    assert speculation_refusal(SimpleNamespace(method="ngram"), attention_mode="kernels") is None


# a draft model's layers come under vLLM's prefix with their own numbers; an EAGLE head's are numbered on from the
# target's last (here the target has 2 layers)
DRAFTER_LAYERS = ["draft_model.model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]


@pytest.mark.parametrize("drafter", DRAFTER_LAYERS, ids=["draft model", "EAGLE head"])
def test_the_targets_layers_page_beside_a_drafter_of_either_cache_shape(drafter):
    """A drafter of the target's cache shape joins the target's group; one whose KV heads, head size or dtype differ
    shares one group of mixed shapes with it (one block table, a cache per layer). Either way kvserve pages the
    target's layers by the target's spec; a group whose target layers differ among themselves is refused."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    from kvserve.vllm.model import layer_numbers, paged_group, paged_spec

    target = "model.layers.0.self_attn.attn"
    support = SimpleNamespace(evicts=True, num_layers=2, paged_layers=(0, 1), describe=lambda: "evicts on all 2 layers")

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
        assert paged_spec(built.kv_cache_groups[0], support.num_layers) == spec(64), drafter_head_size
        assert layer_numbers(built.kv_cache_groups[0].layer_names, support.num_layers) == (0, 1)
    with pytest.raises(RuntimeError, match="vLLM built KV-cache groups"):
        paged_group(config(64, second_target_head_size=128), support)
