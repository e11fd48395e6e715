"""EMS ("EMS: Adaptive Evict-then-Merge Strategy for Head-wise KV Cache Compression Based on Global-Local
Importance", Li et al. 2024, arXiv:2412.08521) against dense references: the global attention sums, the kept sets
and merged keys/values of evict-then-merge (with its zero class), the evict-only reductions, the budget per head,
and the global-local alignment (Eq. 2) on hand-made tensors."""

from __future__ import annotations

import pytest
import torch
from references import (
    F64,
    as_lists,
    dense_positions,
    generator,
    observation,
    ref_attention_sum,
    ref_mean_filter,
    ref_window_sums,
    run_causal_stats,
)

from kvserve.policies import EMS


def clustered_inputs(n, heads, group, dim, seed, clusters=4, loose=0.3):
    """Keys and values around a few shared directions per head (so merges happen), some tokens unclustered."""
    gen = generator(seed)
    key_centres = torch.randn(heads, clusters, dim, generator=gen)
    value_centres = torch.randn(heads, clusters, dim, generator=gen)
    label = torch.randint(0, clusters, (heads, n), generator=gen)
    free = torch.rand(heads, n, generator=gen) < loose
    keys = torch.randn(heads, n, dim, generator=gen)
    values = torch.randn(heads, n, dim, generator=gen)
    scale = 0.5 + torch.rand(heads, n, 1, generator=gen)
    for h in range(heads):
        tight = ~free[h]
        keys[h, tight] = scale[h, tight] * (key_centres[h, label[h, tight]] + 0.25 * keys[h, tight])
        values[h, tight] = scale[h, tight] * (value_centres[h, label[h, tight]] + 0.25 * values[h, tight])
    queries = torch.randn(n, heads * group, dim, generator=gen)
    return keys, values, queries


def cosine(a, b):
    a, b = a.to(F64), b.to(F64)
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


def ref_ems(obs, s_glo, window, kernel, tau, gamma, budget):
    """EMS Eq. 2, mean pooling, evict-then-merge with a zero class. Returns keep, keys, values and counts."""
    heads, n, _ = obs.keys.shape
    s_loc = ref_window_sums(obs.keys, obs.positions, obs.window_queries, obs.window_positions)
    split, n_imp = n - window, budget - window
    n_tbm = min(int(round((gamma - 1) * budget)), split - n_imp)
    keep_rows, key_rows, value_rows = [], [], []
    merged_count = zero_class = 0
    for h in range(heads):
        aligned = s_glo[h] * s_loc[h].sum() / s_glo[h].sum()
        s_gl = ref_mean_filter(torch.maximum(aligned, s_loc[h]), kernel)
        ranked = sorted(range(split), key=lambda j, s=s_gl: (-float(s[j]), j))
        centres, tbm = ranked[:n_imp], ranked[n_imp : n_imp + n_tbm]
        members = {c: [c] for c in centres}
        for i in tbm:
            similarity = [
                cosine(obs.keys[h, i], obs.keys[h, c]) * cosine(obs.values[h, i], obs.values[h, c]) for c in centres
            ]
            best = max(range(len(centres)), key=lambda d, s=similarity: (s[d], -d))
            if similarity[best] > tau:
                members[centres[best]].append(i)
                merged_count += 1
            else:
                zero_class += 1
        kept = sorted(centres + list(range(split, n)))
        keys, values = [], []
        for j in kept:
            group = members.get(j, [j])
            weights = torch.tensor([float(s_loc[h, m]) for m in group], dtype=F64)
            keys.append((weights[:, None] * obs.keys[h, group].to(F64)).sum(0) / weights.sum())
            values.append((weights[:, None] * obs.values[h, group].to(F64)).sum(0) / weights.sum())
        keep_rows.append(kept)
        key_rows.append(torch.stack(keys))
        value_rows.append(torch.stack(values))
    return keep_rows, torch.stack(key_rows), torch.stack(value_rows), merged_count, zero_class


def ems_case(n, heads, group, dim, seed):
    return clustered_inputs(n, heads, group, dim, seed)


@pytest.mark.parametrize("group", [1, 2])
def test_ems_attention_sum_step_by_step_matches_dense_causal_column_sums(group):
    heads, n, prefill, dim = 2, 40, 30, 8
    keys, values, queries = ems_case(n, heads, group, dim, seed=200 + group)
    stats = run_causal_stats(EMS(window=6), keys, values, queries, prefill)
    torch.testing.assert_close(stats["attention_sum"].to(F64), ref_attention_sum(keys, queries), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "group,window,budget,kernel,tau,gamma",
    [
        (1, 6, 14, 7, 0.6, 4.0),
        (2, 8, 20, 7, 0.6, 3.0),
        (2, 4, 12, 5, 0.3, 2.5),
        (3, 6, 16, 3, 0.8, 4.0),
    ],
)
def test_ems_matches_dense_reference(group, window, budget, kernel, tau, gamma):
    heads, n, prefill, dim = 3, 80, 68, 8
    keys, values, queries = ems_case(n, heads, group, dim, seed=210 + budget)
    policy = EMS(window=window, kernel_size=kernel, tau=tau, gamma=gamma)
    stats = run_causal_stats(policy, keys, values, queries, prefill)
    obs = observation(
        keys,
        values,
        dense_positions(heads, n),
        queries[-window:],
        torch.arange(n - window, n),
        stats=stats,
        budget=budget,
    )
    selection = policy.select(obs, budget)
    s_glo = ref_attention_sum(keys, queries)
    keep, ref_keys, ref_values, merged, zero_class = ref_ems(obs, s_glo, window, kernel, tau, gamma, budget)
    assert merged > 0 and zero_class > 0  # both branches of the merge rule are exercised
    assert as_lists(selection.keep_indices) == keep
    assert torch.equal(policy.keep_indices(obs, budget), selection.keep_indices)
    torch.testing.assert_close(selection.keys.to(F64), ref_keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(selection.values.to(F64), ref_values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tau,gamma", [(1.0, 4.0), (0.6, 1.0), (1.0, 1.0)])
def test_ems_reduces_to_evict_only(tau, gamma):
    heads, group, n, prefill, dim, window, budget, kernel = 3, 2, 70, 60, 8, 6, 18, 7
    keys, values, queries = ems_case(n, heads, group, dim, seed=220)
    policy = EMS(window=window, kernel_size=kernel, tau=tau, gamma=gamma)
    stats = run_causal_stats(policy, keys, values, queries, prefill)
    obs = observation(
        keys,
        values,
        dense_positions(heads, n),
        queries[-window:],
        torch.arange(n - window, n),
        stats=stats,
        budget=budget,
    )
    selection = policy.select(obs, budget)
    # pooled global-local top (budget - window) plus the window, from the reference scores
    s_glo = ref_attention_sum(keys, queries)
    s_loc = ref_window_sums(keys, obs.positions, obs.window_queries, obs.window_positions)
    expected = []
    for h in range(heads):
        s_gl = ref_mean_filter(torch.maximum(s_glo[h] * s_loc[h].sum() / s_glo[h].sum(), s_loc[h]), kernel)
        prefix = sorted(range(n - window), key=lambda j, s=s_gl: (-float(s[j]), j))[: budget - window]
        expected.append(sorted(prefix + list(range(n - window, n))))
    assert as_lists(selection.keep_indices) == expected
    index = selection.keep_indices
    torch.testing.assert_close(
        selection.keys, keys.gather(1, index[..., None].expand(-1, -1, dim)), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        selection.values, values.gather(1, index[..., None].expand(-1, -1, dim)), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("seed", range(4))
def test_ems_every_head_keeps_exactly_budget(seed):
    heads, group, dim = 4, 2, 8
    gen = generator(230 + seed)
    n = int(torch.randint(40, 90, (1,), generator=gen))
    window = int(torch.randint(1, 9, (1,), generator=gen))
    budget = int(torch.randint(window + 1, n - 2, (1,), generator=gen))
    keys, values, queries = ems_case(n, heads, group, dim, seed=240 + seed)
    policy = EMS(window=window, kernel_size=7, tau=0.5, gamma=4.0)
    stats = run_causal_stats(policy, keys, values, queries, n - 5)
    obs = observation(
        keys,
        values,
        dense_positions(heads, n),
        queries[-window:],
        torch.arange(n - window, n),
        stats=stats,
        budget=budget,
    )
    selection = policy.select(obs, budget)
    assert selection.keep_indices.shape == (heads, budget)
    assert selection.keys.shape == selection.values.shape == (heads, budget, dim)
    assert bool(torch.isfinite(selection.keys).all()) and bool(torch.isfinite(selection.values).all())
    for row in selection.keep_indices.tolist():
        assert len(set(row)) == budget and row == sorted(row)
        assert set(range(n - window, n)) <= set(row)


def test_ems_merged_entry_is_s_loc_weighted_mean_of_its_members():
    # Hand-made: tokens 0 and 1 dominate the global score (centres, N_imp = 2); token 2 is a scaled copy of token 0's
    # key and value direction (R ~ 1: merges into 0); token 3 is orthogonal to both centres (R = 0: zero class);
    # tokens 4.. are the window (window = 2, budget = 4, gamma = 1.5 -> N_tbm = 2: tokens 2 and 3).
    dim, n, window, budget = 6, 6, 2, 4
    e = torch.eye(dim)
    keys = torch.stack([e[0], e[1], 2.0 * e[0] + 0.01 * e[1], e[2], e[3] + e[4], e[4] - e[3]])[None]
    values = torch.stack([e[5], e[4], 3.0 * e[5] + 0.01 * e[4], e[3], e[0] + e[1], e[1] - e[0]])[None]
    gen = generator(250)
    window_queries = 1.5 * e[0] + 0.1 * torch.randn(window, 1, dim, generator=gen)  # token 2 gets most s_loc
    stats = {"attention_sum": torch.tensor([[600.0, 500.0, 1.0, 1.0, 1.0, 1.0]])}
    obs = observation(
        keys, values, dense_positions(1, n), window_queries, torch.arange(n - window, n), stats=stats, budget=budget
    )
    selection = EMS(window=window, kernel_size=1, tau=0.6, gamma=1.5).select(obs, budget)
    assert selection.keep_indices.tolist() == [[0, 1, 4, 5]]
    s_loc = ref_window_sums(keys, obs.positions, window_queries, obs.window_positions)[0]
    w0, w2 = float(s_loc[0]), float(s_loc[2])
    merged_value = (w0 * values[0, 0].to(F64) + w2 * values[0, 2].to(F64)) / (w0 + w2)
    merged_key = (w0 * keys[0, 0].to(F64) + w2 * keys[0, 2].to(F64)) / (w0 + w2)
    torch.testing.assert_close(selection.values[0, 0].to(F64), merged_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(selection.keys[0, 0].to(F64), merged_key, rtol=1e-5, atol=1e-6)
    # centre 1 had no member; the window is untouched; token 3 (zero class) left no trace
    torch.testing.assert_close(selection.values[0, 1:], values[0, [1, 4, 5]])
    torch.testing.assert_close(selection.keys[0, 1:], keys[0, [1, 4, 5]])


def test_ems_global_local_alignment_eq2_on_hand_made_tensors():
    # Zero keys: every window row is uniform over what it sees, so s_loc is known. Kernel 1: no pooling.
    # s_glo is chosen so that only Eq. 2 (align s_glo to s_loc's mean, then take the element-wise max) keeps
    # [0, 4] of the six non-window tokens: raw s_glo, aligned s_glo alone or max(raw s_glo, s_loc) keep [3, 4];
    # s_loc alone keeps [0, 1].
    dim, n, window, budget = 4, 8, 2, 4
    keys = torch.zeros(1, n, dim)
    gen = generator(260)
    values = torch.randn(1, n, dim, generator=gen)
    window_queries = torch.randn(window, 1, dim, generator=gen)
    # rows at positions 6, 7 see 7 and 8 keys: entries 0..6 get 1/7 + 1/8 each, entry 7 gets 1/8
    s_loc = torch.tensor([1 / 7 + 1 / 8] * 7 + [1 / 8], dtype=F64)
    s_glo = torch.tensor([[0.5, 0.1, 0.2, 2.0, 12.0, 0.3, 2.0, 0.5]])
    aligned = s_glo[0].to(F64) * s_loc.sum() / s_glo[0].to(F64).sum()
    s_gl = torch.maximum(aligned, s_loc)  # ties on the s_loc plateau go to the earlier token
    expected = sorted(sorted(range(n - window), key=lambda j: (-float(s_gl[j]), j))[: budget - window] + [6, 7])
    assert expected == [0, 4, 6, 7]
    obs = observation(
        keys,
        values,
        dense_positions(1, n),
        window_queries,
        torch.arange(n - window, n),
        stats={"attention_sum": s_glo},
        budget=budget,
    )
    selection = EMS(window=window, kernel_size=1, tau=1.0, gamma=1.0).select(obs, budget)
    assert selection.keep_indices.tolist() == [expected]
    # with kernel 3 the mean pooling (zero padding) decides: token 3 and 5 inherit a third of token 4's score
    pooled = ref_mean_filter(s_gl, 3)
    expected = sorted(sorted(range(n - window), key=lambda j: (-float(pooled[j]), j))[: budget - window] + [6, 7])
    selection = EMS(window=window, kernel_size=3, tau=1.0, gamma=1.0).select(obs, budget)
    assert selection.keep_indices.tolist() == [expected]
