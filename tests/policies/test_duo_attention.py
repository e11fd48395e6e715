"""DuoAttention ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", Xiao et al.
2024, arXiv:2410.10819) against its rules, written out here: the retrieval heads are the largest trained gates, a
streaming head keeps exactly its sinks and its newest tokens, the retrieval heads share the rest of L x H x B and
choose by SnapKV's votes, and the fraction's two ends are all-streaming and plain SnapKV."""

from __future__ import annotations

import pytest
import torch
from references import as_lists, window_observation

from kvserve.duo import roles as roles_module
from kvserve.duo.roles import HeadRoles, roles_for
from kvserve.policies import DuoAttention, LayerObservation, SnapKV

LAYERS, HEADS, N = 4, 3, 200


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """Roles of a made-up model, 4 layers x 3 KV heads, with distinct gates."""
    gates = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.05], [0.3, 0.95, 0.4], [0.0, 0.6, 0.7]])
    monkeypatch.setattr(roles_module, "ROLES_DIR", tmp_path)
    roles_for.cache_clear()
    HeadRoles("tiny-duo", gates, sink_tokens=16, recent=64).save(tmp_path / "tiny-duo.json", {"test": True})
    yield gates
    roles_for.cache_clear()


def observe(layer: int, seed: int = 0) -> LayerObservation:
    obs = window_observation(N, heads=HEADS, group=2, dim=16, window=32, seed=seed)
    return LayerObservation(**{**obs.__dict__, "layer_idx": layer, "model": "tiny-duo"})


def test_retrieval_heads_are_the_largest_gates(trained):
    roles = HeadRoles.for_model("tiny-duo", HEADS)
    chosen = roles.retrieval(0.25)  # 3 of 12
    assert chosen.nonzero().tolist() == [[0, 0], [1, 1], [2, 1]]  # gates 0.9, 0.8, 0.95
    assert int(roles.retrieval(0.5).sum()) == 6 and not roles.retrieval(0.0).any() and roles.retrieval(1.0).all()


@pytest.mark.parametrize("fraction,budget", [(0.25, 100), (0.5, 120), (0.75, 96)])
def test_streaming_heads_keep_sinks_and_recent_and_retrieval_heads_share_the_rest(trained, fraction, budget):
    policy = DuoAttention(retrieval_fraction=fraction)
    retrieval_heads = round(fraction * LAYERS * HEADS)
    share = (LAYERS * HEADS * budget - (LAYERS * HEADS - retrieval_heads) * 80) // retrieval_heads
    chosen = HeadRoles.for_model("tiny-duo", HEADS).retrieval(fraction)
    total = 0
    for layer in range(LAYERS):
        obs = observe(layer, seed=layer)
        selection = policy.select(obs, budget)
        kept = as_lists(selection.keep_indices)
        for head in range(HEADS):
            count = int(selection.keep_counts[head])
            total += count
            if chosen[layer, head]:  # SnapKV's choice at the retrieval heads' share, for this head
                assert count == share
                reference = SnapKV(window=32, kernel_size=policy.kernel_size).keep_indices(obs, share)[head].tolist()
                assert kept[head][:count] == reference
            else:
                assert count == 80
                assert kept[head][:count] == list(range(16)) + list(range(N - 64, N))
    assert LAYERS * HEADS * budget - retrieval_heads < total <= LAYERS * HEADS * budget  # equal memory


def test_all_retrieval_is_snapkv_and_no_retrieval_is_streaming(trained):
    obs = observe(2, seed=5)
    everything = DuoAttention(retrieval_fraction=1.0).select(obs, 100)
    snapkv = SnapKV(window=32, kernel_size=DuoAttention().kernel_size)  # at DuoAttention's pool
    assert torch.equal(everything.keep_indices, snapkv.keep_indices(obs, 100))
    nothing = DuoAttention(retrieval_fraction=0.0).select(obs, 100)
    assert nothing.keep_counts.tolist() == [80] * HEADS


def test_a_budget_above_the_cache_keeps_every_entry_of_a_retrieval_head(trained):
    obs = observe(0)  # head 0 retrieves at fraction 0.25
    selection = DuoAttention(retrieval_fraction=0.25).select(obs, 4096)
    assert selection.keep_counts.tolist() == [N, 80, 80]
    assert as_lists(selection.keep_indices)[0] == list(range(N))


def test_a_cache_shorter_than_the_budget_keeps_what_each_head_holds_up_to_its_count(trained):
    obs = window_observation(40, heads=HEADS, group=2, dim=16, window=32, seed=1)
    obs = LayerObservation(**{**obs.__dict__, "layer_idx": 0, "model": "tiny-duo"})
    selection = DuoAttention(retrieval_fraction=0.25).select(obs, 100)
    assert selection.keep_counts.tolist() == [40, 40, 40]  # 160 and 80 capped at the 40 each head holds


def test_a_model_without_roles_is_refused_with_its_name(trained):
    obs = LayerObservation(**{**observe(0).__dict__, "model": "other-model"})
    with pytest.raises(ValueError, match="no DuoAttention head roles for model 'other-model'"):
        DuoAttention().select(obs, 100)
