"""Policies on random tensors against dense references written here from the papers' rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import KVConfigError, parse_kv_config
from kvserve.policies import LayerObservation, SnapKV, StreamingLLM


def observation(n: int, heads: int = 3, group: int = 3, dim: int = 16, window: int = 8, seed: int = 0,
                positions: torch.Tensor | None = None) -> LayerObservation:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    queries = torch.randn(window, heads * group, dim, generator=gen)
    if positions is None:
        positions = torch.arange(n).expand(heads, -1)
    return LayerObservation(layer_idx=0, keys=keys, values=values, positions=positions, scale=dim**-0.5,
                            window_queries=queries, window_positions=positions[0, -window:].clone())


def test_streamingllm_keeps_sinks_and_recent():
    obs = observation(100)
    keep = StreamingLLM(sink_tokens=4).keep_indices(obs, 20)
    expected = [0, 1, 2, 3] + list(range(84, 100))
    assert keep.shape == (3, 20)
    assert all(row.tolist() == expected for row in keep)


def dense_snapkv(obs: LayerObservation, budget: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV from its definition: full softmax rows of the window queries, causal by position, summed."""
    heads, n, dim = obs.keys.shape
    keep = []
    for h in range(heads):
        group = obs.window_queries.shape[1] // heads
        votes = torch.zeros(n)
        for g in range(group):
            for i in range(obs.window_queries.shape[0]):
                q = obs.window_queries[i, h * group + g]
                logits = (obs.keys[h] @ q) * obs.scale
                logits[obs.positions[h] > obs.window_positions[i]] = float("-inf")
                votes += torch.softmax(logits, dim=0)
        prefix = votes[: n - window][None, None]
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        pooled = pool(prefix, kernel, stride=1, padding=kernel // 2)[0, 0]
        top = torch.sort(pooled, descending=True, stable=True).indices[: budget - window]  # ties: earlier token
        keep.append(sorted(top.tolist() + list(range(n - window, n))))
    return torch.tensor(keep)


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("n,budget", [(64, 24), (200, 100), (33, 32)])
def test_snapkv_matches_dense_reference(pooling, n, budget):
    window, kernel = 8, 5
    obs = observation(n, window=window, seed=n)
    keep = SnapKV(window=window, kernel_size=kernel, pooling=pooling).keep_indices(obs, budget)
    assert torch.equal(keep, dense_snapkv(obs, budget, window, kernel, pooling))


def test_snapkv_after_compaction_uses_positions_for_causality():
    # a cache that was compacted before: positions are sparse; window queries are the newest tokens
    positions = torch.stack([torch.sort(torch.randperm(300)[:80]).values for _ in range(3)])
    positions[:, -8:] = torch.arange(292, 300)
    obs = observation(80, window=8, positions=positions, seed=3)
    keep = SnapKV(window=8, kernel_size=3).keep_indices(obs, 40)
    assert torch.equal(keep, dense_snapkv(obs, 40, 8, 3, "avg"))


def test_window_attention_is_causal_and_normalised():
    obs = observation(50, window=6)
    probs = obs.window_attention()  # [H, G, w, n]
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]))
    assert probs[..., 0, 45:].abs().max() == 0  # the oldest window query (position 44) sees nothing after it


@pytest.mark.parametrize("bad,field", [
    ({"kv_policy": "lru", "kv_budget": 64}, "kv_policy"),
    ({"kv_policy": "snapkv", "kv_budget": "64k"}, "kv_budget"),
    ({"kv_policy": "snapkv", "kv_budget": 1.5}, "kv_budget"),
    ({"kv_policy": "snapkv", "kv_budget": 32}, "kv_budget"),
    ({"kv_policy": "snapkv"}, "kv_budget"),
    ({"kv_policy": "streamingllm", "kv_budget": 4}, "kv_budget"),
    ({"kv_policy": "snapkv", "kv_budget": 64, "kv_window": -1}, "kv_window"),
    ({"kv_policy": "snapkv", "kv_budget": 64, "kv_kernel_size": 4}, "kv_kernel_size"),
    ({"kv_policy": "snapkv", "kv_budget": 64, "kv_pooling": "median"}, "kv_pooling"),
    ({"kv_policy": "snapkv", "kv_budget": 64, "kv_sink_tokens": 2}, "kv_sink_tokens"),
    ({"kv_policy": "streamingllm", "kv_budget": 64, "kv_evict_every_chunk": "sometimes"}, "kv_evict_every_chunk"),
    ({"kv_policy": "full", "kv_budget": 64}, "kv_budget"),
    ({"kv_polcy": "snapkv"}, "kv_polcy"),
    ({"kv_policy": "ems", "kv_budget": 64, "kv_tau": "high"}, "kv_tau"),
    ({"kv_policy": "ems", "kv_budget": 64, "kv_tau": 1.5}, "kv_tau"),
    ({"kv_policy": "ems", "kv_budget": 64, "kv_gamma": "nan"}, "kv_gamma"),
    ({"kv_policy": "mat", "kv_budget": 64, "kv_anchor_fraction": -0.1}, "kv_anchor_fraction"),
    ({"kv_policy": "h2o+caote", "kv_budget": 16}, "kv_budget"),
    ({"kv_policy": "streamingllm+caote", "kv_budget": 64}, "kv_policy"),
])
def test_invalid_settings_name_the_field(bad, field):
    with pytest.raises(KVConfigError) as info:
        parse_kv_config(bad, defaults={})
    assert info.value.field == field


def test_server_defaults_apply_and_foreign_default_knobs_are_dropped():
    defaults = {"kv_policy": "streamingllm", "kv_budget": 256, "kv_sink_tokens": 8}
    assert parse_kv_config({}, defaults).knobs == (("sink_tokens", 8),)
    snap = parse_kv_config({"kv_policy": "snapkv"}, defaults)
    assert snap.policy == "snapkv" and snap.budget == 256 and dict(snap.knobs)["window"] == 32
    assert parse_kv_config({"kv_policy": "full"}, defaults).evicts is False
    assert parse_kv_config({"kv_budget": "300", "kv_evict_every_chunk": "true"}, defaults).evict_every_chunk


@pytest.mark.parametrize("policy", ["ems+caote", "streamingllm+fastcaote", "mat+caote"])
def test_caote_over_a_policy_without_scores_is_refused_with_the_reason(policy):
    with pytest.raises(KVConfigError) as error:
        parse_kv_config({"kv_policy": policy, "kv_budget": 128}, defaults={})
    assert error.value.field == "kv_policy"
    assert "not a supported combination" in error.value.message and "h2o" in error.value.message


def test_an_unknown_policy_lists_the_allowed_ones():
    with pytest.raises(KVConfigError) as error:
        parse_kv_config({"kv_policy": "lru+caote", "kv_budget": 128}, defaults={})
    assert "unknown policy" in error.value.message and "snapkv+caote" in error.value.message


@pytest.mark.parametrize("name,settings", [("tova", {}), ("snapkv", {"kv_window": 4}), ("streamingllm", {}),
                                           ("h2o", {"kv_recent": 4})])
def test_ragged_heads_keep_what_each_head_alone_would_keep(name, settings):
    """Heads holding different counts (padded to the longest, `lengths` given): each head keeps exactly what the same
    policy keeps from that head's own entries alone, and a head shorter than the budget keeps all of its entries."""
    from kvserve.config import parse_kv_config

    budget, lengths = 12, torch.tensor([40, 9, 25])
    full = observation(40, heads=3, seed=5)
    full.stats = {"attention_sum": torch.rand(3, 40)}
    padding = torch.arange(40)[None, :] >= lengths[:, None]
    ragged = replace(full, keys=full.keys.masked_fill(padding[..., None], 0),
                     values=full.values.masked_fill(padding[..., None], 0),
                     positions=full.positions.masked_fill(padding, -1), lengths=lengths,
                     stats={"attention_sum": full.stats["attention_sum"].masked_fill(padding, 0)})
    policy = parse_kv_config({"kv_policy": name, "kv_budget": budget, **settings}, defaults={}).make_policy()
    selection = policy.select(ragged, budget)
    assert selection.keep_counts.tolist() == lengths.clamp(max=budget).tolist()
    for head, length in enumerate(lengths.tolist()):
        alone = replace(full, keys=full.keys[head : head + 1, :length], values=full.values[head : head + 1, :length],
                        positions=full.positions[head : head + 1, :length],
                        stats={"attention_sum": full.stats["attention_sum"][head : head + 1, :length]})
        if full.window_queries is not None:  # the head's own query group
            group = full.window_queries.shape[1] // 3
            alone.window_queries = full.window_queries[:, head * group : (head + 1) * group]
        want = policy.select(alone, min(budget, length)).keep_indices[0]
        assert selection.keep_indices[head, : len(want)].tolist() == want.tolist(), head
