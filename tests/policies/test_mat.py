"""MAT ("MAT: Unlocking KV Cache Efficiency via Managing Anchor Tokens", ACL ARR 2025 submission, OpenReview
0nGPjXF5rH) against dense references: the anchor logit folded in step by step, the deep layers' kept set (first
token, window and the lowest-logit anchors), the shallow layers' sinks and window, and planted anchors."""

from __future__ import annotations

import pytest
import torch
from references import (
    F64,
    as_lists,
    causal_inputs,
    dense_positions,
    generator,
    observation,
    run_causal_stats,
)

from kvserve.policies import MAT


def ref_anchor_logits(keys, queries):
    """MAT: pi_i = q_i . k_0 / sqrt(d), averaged over the group's query heads: [H, n]."""
    heads, n, dim = keys.shape
    group = queries.shape[1] // heads
    pi = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for i in range(n):
            for g in range(group):
                pi[h, i] += float(queries[i, h * group + g].to(F64) @ keys[h, 0].to(F64)) * dim**-0.5 / group
    return pi


@pytest.mark.parametrize("group", [1, 3])
def test_mat_anchor_logit_step_by_step_matches_reference(group):
    heads, n, prefill, dim = 2, 36, 24, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=140 + group)
    stats = run_causal_stats(MAT(), keys, values, queries, prefill, layer_idx=5)
    torch.testing.assert_close(stats["anchor_logit"].to(F64), ref_anchor_logits(keys, queries), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group,budget,fraction", [(1, 24, 0.25), (3, 16, 0.25), (2, 20, 0.5)])
def test_mat_deep_layer_matches_dense_reference(group, budget, fraction):
    heads, n, prefill, dim = 3, 60, 44, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=150 + budget)
    policy = MAT(shallow_layers=2, sink_tokens=4, anchor_fraction=fraction)
    stats = run_causal_stats(policy, keys, values, queries, prefill, layer_idx=2)
    obs = observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget, layer_idx=2)
    keep = policy.keep_indices(obs, budget)
    pi = ref_anchor_logits(keys, queries)
    beta = int(budget * fraction)
    assert beta == budget * fraction  # chosen so that c * fraction is whole: no rounding question
    window = list(range(n - (budget - beta), n))
    expected = []
    for h in range(heads):
        left_window = sorted(range(1, n - (budget - beta)), key=lambda i, h=h: (float(pi[h, i]), i))
        expected.append(sorted([0] + left_window[: beta - 1] + window))  # the LOWEST pi are the anchors
    assert as_lists(keep) == expected


@pytest.mark.parametrize("layer", [0, 1])
def test_mat_shallow_layer_keeps_sinks_and_window(layer):
    heads, group, n, prefill, dim, budget, sinks = 3, 2, 50, 40, 8, 20, 4
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=160 + layer)
    policy = MAT(shallow_layers=2, sink_tokens=sinks, anchor_fraction=0.25)
    stats = run_causal_stats(policy, keys, values, queries, prefill, layer_idx=layer)
    obs = observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget, layer_idx=layer)
    keep = policy.keep_indices(obs, budget)
    expected = list(range(sinks)) + list(range(n - (budget - sinks), n))
    assert as_lists(keep) == [expected] * heads


@pytest.mark.parametrize("seed", range(5))
def test_mat_deep_keeps_first_token_window_and_exactly_budget(seed):
    heads, group, dim = 2, 2, 8
    gen = generator(170 + seed)
    n = int(torch.randint(40, 90, (1,), generator=gen))
    budget = int(torch.randint(8, n - 4, (1,), generator=gen))
    fraction = float(torch.rand(1, generator=gen)) * 0.6 + 0.1
    beta = max(1, int(budget * fraction))
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=180 + seed)
    policy = MAT(shallow_layers=1, sink_tokens=4, anchor_fraction=fraction)
    stats = run_causal_stats(policy, keys, values, queries, n // 2, layer_idx=3)
    keep = policy.keep_indices(
        observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget, layer_idx=3), budget
    )
    assert keep.shape == (heads, budget)
    for row in keep.tolist():
        assert len(set(row)) == budget and row == sorted(row)
        assert row[0] == 0
        assert set(range(n - (budget - beta), n)) <= set(row)


def test_mat_anchors_have_low_logit_to_first_token():
    # Plant anchors: tokens whose query points away from k_0 have the lowest pi and must be the ones kept.
    heads, group, n, dim, budget = 2, 2, 40, 8, 16  # beta = 4: token 0 + 3 anchors
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=190)
    planted = [5, 11, 17]
    for h in range(heads):
        direction = keys[h, 0] / keys[h, 0].norm()
        for t in planted:
            queries[t, h * group : (h + 1) * group] = -10 * direction
    policy = MAT(shallow_layers=0, anchor_fraction=0.25)
    stats = run_causal_stats(policy, keys, values, queries, 20, layer_idx=4)
    keep = policy.keep_indices(
        observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget, layer_idx=4), budget
    )
    expected = [0] + planted + list(range(n - 12, n))
    assert as_lists(keep) == [expected] * heads
