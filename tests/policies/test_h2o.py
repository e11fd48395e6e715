"""H2O ("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", Zhang et al. 2023,
arXiv:2306.14048) against dense references: the step-by-step attention sums equal the dense causal column sums,
the kept set is the recent window plus the heaviest accumulated entries, and the sums carry the expected position
bias."""

from __future__ import annotations

import pytest
import torch
from references import (
    F64,
    as_lists,
    bias_inputs,
    causal_inputs,
    dense_positions,
    observation,
    ref_attention_sum,
    ref_top,
    run_causal_stats,
)

from kvserve.policies import H2O


@pytest.mark.parametrize("group", [1, 3])
def test_h2o_attention_sum_step_by_step_matches_dense_causal_column_sums(group):
    heads, n, prefill, dim = 2, 40, 28, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=11 + group)
    stats = run_causal_stats(H2O(recent=4), keys, values, queries, prefill)
    reference = ref_attention_sum(keys, queries)
    torch.testing.assert_close(stats["attention_sum"].to(F64), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recent,budget", [(4, 16), (8, 20), (0, 12)])
def test_h2o_keeps_recent_plus_heaviest_accumulated(recent, budget):
    heads, group, n, prefill, dim = 3, 2, 48, 40, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=20 + recent)
    policy = H2O(recent=recent)
    stats = run_causal_stats(policy, keys, values, queries, prefill)
    obs = observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget)
    keep = policy.keep_indices(obs, budget)
    reference = ref_attention_sum(keys, queries)
    expected = [ref_top(reference[h], range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


@pytest.mark.parametrize("group", [1, 4])
def test_h2o_column_sums_of_causal_pass_total_n_per_query_head(group):
    # CAOTE Theorem B.1: every causal row sums to 1, so n rows give n per query head (G * n per KV head).
    heads, n, prefill, dim = 3, 64, 50, 16
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=31)
    stats = run_causal_stats(H2O(recent=0), keys, values, queries, prefill)["attention_sum"]
    torch.testing.assert_close(
        stats.sum(dim=-1).to(F64), torch.full((heads,), float(group * n), dtype=F64), rtol=1e-5, atol=1e-4
    )


def test_h2o_position_bias_matches_harmonic_sum():
    # AhaKV: for iid q, k, E[a_ij] = 1/i (row i sees i keys), so E[S_j] = sum_{i=j}^{n} 1/i, decreasing in j.
    n, heads, group, dim, trials, block = 512, 4, 4, 16, 4, 32
    policy = H2O(recent=0)
    mean = torch.zeros(n, dtype=F64)
    for keys, values, queries in bias_inputs(n, heads, group, dim, trials):
        obs = observation(keys, values, dense_positions(heads, n), stats={"attention_sum": torch.zeros(heads, n)})
        stats = policy.update_stats(obs, queries, torch.arange(n))["attention_sum"]
        mean += stats.to(F64).sum(dim=0) / (heads * group * trials)  # per query head
    harmonic = torch.tensor([sum(1.0 / i for i in range(j + 1, n + 1)) for j in range(n)], dtype=F64)
    blocks = (n - block) // block  # the last block has too few terms to average out
    measured = mean[: blocks * block].reshape(blocks, block).mean(dim=1)
    expected = harmonic[: blocks * block].reshape(blocks, block).mean(dim=1)
    assert ((measured - expected).abs() / expected).max() < 0.03
    assert bool((measured[1:] < measured[:-1]).all())
