"""The paper policies (H2O, TOVA, AhaKV, CAOTE/FastCAOTE, MAT, EMS) against dense references written here.

Every reference below is built from the papers' equations with plain loops and float64 tensor
code; none calls a policy's own helpers (`score`, `step_gain`, `global_local`, `caote_score`,
`LayerObservation.attention`). Policies run on small random tensors from seeded generators; the tests compare the
kept sets (and EMS's merged keys/values), then check the properties listed under "Checks" in each spec.

Conventions shared with the policies: H = KV heads, G = query heads per KV head (query head j belongs to KV head
j // G), ties in a ranking go to the earlier token.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.policies import EMS, H2O, MAT, POLICIES, TOVA, AhaKV, LayerObservation, SnapKV, caote_variant
from kvserve.policies.caote import caote_score

F64 = torch.float64
CAOTE_MIN_REMAINDER = 1e-6  # caote.md: clamp 1 - h_norm_j at >= 1e-6

# ahakv.md: "Mean filter: odd kernel 7 (same as SnapKV's pooling), same padding." SnapKV's pooling (SnapKV's code,
# torch's avg_pool1d with padding = k // 2) pads with zeros and divides by the full kernel size at the edges.
AHAKV_EDGE_DIVIDES_BY_KERNEL = True


# --------------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_inputs(n, heads, group, dim, seed, dtype=torch.float32):
    """Keys/values [H, n, D] and one query per token [n, H*G, D]."""
    gen = generator(seed)
    keys = torch.randn(heads, n, dim, generator=gen, dtype=dtype)
    values = torch.randn(heads, n, dim, generator=gen, dtype=dtype)
    queries = torch.randn(n, heads * group, dim, generator=gen, dtype=dtype)
    return keys, values, queries


def dense_positions(heads, n):
    return torch.arange(n).expand(heads, n).clone()


def sparse_positions(heads, n, total, window, seed):
    """A compacted cache: per head an ascending random subset of [0, total), ending with the `window` newest."""
    gen = generator(seed)
    rows = []
    for _ in range(heads):
        older = torch.sort(torch.randperm(total - window, generator=gen)[: n - window]).values
        rows.append(torch.cat([older, torch.arange(total - window, total)]))
    return torch.stack(rows)


def observation(keys, values, positions, window_queries=None, window_positions=None, stats=None, budget=0,
                layer_idx=0):
    return LayerObservation(layer_idx=layer_idx, keys=keys, values=values, positions=positions,
                            scale=keys.shape[-1] ** -0.5, window_queries=window_queries,
                            window_positions=window_positions, stats=dict(stats or {}), budget=budget)


def run_causal_stats(policy, keys, values, queries, prefill, layer_idx=0):
    """Feed a causal sequence through `update_stats` as the engine does: one prefill chunk, then one query per step.

    Each step sees the cache of every token so far; the statistics arrive zero-padded for the new entries.
    """
    heads, n, _ = keys.shape
    stats = {name: torch.zeros(heads, 0) for name in policy.stat_names}
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]
    for start, end in steps:
        padded = {name: torch.cat([s, torch.zeros(heads, end - s.shape[1])], dim=1) for name, s in stats.items()}
        obs = observation(keys[:, :end], values[:, :end], dense_positions(heads, end), stats=padded,
                          layer_idx=layer_idx)
        stats = policy.update_stats(obs, queries[start:end], torch.arange(start, end))
        for name in policy.stat_names:
            assert stats[name].shape == (heads, end)
    return stats


# --------------------------------------------------------------------------------------------------------------------
# Dense references (float64, loops)
# --------------------------------------------------------------------------------------------------------------------


def ref_row(query, keys_h, scale, visible, gain=1.0):
    """One query's softmax attention over one head's keys: exp(gain * q.k * scale) over the visible keys."""
    logits = (keys_h.to(F64) @ query.to(F64)) * scale * gain
    logits = logits.masked_fill(~visible, float("-inf"))
    weights = torch.exp(logits - logits.max())
    return weights / weights.sum()


def ref_attention_sum(keys, queries, positions=None, query_positions=None):
    """H2O's statistic: attention column sums over all queries, causal by position, summed over the group: [H, n]."""
    heads, n, dim = keys.shape
    group = queries.shape[1] // heads
    positions = dense_positions(heads, n) if positions is None else positions
    query_positions = torch.arange(queries.shape[0]) if query_positions is None else query_positions
    total = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for i in range(queries.shape[0]):
            visible = positions[h] <= query_positions[i]
            for g in range(group):
                total[h] += ref_row(queries[i, h * group + g], keys[h], dim**-0.5, visible)
    return total


def ahakv_gain(seen, selected):
    """ahakv.md: lambda' = sqrt(2 ln(i / k)) on the scaled logits; i <= k leaves nothing to evict: lambda' = 1."""
    return math.sqrt(2 * math.log(seen / selected)) if seen > selected else 1.0


def ref_window_sums(keys, positions, window_queries, window_positions, gain_for=None):
    """Column sums of the window queries' attention ([H, n]), optionally with a per-row step gain."""
    heads, n, dim = keys.shape
    group = window_queries.shape[1] // heads
    total = torch.zeros(heads, n, dtype=F64)
    for h in range(heads):
        for i in range(window_queries.shape[0]):
            visible = positions[h] <= window_positions[i]
            gain = 1.0 if gain_for is None else gain_for(int(visible.sum()))
            for g in range(group):
                total[h] += ref_row(window_queries[i, h * group + g], keys[h], dim**-0.5, visible, gain)
    return total


def ref_mean_filter(x, kernel, divide_by_kernel=True):
    """Same-size mean filter: entry j averages x[j - k//2 : j + k//2 + 1]; outside the sequence counts as zero."""
    half = kernel // 2
    out = torch.zeros(len(x), dtype=F64)
    for j in range(len(x)):
        part = x[max(0, j - half) : j + half + 1].to(F64)
        out[j] = part.sum() / (kernel if divide_by_kernel else len(part))
    return out


def ref_top(scores, protected, budget):
    """The protected indices plus the highest-scoring others (ties: the earlier index), ascending."""
    protected = sorted(set(protected))
    others = [j for j in range(len(scores)) if j not in protected]
    others.sort(key=lambda j: (-float(scores[j]), j))
    return sorted(protected + others[: budget - len(protected)])


def ref_caote(base, values, fast):
    """caote.md Eq. 21 / 23 for one head: c_j = h_j / (1 - h_j) * ||X - v_j||, h = base / sum(base)."""
    h = base.to(F64) / base.to(F64).sum()
    values = values.to(F64)
    output = values.mean(dim=0) if fast else (h[:, None] * values).sum(dim=0)
    remainder = torch.clamp(1 - h, min=CAOTE_MIN_REMAINDER)
    return h / remainder * torch.sqrt(((output[None, :] - values) ** 2).sum(dim=-1))


def ref_gamma_bar(values_h, kernel):
    """AhaKV's value prior (Eq. 13-14): mean-filtered ||v||^2 over its maximum."""
    nu = (values_h.to(F64) ** 2).sum(dim=-1)
    gamma = ref_mean_filter(nu, kernel, AHAKV_EDGE_DIVIDES_BY_KERNEL)
    return gamma / gamma.max()


def ref_ahakv_scores(obs, recent, kernel, budget):
    """F_hat = gamma_bar * F with F the step-gain attention of the last B_r queries (Eq. 5, 9-12, 13-15)."""
    selected = budget - recent
    accumulated = ref_window_sums(obs.keys, obs.positions, obs.window_queries, obs.window_positions,
                                  gain_for=lambda seen: ahakv_gain(seen, selected))
    return torch.stack([ref_gamma_bar(obs.values[h], kernel) * accumulated[h] for h in range(obs.num_heads)])


def ref_snapkv_scores(obs, window, kernel):
    """SnapKV's votes: window column sums, avg-pooled over the prefix, the window's own votes as they are."""
    votes = ref_window_sums(obs.keys, obs.positions, obs.window_queries, obs.window_positions)
    split = obs.num_tokens - window
    return torch.stack([torch.cat([ref_mean_filter(row[:split], kernel), row[split:]]) for row in votes])


def ref_tova_scores(obs):
    """TOVA: the newest query's attention, averaged over the group's query heads."""
    heads, n, dim = obs.keys.shape
    group = obs.window_queries.shape[1] // heads
    query, position = obs.window_queries[-1], obs.window_positions[-1]
    rows = []
    for h in range(heads):
        visible = obs.positions[h] <= position
        rows.append(sum(ref_row(query[h * group + g], obs.keys[h], dim**-0.5, visible) for g in range(group)) / group)
    return torch.stack(rows)


def as_lists(keep):
    return [row.tolist() for row in keep]


# --------------------------------------------------------------------------------------------------------------------
# H2O
# --------------------------------------------------------------------------------------------------------------------


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
    # caote.md Theorem B.1: every causal row sums to 1, so n rows give n per query head (G * n per KV head).
    heads, n, prefill, dim = 3, 64, 50, 16
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=31)
    stats = run_causal_stats(H2O(recent=0), keys, values, queries, prefill)["attention_sum"]
    torch.testing.assert_close(stats.sum(dim=-1).to(F64), torch.full((heads,), float(group * n), dtype=F64),
                               rtol=1e-5, atol=1e-4)


def _bias_inputs(n, heads, group, dim, trials):
    for trial in range(trials):
        yield causal_inputs(n, heads, group, dim, seed=1000 + trial)


def test_h2o_position_bias_matches_harmonic_sum():
    # ahakv.md: for iid q, k, E[a_ij] = 1/i (row i sees i keys), so E[S_j] = sum_{i=j}^{n} 1/i, decreasing in j.
    n, heads, group, dim, trials, block = 512, 4, 4, 16, 4, 32
    policy = H2O(recent=0)
    mean = torch.zeros(n, dtype=F64)
    for keys, values, queries in _bias_inputs(n, heads, group, dim, trials):
        obs = observation(keys, values, dense_positions(heads, n), stats={"attention_sum": torch.zeros(heads, n)})
        stats = policy.update_stats(obs, queries, torch.arange(n))["attention_sum"]
        mean += stats.to(F64).sum(dim=0) / (heads * group * trials)  # per query head
    harmonic = torch.tensor([sum(1.0 / i for i in range(j + 1, n + 1)) for j in range(n)], dtype=F64)
    blocks = (n - block) // block  # the last block has too few terms to average out
    measured = mean[: blocks * block].reshape(blocks, block).mean(dim=1)
    expected = harmonic[: blocks * block].reshape(blocks, block).mean(dim=1)
    assert ((measured - expected).abs() / expected).max() < 0.03
    assert bool((measured[1:] < measured[:-1]).all())


def test_ahakv_recent_accumulation_is_flat_in_position_unlike_h2o():
    # ahakv.md Eq. 5: only the last B_r rows are summed, so every key before them gets B_r terms of mean 1/i.
    n, heads, group, dim, trials, recent = 512, 4, 4, 16, 4, 32
    budget = recent + 128
    aha, h2o = AhaKV(recent=recent, kernel_size=1), H2O(recent=0)
    aha_mean = torch.zeros(n, dtype=F64)
    h2o_mean = torch.zeros(n, dtype=F64)
    for keys, _, queries in _bias_inputs(n, heads, group, dim, trials):
        values = torch.ones(heads, n, dim)  # gamma_bar = 1: isolate the accumulation
        positions = dense_positions(heads, n)
        obs = observation(keys, values, positions, queries[-recent:], torch.arange(n - recent, n),
                          stats={"attention_sum": torch.zeros(heads, n)}, budget=budget)
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


# --------------------------------------------------------------------------------------------------------------------
# TOVA
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("group,budget", [(1, 10), (3, 17)])
def test_tova_keeps_top_of_last_query_row_mean_over_group(window, sparse, group, budget):
    heads, n, dim = 3, 40, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=40 + group)
    positions = sparse_positions(heads, n, 100, window, seed=41) if sparse else dense_positions(heads, n)
    obs = observation(keys, values, positions, queries[-window:], positions[0, -window:].clone(), budget=budget)
    keep = TOVA().keep_indices(obs, budget)
    reference = ref_tova_scores(obs)  # the newest (last) window query only
    assert as_lists(keep) == [ref_top(reference[h], [], budget) for h in range(heads)]


def test_tova_window_query_older_than_some_entries_is_causal():
    # A window query older than entries appended after it must not see them (causal by position, not by slot).
    heads, group, n, dim = 2, 2, 30, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=43)
    positions = dense_positions(heads, n)
    obs = observation(keys, values, positions, queries[20:21], torch.tensor([20]), budget=12)
    keep = TOVA().keep_indices(obs, 12)
    reference = ref_tova_scores(obs)
    assert as_lists(keep) == [ref_top(reference[h], [], 12) for h in range(heads)]


# --------------------------------------------------------------------------------------------------------------------
# AhaKV
# --------------------------------------------------------------------------------------------------------------------


def ahakv_obs(n, heads, group, dim, recent, budget, seed, sparse):
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=seed)
    if sparse:
        positions = sparse_positions(heads, n, 3 * n, recent, seed=seed + 1)
    else:
        positions = dense_positions(heads, n)
    return observation(keys, values, positions, queries[-recent:], positions[0, -recent:].clone(), budget=budget)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("group,recent,budget,kernel", [(1, 4, 16, 7), (3, 8, 24, 7), (2, 6, 30, 5), (2, 6, 40, 3),
                                                        (2, 4, 62, 7)])  # i / k just above 1: lambda' < 1
def test_ahakv_matches_dense_reference(sparse, group, recent, budget, kernel):
    heads, n, dim = 3, 64, 8
    obs = ahakv_obs(n, heads, group, dim, recent, budget, seed=50 + budget + group, sparse=sparse)
    keep = AhaKV(recent=recent, kernel_size=kernel).keep_indices(obs, budget)
    reference = ref_ahakv_scores(obs, recent, kernel, budget)
    expected = [ref_top(reference[h], range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


def test_ahakv_rows_seeing_at_most_k_keys_use_the_plain_softmax():
    # ahakv.md: "If i <= k there is nothing to evict: lambda' = 1". Window queries older than most entries (causal by
    # position) see few keys; the newest sees more than k, so both branches of the gain meet in one score.
    heads, group, n, dim, recent, budget = 2, 2, 96, 8, 3, 30  # k = 27
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=65)
    window_positions = torch.tensor([9, 20, n - 1])  # rows see 10 and 21 keys (<= k) and 96 keys (> k)
    obs = observation(keys, values, dense_positions(heads, n), queries[window_positions], window_positions,
                      budget=budget)
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
        torch.testing.assert_close(gamma_bar[h, half : n - half] / gamma_bar[h, half : n - half].max(),
                                   reference[half : n - half] / reference[half : n - half].max(), rtol=1e-5,
                                   atol=1e-6)


def test_ahakv_value_prior_edges_follow_snapkv_mean_pooling():
    # The same measurement at the first and last kernel // 2 entries, where the spec's "mean filter, same padding,
    # same as SnapKV's pooling" decides the divisor.
    heads, group, n, dim, recent, budget, kernel = 2, 1, 30, 8, 4, 12, 7
    gen = generator(71)
    values = torch.randn(heads, n, dim, generator=gen)
    queries = torch.randn(recent, heads * group, dim, generator=gen)
    obs = observation(torch.zeros(heads, n, dim), values, dense_positions(heads, n), queries,
                      torch.arange(n - recent, n), budget=budget)
    accumulated = torch.zeros(n, dtype=F64)
    for p in range(n - recent, n):
        accumulated[: p + 1] += group / (p + 1)
    gamma_bar = AhaKV(recent=recent, kernel_size=kernel).score(obs).to(F64) / accumulated
    expected = torch.stack([ref_gamma_bar(values[h], kernel) for h in range(heads)])
    torch.testing.assert_close(gamma_bar, expected, rtol=1e-5, atol=1e-6)


def test_ahakv_step_gain_row_entropy_is_log_budget():
    # ahakv.md Eq. 12: lambda = sqrt(2 log(i/k) / d) on the RAW q.k makes the expected row entropy log k
    # (d = 128, i = 4096, k = 1000: about 6.92 vs log 1000 = 6.91). With B_r = 1 and a flat value prior the policy's
    # score is exactly that one sharpened row.
    heads, dim, n, selected = 24, 128, 4096, 1000
    gen = generator(80)
    keys = torch.randn(heads, n, dim, generator=gen)
    query = torch.randn(1, heads, dim, generator=gen)
    obs = observation(keys, torch.ones(heads, n, dim), dense_positions(heads, n), query, torch.tensor([n - 1]),
                      budget=selected + 1)
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


# --------------------------------------------------------------------------------------------------------------------
# CAOTE / FastCAOTE: the score's properties
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
        change = [torch.linalg.vector_norm(output - torch.softmax(logits[[i for i in range(n) if i != j]], 0)
                                           @ values[h][[i for i in range(n) if i != j]]) for j in range(n)]
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
    torch.testing.assert_close(caote_score(uniform, values, True), caote_score(uniform, values, False),
                               rtol=1e-6, atol=1e-6)
    # and both are the reference formula
    for h in range(heads):
        torch.testing.assert_close(caote_score(uniform, values, True)[h].to(F64),
                                   ref_caote(uniform[h], values[h], True), rtol=1e-5, atol=1e-6)
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
# CAOTE / FastCAOTE composed with base policies: kept sets against dense references
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
    base = ref_attention_sum(keys, queries) / group  # caote.md: the group's scores averaged before normalising
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
    obs = observation(keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n),
                      budget=budget)
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
        obs, budget)
    base = ref_ahakv_scores(obs, recent, kernel, budget)
    expected = [ref_top(ref_caote(base[h], obs.values[h], fast), range(n - recent, n), budget) for h in range(heads)]
    assert as_lists(keep) == expected


# --------------------------------------------------------------------------------------------------------------------
# MAT
# --------------------------------------------------------------------------------------------------------------------


def ref_anchor_logits(keys, queries):
    """mat.md: pi_i = q_i . k_0 / sqrt(d), averaged over the group's query heads: [H, n]."""
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
    keep = policy.keep_indices(observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget,
                                           layer_idx=3), budget)
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
    keep = policy.keep_indices(observation(keys, values, dense_positions(heads, n), stats=stats, budget=budget,
                                           layer_idx=4), budget)
    expected = [0] + planted + list(range(n - 12, n))
    assert as_lists(keep) == [expected] * heads


# --------------------------------------------------------------------------------------------------------------------
# EMS
# --------------------------------------------------------------------------------------------------------------------


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
    """ems.md: Eq. 2, mean pooling, evict-then-merge with a zero class. Returns keep, keys, values and counts."""
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
            similarity = [cosine(obs.keys[h, i], obs.keys[h, c]) * cosine(obs.values[h, i], obs.values[h, c])
                          for c in centres]
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
    torch.testing.assert_close(stats["attention_sum"].to(F64), ref_attention_sum(keys, queries), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("group,window,budget,kernel,tau,gamma", [
    (1, 6, 14, 7, 0.6, 4.0),
    (2, 8, 20, 7, 0.6, 3.0),
    (2, 4, 12, 5, 0.3, 2.5),
    (3, 6, 16, 3, 0.8, 4.0),
])
def test_ems_matches_dense_reference(group, window, budget, kernel, tau, gamma):
    heads, n, prefill, dim = 3, 80, 68, 8
    keys, values, queries = ems_case(n, heads, group, dim, seed=210 + budget)
    policy = EMS(window=window, kernel_size=kernel, tau=tau, gamma=gamma)
    stats = run_causal_stats(policy, keys, values, queries, prefill)
    obs = observation(keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n),
                      stats=stats, budget=budget)
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
    obs = observation(keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n),
                      stats=stats, budget=budget)
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
    torch.testing.assert_close(selection.keys, keys.gather(1, index[..., None].expand(-1, -1, dim)), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(selection.values, values.gather(1, index[..., None].expand(-1, -1, dim)), rtol=1e-6,
                               atol=1e-6)


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
    obs = observation(keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n),
                      stats=stats, budget=budget)
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
    obs = observation(keys, values, dense_positions(1, n), window_queries, torch.arange(n - window, n), stats=stats,
                      budget=budget)
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
    obs = observation(keys, values, dense_positions(1, n), window_queries, torch.arange(n - window, n),
                      stats={"attention_sum": s_glo}, budget=budget)
    selection = EMS(window=window, kernel_size=1, tau=1.0, gamma=1.0).select(obs, budget)
    assert selection.keep_indices.tolist() == [expected]
    # with kernel 3 the mean pooling (zero padding) decides: token 3 and 5 inherit a third of token 4's score
    pooled = ref_mean_filter(s_gl, 3)
    expected = sorted(sorted(range(n - window), key=lambda j: (-float(pooled[j]), j))[: budget - window] + [6, 7])
    selection = EMS(window=window, kernel_size=3, tau=1.0, gamma=1.0).select(obs, budget)
    assert selection.keep_indices.tolist() == [expected]


# --------------------------------------------------------------------------------------------------------------------
# Every policy: no eviction when the budget covers everything
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["h2o", "tova", "ahakv", "mat", "ems", "h2o+caote", "tova+caote", "snapkv+caote",
                                  "ahakv+caote", "h2o+fastcaote", "tova+fastcaote", "snapkv+fastcaote",
                                  "ahakv+fastcaote"])
def test_budget_covering_everything_keeps_everything_unchanged(name):
    heads, group, n, dim = 2, 2, 32, 8
    keys, values, queries = causal_inputs(n, heads, group, dim, seed=270)
    policy = POLICIES[name](**({"window": 4} if name.startswith(("snapkv", "ems")) else {}))
    stats = run_causal_stats(policy, keys, values, queries, 24, layer_idx=3)
    window = max(policy.window_size(), 1)
    obs = observation(keys, values, dense_positions(heads, n), queries[-window:], torch.arange(n - window, n),
                      stats=stats, budget=n, layer_idx=3)
    selection = policy.select(obs, n)
    assert as_lists(selection.keep_indices) == [list(range(n))] * heads
    if selection.keys is not None:
        torch.testing.assert_close(selection.keys, keys)
        torch.testing.assert_close(selection.values, values)
