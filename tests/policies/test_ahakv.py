"""AhaKV ("AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large Language
Models", Gu et al. 2025, arXiv:2506.03762) against dense references: the kept sets, the recent accumulation that
is flat in position (unlike H2O's), the step gain (plain softmax for rows that see at most k keys, row entropy
log k otherwise) and the value prior."""

from __future__ import annotations

import math

import pytest
import torch
from references import (
    F64,
    ahakv_obs,
    as_lists,
    bias_inputs,
    causal_inputs,
    dense_positions,
    generator,
    observation,
    ref_ahakv_scores,
    ref_gamma_bar,
    ref_top,
)

from kvserve.policies import H2O, AhaKV


def test_ahakv_recent_accumulation_is_flat_in_position_unlike_h2o():
    # AhaKV Eq. 5: only the last B_r rows are summed, so every key before them gets B_r terms of mean 1/i.
    n, heads, group, dim, trials, recent = 512, 4, 4, 16, 4, 32
    budget = recent + 128
    aha, h2o = AhaKV(recent=recent, kernel_size=1), H2O(recent=0)
    aha_mean = torch.zeros(n, dtype=F64)
    h2o_mean = torch.zeros(n, dtype=F64)
    for keys, _, queries in bias_inputs(n, heads, group, dim, trials):
        values = torch.ones(heads, n, dim)  # gamma_bar = 1: isolate the accumulation
        positions = dense_positions(heads, n)
        obs = observation(
            keys,
            values,
            positions,
            queries[-recent:],
            torch.arange(n - recent, n),
            stats={"attention_sum": torch.zeros(heads, n)},
            budget=budget,
        )
        aha_mean += aha.score(obs).to(F64).sum(dim=0)
        h2o_mean += h2o.update_stats(obs, queries, torch.arange(n))["attention_sum"].to(F64).sum(dim=0)
    span = n - recent  # keys every recent row sees
    j = torch.arange(span, dtype=F64)

    def relative_slope(curve):
        part = curve[:span]
        slope = ((j - j.mean()) * (part - part.mean())).sum() / ((j - j.mean()) ** 2).sum()
        return float(slope * span / part.mean())  # change over the whole span, relative to the mean

    assert abs(relative_slope(aha_mean)) < 0.05
    assert relative_slope(h2o_mean) < -1.0
    half = span // 2
    assert abs(float(aha_mean[:half].mean() / aha_mean[half:span].mean()) - 1) < 0.05
    assert float(h2o_mean[:half].mean() / h2o_mean[half:span].mean()) > 3


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize(
    "group,recent,budget,kernel", [(1, 4, 16, 7), (3, 8, 24, 7), (2, 6, 30, 5), (2, 6, 40, 3), (2, 4, 62, 7)]
)  # i / k just above 1: lambda' < 1
def test_ahakv_matches_dense_reference(sparse, group, recent, budget, kernel):
    heads, n, dim = 3, 64, 8
    obs = ahakv_obs(n, heads, group, dim, recent, budget, seed=50 + budget + group, sparse=sparse)
    keep = AhaKV(recent=recent, kernel_size=kernel).keep_indices(obs, budget)
    reference = ref_ahakv_scores(obs, recent, kernel, budget)
    expected = [ref_top(reference[h], range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


def test_ahakv_rows_seeing_at_most_k_keys_use_the_plain_softmax():
    # AhaKV: if i <= k there is nothing to evict, so lambda' = 1. Window queries older than most entries (causal by
    # position) see few keys; the newest sees more than k, so both branches of the gain meet in one score.
    heads, group, n, dim, recent, budget = 2, 2, 96, 8, 3, 30  # k = 27
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=65)
    window_positions = torch.tensor([9, 20, n - 1])  # rows see 10 and 21 keys (<= k) and 96 keys (> k)
    obs = observation(
        keys, values, dense_positions(heads, n), queries[window_positions], window_positions, budget=budget
    )
    keep = AhaKV(recent=recent, kernel_size=7).keep_indices(obs, budget)
    reference = ref_ahakv_scores(obs, recent, 7, budget)
    assert as_lists(keep) == [ref_top(reference[h], range(n - recent, n), budget) for h in range(heads)]


@pytest.mark.parametrize("seed", range(6))
def test_ahakv_keeps_last_recent_and_exactly_budget(seed):
    heads, group, dim = 2, 2, 8
    gen = generator(seed)
    n = int(torch.randint(30, 90, (1,), generator=gen))
    recent = int(torch.randint(1, 10, (1,), generator=gen))
    budget = int(torch.randint(recent + 1, n, (1,), generator=gen))
    obs = ahakv_obs(n, heads, group, dim, recent, budget, seed=seed + 60, sparse=bool(seed % 2))
    keep = AhaKV(recent=recent, kernel_size=7).keep_indices(obs, budget)
    assert keep.shape == (heads, budget)
    for row in keep.tolist():
        assert len(set(row)) == budget and row == sorted(row)
        assert set(range(n - recent, n)) <= set(row)
        assert all(0 <= j < n for j in row)


def test_ahakv_value_prior_in_unit_interval_with_max_one():
    # Zero keys make every attention row uniform over what it sees (any gain), so F is known and score / F is the
    # policy's gamma_bar, compared with Eq. 13-14.
    heads, group, n, dim, recent, budget, kernel = 3, 2, 50, 8, 5, 20, 7
    gen = generator(70)
    values = torch.randn(heads, n, dim, generator=gen) * torch.rand(heads, n, 1, generator=gen) * 3
    keys = torch.zeros(heads, n, dim)
    queries = torch.randn(recent, heads * group, dim, generator=gen)
    positions = dense_positions(heads, n)
    obs = observation(keys, values, positions, queries, torch.arange(n - recent, n), budget=budget)
    accumulated = torch.zeros(n, dtype=F64)
    for p in range(n - recent, n):
        accumulated[: p + 1] += group / (p + 1)
    gamma_bar = AhaKV(recent=recent, kernel_size=kernel).score(obs).to(F64) / accumulated
    assert bool((gamma_bar > 0).all()) and bool((gamma_bar <= 1 + 1e-6).all())
    torch.testing.assert_close(gamma_bar.amax(dim=-1), torch.ones(heads, dtype=F64), rtol=1e-6, atol=1e-6)
    half = kernel // 2  # away from the ends the mean filter has no padding question
    for h in range(heads):
        reference = ref_gamma_bar(values[h], kernel)
        torch.testing.assert_close(
            gamma_bar[h, half : n - half] / gamma_bar[h, half : n - half].max(),
            reference[half : n - half] / reference[half : n - half].max(),
            rtol=1e-5,
            atol=1e-6,
        )


def test_ahakv_value_prior_edges_follow_snapkv_mean_pooling():
    # The same measurement at the first and last kernel // 2 entries, where kvserve's reading (mean filter, "same"
    # padding, as SnapKV's pooling) decides the divisor.
    heads, group, n, dim, recent, budget, kernel = 2, 1, 30, 8, 4, 12, 7
    gen = generator(71)
    values = torch.randn(heads, n, dim, generator=gen)
    queries = torch.randn(recent, heads * group, dim, generator=gen)
    obs = observation(
        torch.zeros(heads, n, dim),
        values,
        dense_positions(heads, n),
        queries,
        torch.arange(n - recent, n),
        budget=budget,
    )
    accumulated = torch.zeros(n, dtype=F64)
    for p in range(n - recent, n):
        accumulated[: p + 1] += group / (p + 1)
    gamma_bar = AhaKV(recent=recent, kernel_size=kernel).score(obs).to(F64) / accumulated
    expected = torch.stack([ref_gamma_bar(values[h], kernel) for h in range(heads)])
    torch.testing.assert_close(gamma_bar, expected, rtol=1e-5, atol=1e-6)


def test_ahakv_step_gain_row_entropy_is_log_budget():
    # AhaKV Eq. 12: lambda = sqrt(2 log(i/k) / d) on the RAW q.k makes the expected row entropy log k
    # (d = 128, i = 4096, k = 1000: about 6.92 vs log 1000 = 6.91). With B_r = 1 and a flat value prior the policy's
    # score is exactly that one sharpened row.
    heads, dim, n, selected = 24, 128, 4096, 1000
    gen = generator(80)
    keys = torch.randn(heads, n, dim, generator=gen)
    query = torch.randn(1, heads, dim, generator=gen)
    obs = observation(
        keys, torch.ones(heads, n, dim), dense_positions(heads, n), query, torch.tensor([n - 1]), budget=selected + 1
    )
    rows = AhaKV(recent=1, kernel_size=1).score(obs).to(F64)
    lam = math.sqrt(2 * math.log(n / selected) / dim)
    raw = torch.einsum("hnd,hd->hn", keys.to(F64), query[0].to(F64)) * lam
    expected = torch.softmax(raw, dim=-1)
    torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-7)
    entropy = -(rows * torch.log(rows)).sum(dim=-1)
    assert abs(float(entropy.mean()) / math.log(selected) - 1) < 0.01
    # the unsharpened row is far flatter: the gain matters
    plain = torch.softmax(raw / lam / math.sqrt(dim), dim=-1)
    assert float(-(plain * torch.log(plain)).sum(dim=-1).mean()) > math.log(selected) + 0.5
