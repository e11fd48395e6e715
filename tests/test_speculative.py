"""Speculative decoding (vLLM's n-gram prompt lookup) with eviction: a step that verifies drafts never compacts, the
rejected drafts' entries leave the lists, and the accepted tokens' queries count in the statistics and windows as
one-token steps would (`kvserve.core.compaction.drafts_allowed`, `kvserve.worker.drafts.settle_drafts`). So greedy
output with speculation equals greedy output without it under every policy family, and so do the compactions: the
positions each (layer, head) kept at its last one. The run with speculation is an engine of its own
(tests/speculative_run.py, in the background); the one without is the session's engine, on the same prompts under the
same cache salts."""

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


def background_runs() -> list[Run]:
    settings = Path(tempfile.mkdtemp(prefix="kvserve-speculative-")) / "settings.json"
    settings.write_text(json.dumps(SETTINGS))
    argv = [sys.executable, str(TESTS / "speculative_run.py"), str(settings), "{out}"]
    # vLLM's n-gram drafter is a numba kernel whose pool starts a thread per CPU, in a process bound to one CPU; a run
    # that takes a minute once outlived its 900 s timeout on CI beside the other tests: one thread, one suspect less
    return [Run("speculative_results", argv, {"NUMBA_NUM_THREADS": "1"})]


@pytest.fixture(scope="module")
def speculative_results(background):
    return background.results("speculative_results")[0]


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


def test_only_drafters_without_a_cache_of_their_own_are_served():
    assert speculation_refusal(None) is None
    assert speculation_refusal(SimpleNamespace(method="ngram")) is None
    for method in ("draft_model", "eagle", "eagle3", "mtp", "suffix"):
        refusal = speculation_refusal(SimpleNamespace(method=method))
        assert refusal is not None and repr(method) in refusal and "'ngram'" in refusal
    assert "pipeline" in speculation_refusal(SimpleNamespace(method="ngram"), pipeline_parallel_size=2)
