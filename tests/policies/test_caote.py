"""CAOTE / FastCAOTE ("CAOTE: KV Caching through Attention Output Error based Token Eviction", Goel et al. 2025,
arXiv:2504.14051): the score's properties (it is the output change of actually removing each token, invariant to
a value shift and a score scale, FastCAOTE = CAOTE under uniform attention) and the kept sets of
H2O / TOVA / SnapKV / AhaKV + CAOTE and + FastCAOTE against dense references."""

from __future__ import annotations

import pytest
import torch
from references import (
    F64,
    ahakv_obs,
    as_lists,
    causal_inputs,
    dense_positions,
    generator,
    observation,
    ref_ahakv_scores,
    ref_attention_sum,
    ref_mean_filter,
    ref_top,
    ref_tova_scores,
    ref_window_sums,
    run_causal_stats,
)

from kvserve.policies import POLICIES, TOVA, SnapKV, caote_variant
from kvserve.policies.caote import caote_score

CAOTE_MIN_REMAINDER = 1e-6  # kvserve's reading of CAOTE: clamp 1 - h_norm_j at >= 1e-6


def ref_caote(base, values, fast):
    """CAOTE (arXiv:2504.14051) Eq. 21 / 23 for one head: c_j = h_j / (1 - h_j) * ||X - v_j||, h = base / sum(base)."""
    h = base.to(F64) / base.to(F64).sum()
    values = values.to(F64)
    output = values.mean(dim=0) if fast else (h[:, None] * values).sum(dim=0)
    remainder = torch.clamp(1 - h, min=CAOTE_MIN_REMAINDER)
    return h / remainder * torch.sqrt(((output[None, :] - values) ** 2).sum(dim=-1))


def ref_snapkv_scores(obs, window, kernel):
    """SnapKV's votes: window column sums, avg-pooled over the prefix, the window's own votes as they are."""
    votes = ref_window_sums(obs.keys, obs.positions, obs.window_queries, obs.window_positions)
    split = obs.num_tokens - window
    return torch.stack([torch.cat([ref_mean_filter(row[:split], kernel), row[split:]]) for row in votes])


# --------------------------------------------------------------------------------------------------------------------
# The score's properties
# --------------------------------------------------------------------------------------------------------------------


def single_query(n, dim, seed, logit_scale=1.0):
    gen = generator(seed)
    logits = torch.randn(n, generator=gen, dtype=F64) * logit_scale
    values = torch.randn(n, dim, generator=gen, dtype=F64)
    return logits, values


@pytest.mark.parametrize("seed", range(4))
def test_caote_equals_output_change_of_actually_removing_each_token(seed):
    n, dim = 12, 6
    logits, values = single_query(n, dim, seed, logit_scale=1.5)
    attention = torch.softmax(logits, dim=0)
    output = attention @ values
    changes = []
    for j in range(n):
        rest = [i for i in range(n) if i != j]
        renormalised = torch.softmax(logits[rest], dim=0)  # softmax recomputed without token j
        changes.append(torch.linalg.vector_norm(output - renormalised @ values[rest]))
    changes = torch.stack(changes)
    c = caote_score(attention[None], values[None], fast=False)[0].to(F64)
    torch.testing.assert_close(c, changes, rtol=1e-5, atol=1e-5)
    # evicting argmin c is the best single eviction
    assert int(torch.argmin(c)) == int(torch.argmin(changes))


def test_tova_caote_evicts_the_token_whose_removal_changes_the_output_least():
    # TOVA's base score is the newest query's true attention (G = 1), so with budget n - 1 TOVA+CAOTE must drop the
    # token whose removal (softmax recomputed) moves that query's output the least.
    heads, n, dim = 4, 20, 8
    keys, values, queries = causal_inputs(n, heads, 1, dim, seed=90, dtype=F64)
    obs = observation(keys, values, dense_positions(heads, n), queries[-1:], torch.tensor([n - 1]), budget=n - 1)
    keep = POLICIES["tova+caote"]().keep_indices(obs, n - 1)
    for h in range(heads):
        logits = keys[h] @ queries[-1, h] * dim**-0.5
        output = torch.softmax(logits, 0) @ values[h]
        change = [
            torch.linalg.vector_norm(
                output
                - torch.softmax(logits[[i for i in range(n) if i != j]], 0) @ values[h][[i for i in range(n) if i != j]]
            )
            for j in range(n)
        ]
        evicted = set(range(n)) - set(keep[h].tolist())
        assert evicted == {int(torch.argmin(torch.stack(change)))}


@pytest.mark.parametrize("fast", [False, True])
def test_caote_invariant_to_value_shift_and_score_scale(fast):
    heads, n, dim = 3, 15, 8
    gen = generator(91)
    base = torch.rand(heads, n, generator=gen, dtype=F64) * 5
    values = torch.randn(heads, n, dim, generator=gen, dtype=F64)
    c = caote_score(base, values, fast).to(F64)
    shift = torch.randn(dim, generator=gen, dtype=F64) * 4
    torch.testing.assert_close(caote_score(base, values + shift, fast).to(F64), c, rtol=1e-4, atol=1e-5)
    for lam in (0.01, 3.0, 250.0):
        torch.testing.assert_close(caote_score(base * lam, values, fast).to(F64), c, rtol=1e-5, atol=1e-6)
    for s in (-2.5, 0.3, 7.0):
        torch.testing.assert_close(caote_score(base, values * s, fast).to(F64), abs(s) * c, rtol=1e-5, atol=1e-5)


def test_fastcaote_equals_caote_with_uniform_attention():
    heads, n, dim = 3, 17, 8
    gen = generator(92)
    values = torch.randn(heads, n, dim, generator=gen, dtype=F64)
    uniform = torch.full((heads, n), 1.0 / n, dtype=F64)
    torch.testing.assert_close(
        caote_score(uniform, values, True), caote_score(uniform, values, False), rtol=1e-6, atol=1e-6
    )
    # and both are the reference formula
    for h in range(heads):
        torch.testing.assert_close(
            caote_score(uniform, values, True)[h].to(F64), ref_caote(uniform[h], values[h], True), rtol=1e-5, atol=1e-6
        )
    # with non-uniform scores they differ (the test above is not vacuous)
    skewed = torch.softmax(torch.randn(heads, n, generator=gen, dtype=F64) * 2, dim=-1)
    assert not torch.allclose(caote_score(skewed, values, True), caote_score(skewed, values, False), atol=1e-4)


@pytest.mark.parametrize("fast", [False, True])
def test_caote_score_matches_reference_formula(fast):
    heads, n, dim = 3, 20, 8
    gen = generator(93)
    base = torch.rand(heads, n, generator=gen, dtype=F64) * 3
    base[0, 2] = 300.0  # a dominant entry: 1 - h near its clamp region, still above 1e-6
    values = torch.randn(heads, n, dim, generator=gen, dtype=F64)
    c = caote_score(base, values, fast).to(F64)
    for h in range(heads):
        torch.testing.assert_close(c[h], ref_caote(base[h], values[h], fast), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Composed with base policies: kept sets against dense references
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("group,recent,budget", [(1, 4, 16), (3, 6, 22)])
def test_h2o_caote_matches_dense_reference(fast, group, recent, budget):
    heads, n, prefill, dim = 3, 44, 36, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=100 + group + 2 * fast)
    policy = POLICIES["h2o+fastcaote" if fast else "h2o+caote"](recent=recent)
    stats = run_causal_stats(policy, keys, values, queries, prefill)
    obs = observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget)
    keep = policy.keep_indices(obs, budget)
    base = ref_attention_sum(keys, queries) / group  # GQA: the group's scores averaged before normalising
    expected = [ref_top(ref_caote(base[h], values[h], fast), range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("group,budget", [(1, 12), (3, 20)])
def test_tova_caote_matches_dense_reference(fast, group, budget):
    heads, n, dim = 3, 40, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=110 + group + 2 * fast)
    obs = observation(keys, values, dense_positions(heads, n), queries[-1:], torch.tensor([n - 1]), budget=budget)
    keep = caote_variant(TOVA, fast)().keep_indices(obs, budget)
    base = ref_tova_scores(obs)
    assert as_lists(keep) == [ref_top(ref_caote(base[h], values[h], fast), [], budget) for h in range(heads)]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("group,window,budget,kernel", [(1, 6, 18, 7), (3, 8, 26, 5)])
def test_snapkv_caote_matches_dense_reference(fast, group, window, budget, kernel):
    heads, n, dim = 3, 50, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=120 + group + 2 * fast)
    obs = observation(
        keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n), budget=budget
    )
    keep = caote_variant(SnapKV, fast)(window=window, kernel_size=kernel).keep_indices(obs, budget)
    base = ref_snapkv_scores(obs, window, kernel)
    expected = [ref_top(ref_caote(base[h], values[h], fast), range(n - window, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("group,recent,budget", [(1, 4, 16), (3, 6, 24)])
def test_ahakv_caote_matches_dense_reference(fast, group, recent, budget):
    heads, n, dim, kernel = 3, 56, 8, 7
    obs = ahakv_obs(n, heads, group, dim, recent, budget, seed=130 + group + 2 * fast, sparse=False)
    keep = POLICIES["ahakv+fastcaote" if fast else "ahakv+caote"](recent=recent, kernel_size=kernel).keep_indices(
        obs, budget
    )
    base = ref_ahakv_scores(obs, recent, kernel, budget)
    expected = [ref_top(ref_caote(base[h], obs.values[h], fast), range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected
